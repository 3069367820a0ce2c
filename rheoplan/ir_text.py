"""The draft-tree IR as text: the readable text form and JSON, both exact round-trips.

The text form is the one users read (``PrintAfterAll``, ``DumpIR``, ``RHEOPLAN_DEBUG=3``)
and it parses back exactly: ``from_text(to_text(t))`` has the same tensors, bit for
bit. Floats are printed as the shortest decimal that reads back to the same float32,
so ``0.1`` stays ``0.1`` and nothing is lost. The grammar is in ``docs/ir.md``. Drawing
(DOT, networkx, PNG) lives in ``rheoplan.dump``.

Example (one tree, K = 2 slots, m = 1)::

    draft_tree B=1 capacity=7 max_expanded=3 support=4 cur_depth=1 rheostat=1 slots=2
    tree 0 prefix_len=0 n_nodes=3 n_expanded=1
      %0 = ROOT depth=0 token=3 q=1 w=1 score=0 kept expanded row=0
      %1 = DET parent=%0 depth=1 slot=0 token=1 q=0.5 w=0.5 score=-0.6931472
      %2 = SAMPLED parent=%0 depth=1 slot=1 token=2 q=0.25 w=0.5 score=-0.6931472
      row 0 node=%0 n=4 z=0.5 Y=2 q~(Y)=0.5 y_node=%2
        support 1:0.5 2:0.25 0:0.125 3:0.125

Entries past ``n_nodes`` / ``n_expanded`` / ``sup_n`` / ``linear.n`` are not printed;
they hold the empty values (-1, 0, False), as every pass leaves them.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields

import numpy as np
import torch

from rheoplan.ir import DraftTree, LinearTree, NodeKind, empty_tree

__all__ = ["to_text", "from_text", "to_json", "from_json", "fmt_float", "parse_float"]


# -- floats ------------------------------------------------------------------------------


def fmt_float(x: float) -> str:
    """Shortest text that reads back (``parse_float``) to the same float32.

    Example: ``fmt_float(0.1) == '0.1'``, ``fmt_float(float('-inf')) == '-inf'``.
    """
    v = np.float32(x)
    if np.isnan(v):
        return "nan"
    if np.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "-0" if np.signbit(v) else "0"
    if 1e-4 <= abs(v) < 1e7:
        return np.format_float_positional(v, unique=True, trim="-")
    return np.format_float_scientific(v, unique=True, trim="-")


def parse_float(s: str) -> float:
    return float(np.float32(s))


def token_text(tokenizer, token: int) -> str:
    """`` "text"`` of ``token`` (a leading space, then JSON-quoted), or "" without a tokenizer."""
    if tokenizer is None or token < 0:
        return ""
    try:
        text = tokenizer.decode([token])
    except Exception as exc:  # a broken tokenizer must not hide the tree
        text = f"<decode error: {type(exc).__name__}>"
    return " " + json.dumps(text, ensure_ascii=False)


def kind_name(k: int) -> str:
    """``NodeKind`` name of a kind code; ``UNUSED`` for an empty slot (-1)."""
    return NodeKind(k).name if k >= 0 else "UNUSED"


# -- text ----------------------------------------------------------------------------------


def to_text(tree: DraftTree, tokenizer=None) -> str:
    """The text IR of all ``B`` trees: a header, then one line per node, expansion rows
    and (after ``linearize``) the linear order. ``tokenizer`` (anything with
    ``.decode([id])``) adds each token's text in quotes; the parser ignores it."""
    t = tree
    S = t.sup_token.shape[-1]
    out = [f"draft_tree B={t.batch} capacity={t.capacity} max_expanded={t.exp_node.shape[1]} "
           f"support={S} cur_depth={t.cur_depth} rheostat={t.rheostat} slots={t.slots}"
           + (f" sup_width={t.sup_width}" if t.sup_width else "")]
    f = fmt_float
    for b in range(t.batch):
        n, E = int(t.n_nodes[b]), int(t.n_expanded[b])
        out.append(f"tree {b} prefix_len={int(t.prefix_len[b])} n_nodes={n} n_expanded={E}")
        par, dep, tok, kind, slot = (x[b, :n].tolist() for x in (t.parent, t.depth, t.token, t.kind, t.slot))
        q, w, sc = (x[b, :n].tolist() for x in (t.q, t.weight, t.score))
        expd, kept, row = t.expanded[b, :n].tolist(), t.kept[b, :n].tolist(), t.exp_row[b, :n].tolist()
        for v in range(n):
            parts = [f"  %{v} = {kind_name(kind[v])}"]
            if par[v] >= 0:
                parts.append(f"parent=%{par[v]}")
            parts.append(f"depth={dep[v]}")
            if slot[v] >= 0:
                parts.append(f"slot={slot[v]}")
            parts.append(f"token={tok[v] if tok[v] >= 0 else '?'}{token_text(tokenizer, tok[v])}")
            parts.append(f"q={f(q[v])} w={f(w[v])} score={f(sc[v])}")
            if kept[v]:
                parts.append("kept")
            if expd[v]:
                parts.append("expanded")
            if row[v] >= 0:
                parts.append(f"row={row[v]}")
            out.append(" ".join(parts))
        for r in range(E):
            sn = int(t.sup_n[b, r])
            y = int(t.y_token[b, r])
            yn = int(t.y_node[b, r])
            line = (f"  row {r} node=%{int(t.exp_node[b, r])} n={sn} z={f(float(t.z[b, r]))} "
                    f"Y={y if y >= 0 else '?'}{token_text(tokenizer, y)} q~(Y)={f(float(t.y_qtilde[b, r]))} "
                    f"y_node={'%' + str(yn) if yn >= 0 else '-'}")
            out.append(line)
            toks, qs = t.sup_token[b, r, :sn].tolist(), t.sup_q[b, r, :sn].tolist()
            out.append("    support " + " ".join(f"{a}:{f(c)}" for a, c in zip(toks, qs)))
    if t.linear is not None:
        out += _linear_text(t.linear)
    return "\n".join(out)


