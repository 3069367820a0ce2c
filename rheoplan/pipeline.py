"""The pass pipeline: a list of passes run over a DraftTree with a context, plus
instruments (print-after-all, dump-IR-to-numbered-files, per-pass timing,
verify-after-each-pass) in the style of TVM's pass instruments.

``RHEOPLAN_DEBUG`` (environment variable) turns instruments on without code changes:

====  ==========================================================================
0     nothing (default)
1     per-pass timing summary printed after each pipeline run
2     1 + verify the IR invariants after every pass (``rheoplan.planner.lint``)
3     2 + print the IR after every pass
4     3 + dump the IR after every pass to numbered files in ``$RHEOPLAN_DUMP_DIR``
      (default ``./rheoplan_dump``), e.g. ``step0000/017_prune.txt``
====  ==========================================================================
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from rheoplan.backends import check_backend
from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree
from rheoplan.ir_text import to_text
from rheoplan.planner.lint import lint

#: ``draft(tree, nodes [B, n] int64, -1 padded) -> logits [B, n, V]``
DraftFn = Callable[[DraftTree, torch.Tensor], torch.Tensor]
#: ``sampler(tree_index, node_id, qtilde [n] float64) -> index into the tail``
SamplerFn = Callable[[int, int, torch.Tensor], int]


class BatchSampler(Protocol):
    """A sampler that can also give the Gumbel noise of many rows at once; the Triton
    ``assign`` pass uses it (one call per depth, on the tree's device), the numba one its
    ``stream_rows``; both fall back to calling the sampler row by row when it lacks them.

    ``gumbel_rows(trees [R], nodes [R], n, uniform) -> [R, n]`` float64: the draw of row r
    is ``argmax(log(qtilde_r) + noise[r, :len(qtilde_r)])``, exactly what ``__call__``
    draws. ``uniform(seed, step, trees, nodes, purpose, n)`` is the pass's generator of
    ``Streams`` uniforms (numba or Triton Philox), so the sampler imports no kernel.
    ``stream_rows(trees, nodes) -> (seed, step, ids, purpose)`` (optional) names the
    streams themselves, for a kernel that reads them as it draws (the numba ``assign``);
    the draw is the same.
    """

    def __call__(self, b: int, node: int, qtilde: torch.Tensor) -> int: ...

    def gumbel_rows(self, trees: torch.Tensor, nodes: torch.Tensor, n: int, uniform) -> torch.Tensor: ...


class PassError(RuntimeError):
    """A pass failed or left an ill-formed IR; the message names it and the passes before."""


class Pass(Protocol):
    name: str

    def __call__(self, tree: DraftTree, ctx: "PassContext") -> DraftTree: ...


class Instrument:
    """Hooks around every pass. Subclass and override what you need."""

    def run_start(self, tree: DraftTree, ctx: "PassContext") -> None: ...
    def before_pass(self, index: int, name: str, tree: DraftTree, ctx: "PassContext") -> None: ...
    def after_pass(self, index: int, name: str, tree: DraftTree, ctx: "PassContext") -> None: ...
    def run_end(self, tree: DraftTree, ctx: "PassContext") -> None: ...


@dataclass
class PassContext:
    """Everything a pass may read besides the tree. Passes never mutate it except
    through ``history`` (the names of passes run so far, for error messages)."""

    tree_cfg: TreeConfig
    sampling: SamplingConfig
    draft: DraftFn | None = None
    sampler: SamplerFn | None = None
    step: int = 0
    instruments: list[Instrument] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    #: ``(flag, message)`` checks a device pass records instead of syncing the host: a
    #: 0-d bool tensor, True when broken. ``run_pipeline`` checks them all at once at the end.
    deferred_checks: list = field(default_factory=list)
    #: the run owns its trees: nothing outside it reads a tree once the next pass has it (no
    #: instrument, no pass of your own), so a pass may write the tree it is given instead of
    #: a copy, and returns the result as a new ``DraftTree`` object (identity stays a
    #: version: ``LastDecision`` and the cost gate match trees by it). Only the decode's
    #: fused cost pipeline sets it (``rheoplan.kernels.plan.cpu_pipeline``).
    in_place: bool = False


@dataclass(frozen=True)
class FnPass:
    """A named pure function ``(tree, ctx) -> tree``.

    A built-in pass also names its other implementations in ``impls``: backend name ->
    ``"module:function"`` (imported only when ``lower`` picks it, so the reference
    passes never import numba or Triton). ``fn`` is the implementation that runs; for
    a pass you write yourself it is the only one, and ``lower`` leaves it alone.
    """

    name: str
    fn: Callable[[DraftTree, PassContext], DraftTree]
    impls: tuple[tuple[str, str], ...] = ()
    #: the torch reference of a built-in pass (``fn`` after lowering may be a kernel)
    reference: Callable[[DraftTree, PassContext], DraftTree] | None = None

    def __call__(self, tree: DraftTree, ctx: PassContext) -> DraftTree:
        return self.fn(tree, ctx)


def builtin_pass(name: str, fn: Callable[[DraftTree, PassContext], DraftTree], **impls: str) -> FnPass:
    """A built-in pass: ``fn`` is its torch reference, ``impls`` its kernel implementations
    by backend (``numba="rheoplan.kernels.plan.cpu_pass:prune"``, ``triton=...``)."""
    return FnPass(name, fn, tuple(sorted(impls.items())), reference=fn)


def _load(spec: str) -> Callable:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def lower(passes: Sequence, backend: str) -> list:
    """The pass list with each built-in pass swapped for its ``backend`` implementation.

    ``backend`` is a concrete backend (``reference``, ``numba``, ``triton``; resolve
    ``auto`` first with ``rheoplan.backends.resolve_backend``). Passes without
    implementations (your own) run as written, between fast built-ins; ``Repeat`` blocks
    are lowered inside. Lowering a lowered list again works (it starts from ``reference``).

    Example:
        >>> from rheoplan.planner.default import DEFAULT_PIPELINE
        >>> [p.fn.__module__ for p in lower(DEFAULT_PIPELINE, "numba")[1:]]
        ['rheoplan.kernels.plan.cpu_pass', 'rheoplan.kernels.plan.cpu_pass']
    """
    if check_backend(backend) == "auto":
        raise ValueError("backend='auto' must be resolved first (rheoplan.backends.resolve_backend): "
                         "allowed here 'reference', 'numba', 'triton'")
    out = []
    for p in passes:
        if isinstance(p, Repeat):
            out.append(Repeat(p.name, tuple(lower(p.body, backend)), p.times))
        elif isinstance(p, FnPass) and p.reference is not None:
            impls = dict(p.impls)
            if backend == "reference":
                fn = p.reference
            elif backend in impls:
                fn = _load(impls[backend])
            else:
                raise ValueError(f"pass {p.name!r} has no {backend!r} implementation: it has "
                                 f"{('reference',) + tuple(impls)}")
            # a pass already lowered to this backend is kept as it is (a decode lowers
            # every step's cost-aware list, whose built-in passes are lowered already)
            out.append(p if p.fn is fn else FnPass(p.name, fn, p.impls, p.reference))
        else:
            out.append(p)
    return out


@dataclass(frozen=True)
class Repeat:
    """Run ``body`` ``times(ctx)`` times; each inner pass is named ``name@i`` (1-based)."""

    name: str
    body: tuple
    times: Callable[[PassContext], int]


def flatten(passes: Sequence, ctx: PassContext) -> list[tuple[str, Callable]]:
    """Unroll ``Repeat`` blocks into ``(display_name, pass)`` pairs, in run order."""
    out = []
    for p in passes:
        if isinstance(p, Repeat):
            for i in range(1, p.times(ctx) + 1):
                out += [(f"{n}@{i}", q) for n, q in flatten(p.body, ctx)]
        else:
            out.append((p.name, p))
    return out


def _run_pass(index: int, name: str, p, tree: DraftTree, ctx: PassContext, instruments) -> DraftTree:
    for ins in instruments:
        ins.before_pass(index, name, tree, ctx)
    try:
        tree = p(tree, ctx)
    except PassError:
        raise
    except Exception as exc:  # name the failing pass and what ran before it
        raise PassError(f"pass {name!r} failed after {ctx.history or ['(none)']}: "
                        f"{type(exc).__name__}: {exc}") from exc
    ctx.history.append(name)
    for ins in instruments:
        ins.after_pass(index, name, tree, ctx)
    return tree


def run_pipeline(passes: Sequence, tree: DraftTree, ctx: PassContext) -> DraftTree:
    """Run ``passes`` in order over ``tree``; instruments see every pass.

    A top-level ``Repeat`` stops early at a fixpoint: when one iteration of its body
    returns the very tree it started from (the cost gate declined a depth, and ``assign``
    found nothing to draw), the later iterations would too, since a pass is a pure
    function of the tree and the context, so they are not run (nor shown to instruments).
    """
    instruments = list(ctx.instruments) + debug_instruments()
    for ins in instruments:
        ins.run_start(tree, ctx)
    index = 0
    for p in passes:
        if not isinstance(p, Repeat):
            index += 1
            tree = _run_pass(index, p.name, p, tree, ctx, instruments)
            continue
        for i in range(1, p.times(ctx) + 1):
            start = tree
            for name, q in flatten(p.body, ctx):
                index += 1
                tree = _run_pass(index, f"{name}@{i}", q, tree, ctx, instruments)
            if tree is start:
                break
    if ctx.deferred_checks:  # one host sync for every device-side check of the run
        flags = torch.stack([f.reshape(()) for f, _ in ctx.deferred_checks]).tolist()
        bad = [msg for (_, msg), f in zip(ctx.deferred_checks, flags) if f]
        ctx.deferred_checks.clear()
        if bad:
            raise ValueError(bad[0])
    for ins in instruments:
        ins.run_end(tree, ctx)
    return tree


# -- instruments --------------------------------------------------------------------------


class PassTiming(Instrument):
    """Wall time per pass name (``@i`` suffixes folded together), accumulated over runs."""

    def __init__(self, report: bool = False, stream=None):
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.report = report
        self.stream = stream or sys.stderr
        self._t0 = 0.0

    def before_pass(self, index, name, tree, ctx):
        self._t0 = time.perf_counter()

    def after_pass(self, index, name, tree, ctx):
        key = name.split("@")[0]
        self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - self._t0
        self.counts[key] = self.counts.get(key, 0) + 1

    def run_end(self, tree, ctx):
        if self.report:
            print(self.summary(), file=self.stream)

    def summary(self) -> str:
        rows = [f"{k:<12s} {1e3 * v:9.3f} ms  ({self.counts[k]} runs)" for k, v in self.totals.items()]
        return "pass timing:\n  " + "\n  ".join(rows)


class VerifyAfterEach(Instrument):
    """Check the IR invariants after every pass; raise naming the pass and its predecessors."""

    def after_pass(self, index, name, tree, ctx):
        problems = lint(tree, ctx)
        if problems:
            raise PassError(f"IR ill-formed after pass {name!r} (ran: {ctx.history}):\n  - "
                            + "\n  - ".join(problems))


class PrintAfterAll(Instrument):
    """Print the text IR after every pass."""

    def __init__(self, stream=None, tokenizer=None):
        self.stream = stream or sys.stdout
        self.tokenizer = tokenizer

    def after_pass(self, index, name, tree, ctx):
        print(f"# ---- after {index:03d} {name} ----", file=self.stream)
        print(to_text(tree, tokenizer=self.tokenizer), file=self.stream)


class DumpIR(Instrument):
    """Write the text IR after every pass to ``dir/NNN_name.txt`` (``NNN`` = pass index)."""

    def __init__(self, directory: str | os.PathLike, tokenizer=None):
        self.dir = Path(directory)
        self.tokenizer = tokenizer

    def run_start(self, tree, ctx):
        (self.dir / f"step{ctx.step:04d}").mkdir(parents=True, exist_ok=True)

    def after_pass(self, index, name, tree, ctx):
        path = self.dir / f"step{ctx.step:04d}" / f"{index:03d}_{name.replace('@', '_d')}.txt"
        path.write_text(to_text(tree, tokenizer=self.tokenizer) + "\n")


def debug_level() -> int:
    raw = os.environ.get("RHEOPLAN_DEBUG", "0")
    try:
        level = int(raw)
    except ValueError:
        raise ValueError(f"RHEOPLAN_DEBUG={raw!r} is not an int: allowed 0..4") from None
    if not 0 <= level <= 4:
        raise ValueError(f"RHEOPLAN_DEBUG={level} is out of range: allowed 0..4")
    return level


def debug_instruments() -> list[Instrument]:
    level = debug_level()
    out: list[Instrument] = []
    if level >= 1:
        out.append(PassTiming(report=True))
    if level >= 2:
        out.append(VerifyAfterEach())
    if level >= 3:
        out.append(PrintAfterAll())
    if level >= 4:
        out.append(DumpIR(os.environ.get("RHEOPLAN_DUMP_DIR", "rheoplan_dump")))
    return out
