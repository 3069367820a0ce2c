"""One import direction: the package's imports form no cycle and only go down the layers.

The layers, lowest first (a module may import its own layer and the ones below, never
one above; ``docs/concepts.md`` "Code layout" lists the same table):

====  ============================================================================
 0    ``config``, ``mutation``, ``backends``          plain values, test switches, backend names
 1    ``ir``, ``distributions``, ``rng``              the IR, the laws, random streams
 2    ``ir_text``, ``planner.lint``, ``verify``,      IR text + checker, the couplings,
      ``costmodel``                                   latencies, calibration, decision rule
 3    ``pipeline``                                    the pass runner and instruments
 4    ``planner``                                     the reference passes
 5    ``plan``                                        ``plan_tree``
 6    ``kernels``                                     numba / Triton kernels and their pipeline
 7    ``models``                                      adapters (target / draft interfaces)
 8    ``decode``, ``walk``, ``stream``                ``plan_and_decode``, the walk by backend,
                                                      ``decode_requests``
 9    ``testing``, ``dump``, ``loading``, ``probe``,  oracle, drawings, the default model,
      ``calibrate``, ``prompts_file``                 measuring dtype + latencies at load,
                                                      prompts files of ``generate``
10    ``bench``, ``train``                            benchmarks, draft training
11    ``cli``                                         the ``rheoplan`` command
12    ``rheoplan`` (``__init__``)                     the public facade; nothing inside imports it
====  ============================================================================

Every import counts, function-local ones included (they hide cycles just as well), and a
function-local import must be of an optional or heavy dependency (``LOCAL_OK``), of a
Triton kernel module, or sit in a ``try`` that handles ``ImportError``. A module in no
layer fails the test: add it here and in docs/concepts.md.
``planner/`` and ``kernels/`` install as ``rheoplan.planner`` / ``rheoplan.kernels``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from _package import PACKAGES, ROOT, modules

LAYERS = [
    ["rheoplan.config", "rheoplan.mutation", "rheoplan.backends"],
    ["rheoplan.ir", "rheoplan.distributions", "rheoplan.rng"],
    ["rheoplan.ir_text", "rheoplan.planner.lint", "rheoplan.verify", "rheoplan.costmodel"],
    ["rheoplan.pipeline"],
    ["rheoplan.planner"],
    ["rheoplan.plan"],
    ["rheoplan.kernels"],
    ["rheoplan.models"],
    ["rheoplan.decode", "rheoplan.walk", "rheoplan.stream"],
    ["rheoplan.testing", "rheoplan.dump", "rheoplan.loading", "rheoplan.probe", "rheoplan.calibrate",
     "rheoplan.prompts_file"],
    ["rheoplan.bench", "rheoplan.train"],
    ["rheoplan.cli"],
    ["rheoplan"],  # the package's __init__ only (matched exactly)
]

#: top-level packages a function may import locally: optional extras or slow to import
LOCAL_OK = {"transformers", "safetensors", "scipy", "networkx", "matplotlib", "tomllib", "importlib"}


def import_graph(packages: dict[str, Path], top: str) -> dict[str, set[str]]:
    """``{module: modules it imports}``, restricted to modules under ``top``. ``from a
    import b`` counts as importing ``a.b`` when that is a module, else ``a``."""
    mods = modules(packages)
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import rheoplan.x.y` names module rheoplan.x.y
                    t = t.rpartition(".")[0]
                if t and (t == top or t.startswith(top + ".")) and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def layer_of(module: str, layers: list[list[str]]) -> int:
    """Index of the layer whose entry is the longest prefix of ``module``."""
    best, best_len = None, -1
    top = layers[-1][0]  # the facade: only the package itself, not everything below it
    for i, entries in enumerate(layers):
        for e in entries:
            covers = module == e or (e != top and module.startswith(e + "."))
            if covers and len(e) > best_len:
                best, best_len = i, len(e)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS (and docs/concepts.md)")
    return best


def upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a, layers)}) imports {b} (layer {layer_of(b, layers)})"
                  for a, deps in graph.items() for b in deps if layer_of(b, layers) > layer_of(a, layers))


@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGES, "rheoplan")


def test_the_graph_sees_the_package(graph):
    assert "rheoplan.decode" in graph["rheoplan"]
    assert "rheoplan.planner.linearize" in graph["rheoplan.decode"]
    assert "rheoplan.loading" in graph["rheoplan.bench.decode"]


def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_imports_only_go_down_the_layers(graph):
    assert upward_imports(graph, LAYERS) == []


def local_imports(packages: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Function-local imports that are neither in ``LOCAL_OK``, nor of a Triton kernel
    module (``triton`` in the name: GPU-only, slow to import), nor guarded by a ``try``
    that handles ``ImportError``."""
    out = []
    for name, f in modules(packages).items():
        tree = ast.parse(f.read_text(), str(f))
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers):
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in guarded:
                    continue
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                names = [a.name for a in node.names]
                if all(m.split(".")[0] in LOCAL_OK for m in mods) or any("triton" in x for x in mods + names):
                    continue
                out.append(f"{f.relative_to(root).as_posix()}:{node.lineno}: {ast.unparse(node)}")
    return sorted(set(out))


def test_function_local_imports_are_only_optional_or_heavy():
    assert local_imports(PACKAGES) == []


def test_benchmarks_never_import_the_cli(graph):
    assert not [m for m, deps in graph.items() if m.startswith("rheoplan.bench") and "rheoplan.cli" in deps]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_a_planted_cycle_and_an_upward_import_are_caught(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/low.py": "def f():\n    from pkg import high\n",
                      "pkg/high.py": "from pkg.low import f\n", "pkg/sub/__init__.py": "",
                      "pkg/sub/leaf.py": "from ..high import f\n"})
    g = import_graph({"pkg": tmp_path / "pkg"}, "pkg")
    assert cycles(g) == [["pkg.high", "pkg.low"]]
    layers = [["pkg.low"], ["pkg.high"], ["pkg.sub"], ["pkg"]]
    assert upward_imports(g, layers) == ["pkg.low (layer 0) imports pkg.high (layer 1)"]
    assert g["pkg.sub.leaf"] == {"pkg.high"}
    with pytest.raises(KeyError, match="pkg.other is in no layer"):
        layer_of("pkg.other", layers)


def test_a_planted_local_import_is_caught(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "",
                      "pkg/a.py": ("def f():\n    import json\n    import scipy\n"
                                   "    try:\n        import optional_thing\n    except ImportError:\n"
                                   "        pass\n")})
    assert local_imports({"pkg": tmp_path / "pkg"}, tmp_path) == ["pkg/a.py:2: import json"]