def _linear_text(lin: LinearTree) -> list[str]:
    B, L = lin.node.shape
    out = [f"linear L={L} W={lin.ancestor_bits.shape[-1]} P={lin.paths.shape[1]} path_len={lin.paths.shape[2]}"]
    for b in range(B):
        n = int(lin.n[b])
        out.append(f"linear {b} n={n} n_paths={int(lin.n_paths[b])}")
        for i in range(n):
            mask = "".join("1" if x else "0" for x in lin.ancestor_mask[b, i, :n].tolist())
            bits = ",".join(f"0x{w & (2**64 - 1):x}" for w in lin.ancestor_bits[b, i].tolist())
            p = int(lin.parent[b, i])
            out.append(f"  @{i} = %{int(lin.node[b, i])} token={int(lin.token[b, i])} "
                       f"pos={int(lin.position[b, i])} parent={'@' + str(p) if p >= 0 else '-'} "
                       f"depth={int(lin.depth[b, i])} row={int(lin.exp_row[b, i])} "
                       f"first_child={int(lin.first_child[b, i])} n_children={int(lin.n_children[b, i])} "
                       f"mask={mask} bits={bits}")
        for j in range(int(lin.n_paths[b])):
            path = [x for x in lin.paths[b, j].tolist() if x >= 0]
            out.append(f"  path {j} " + " ".join(f"@{x}" for x in path))
    return out


_TOKEN_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\S+')


def _fields(line: str) -> tuple[list[str], dict[str, str]]:
    """Split a line into bare words and ``key=value`` pairs; quoted token text is dropped."""
    words, kv = [], {}
    for w in _TOKEN_RE.findall(line):
        if w.startswith('"'):
            continue
        if "=" in w and not w.startswith("="):
            k, v = w.split("=", 1)
            kv[k] = v
        else:
            words.append(w)
    return words, kv


def _ref(s: str, sigil: str) -> int:
    if s in ("-", "?"):
        return -1
    if not s.startswith(sigil):
        raise ValueError(f"expected a {sigil}N reference, got {s!r}")
    return int(s[1:])


def _int(s: str) -> int:
    return -1 if s == "?" else int(s)


def from_text(s: str) -> DraftTree:
    """Parse ``to_text`` output back into a ``DraftTree`` (exactly the same tensors)."""
    lines = [ln for ln in s.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines or not lines[0].startswith("draft_tree "):
        raise ValueError("text IR must start with a 'draft_tree B=... capacity=...' header line")
    _, h = _fields(lines[0])
    B, M, E, S = (int(h[k]) for k in ("B", "capacity", "max_expanded", "support"))
    t = empty_tree(B, M, E, S, torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                   int(h["rheostat"]), int(h["slots"]))
    t = t.replace(cur_depth=int(h["cur_depth"]), sup_width=int(h.get("sup_width", 0)))
    for x in (t.depth, t.token, t.kind):  # the root line fills these back in
        x[:, 0] = -1
    t.q[:, 0] = t.weight[:, 0] = 0.0
    t.kept[:, 0] = False
    b, r = 0, -1
    lin_lines: list[str] = []
    in_linear = False
    for lineno, ln in enumerate(lines[1:], start=2):
        try:
            words, kv = _fields(ln)
            if in_linear or words[0] == "linear":
                in_linear = True
                lin_lines.append(ln)
            elif words[0] == "tree":
                b = int(words[1])
                t.prefix_len[b] = int(kv["prefix_len"])
                t.n_nodes[b] = int(kv["n_nodes"])
                t.n_expanded[b] = int(kv["n_expanded"])
            elif words[0].startswith("%"):
                v = _ref(words[0], "%")
                t.kind[b, v] = -1 if words[2] == "UNUSED" else int(NodeKind[words[2]])
                t.parent[b, v] = _ref(kv.get("parent", "-"), "%")
                t.depth[b, v] = int(kv["depth"])
                t.slot[b, v] = int(kv.get("slot", "-1"))
                t.token[b, v] = _int(kv["token"])
                t.q[b, v] = parse_float(kv["q"])
                t.weight[b, v] = parse_float(kv["w"])
                t.score[b, v] = parse_float(kv["score"])
                t.kept[b, v] = "kept" in words
                t.expanded[b, v] = "expanded" in words
                t.exp_row[b, v] = int(kv.get("row", "-1"))
            elif words[0] == "row":
                r = int(words[1])
                t.exp_node[b, r] = _ref(kv["node"], "%")
                t.sup_n[b, r] = int(kv["n"])
                t.z[b, r] = parse_float(kv["z"])
                t.y_token[b, r] = _int(kv["Y"])
                t.y_qtilde[b, r] = parse_float(kv["q~(Y)"])
                t.y_node[b, r] = _ref(kv["y_node"], "%")
            elif words[0] == "support":
                pairs = [w.split(":") for w in ln.split()[1:]]
                if len(pairs) != int(t.sup_n[b, r]):
                    raise ValueError(f"support has {len(pairs)} entries, row says n={int(t.sup_n[b, r])}")
                for j, (a, c) in enumerate(pairs):
                    t.sup_token[b, r, j] = int(a)
                    t.sup_q[b, r, j] = parse_float(c)
            else:
                raise ValueError(f"unknown line kind {words[0]!r}")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"text IR line {lineno}: {exc!r} in {ln.strip()!r}") from None
    if lin_lines:
        t = t.replace(linear=_parse_linear(lin_lines, B))
    return t


def _parse_linear(lines: list[str], B: int) -> LinearTree:
    _, h = _fields(lines[0])
    L, W, P, D1 = (int(h[k]) for k in ("L", "W", "P", "path_len"))
    full = lambda *s: torch.full(s, -1, dtype=torch.int64)  # noqa: E731
    node, token, position, parent, depth, exp_row, first_child = (full(B, L) for _ in range(7))
    n_children = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L, L, dtype=torch.bool)
    bits = torch.zeros(B, L, W, dtype=torch.int64)
    paths = full(B, P, D1)
    n = torch.zeros(B, dtype=torch.int64)
    n_paths = torch.zeros(B, dtype=torch.int64)
    b = 0
    for ln in lines[1:]:
        words, kv = _fields(ln)
        if words[0] == "linear":
            b = int(words[1])
            n[b], n_paths[b] = int(kv["n"]), int(kv["n_paths"])
        elif words[0].startswith("@"):
            i = _ref(words[0], "@")
            node[b, i] = _ref(words[2], "%")
            token[b, i] = int(kv["token"])
            position[b, i] = int(kv["pos"])
            parent[b, i] = _ref(kv["parent"], "@")
            depth[b, i] = int(kv["depth"])
            exp_row[b, i] = int(kv["row"])
            first_child[b, i] = int(kv["first_child"])
            n_children[b, i] = int(kv["n_children"])
            m = kv["mask"]
            mask[b, i, : len(m)] = torch.tensor([c == "1" for c in m], dtype=torch.bool)
            words_ = [int(x, 16) for x in kv["bits"].split(",")]
            bits[b, i] = torch.tensor([x - 2**64 if x >= 2**63 else x for x in words_], dtype=torch.int64)
        elif words[0] == "path":
            j = int(words[1])
            p = [_ref(x, "@") for x in words[2:]]
            paths[b, j, : len(p)] = torch.tensor(p, dtype=torch.int64)
        else:
            raise ValueError(f"unknown linear line kind {words[0]!r} in {ln.strip()!r}")
    return LinearTree(n=n, node=node, token=token, position=position, parent=parent, depth=depth,
                      ancestor_mask=mask, ancestor_bits=bits, paths=paths, n_paths=n_paths,
                      first_child=first_child, n_children=n_children, exp_row=exp_row)


# -- JSON ------------------------------------------------------------------------------------


def _enc(v):
    if isinstance(v, torch.Tensor):
        data = v.flatten().tolist()
        if v.is_floating_point():
            data = [x if np.isfinite(x) else str(x) for x in data]  # JSON has no nan/inf
        return {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "data": data}
    if isinstance(v, LinearTree):
        return {f.name: _enc(getattr(v, f.name)) for f in fields(v)}
    return v


def _dec(d):
    dtype = getattr(torch, d["dtype"])
    data = d["data"]
    if dtype.is_floating_point:
        data = [float(x) for x in data]  # "nan"/"inf"/"-inf" strings included
    return torch.tensor(data, dtype=dtype).reshape(d["shape"])


def to_json(tree: DraftTree) -> str:
    """Every field, tensors as ``{dtype, shape, data}`` (exact: float32 -> double is exact)."""
    return json.dumps({f.name: _enc(getattr(tree, f.name)) for f in fields(tree)})


def from_json(s: str) -> DraftTree:
    d = json.loads(s)
    out = {}
    for f in fields(DraftTree):
        v = d.get(f.name)
        if f.name == "linear":
            out[f.name] = None if v is None else LinearTree(**{k: _dec(x) for k, x in v.items()})
        elif isinstance(v, dict):
            out[f.name] = _dec(v)
        else:
            out[f.name] = v
    return DraftTree(**out)
