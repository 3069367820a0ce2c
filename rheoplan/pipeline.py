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

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree
from rheoplan.ir_text import to_text
from rheoplan.planner.lint import lint

#: ``draft(tree, nodes [B, n] int64, -1 padded) -> logits [B, n, V]``
DraftFn = Callable[[DraftTree, torch.Tensor], torch.Tensor]
#: ``sampler(tree_index, node_id, qtilde [n] float64) -> index into the tail``
SamplerFn = Callable[[int, int, torch.Tensor], int]


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


@dataclass(frozen=True)
class FnPass:
    """A named pure function ``(tree, ctx) -> tree``."""

    name: str
    fn: Callable[[DraftTree, PassContext], DraftTree]

    def __call__(self, tree: DraftTree, ctx: PassContext) -> DraftTree:
        return self.fn(tree, ctx)


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


def run_pipeline(passes: Sequence, tree: DraftTree, ctx: PassContext) -> DraftTree:
    """Run ``passes`` in order over ``tree``; instruments see every pass."""
    instruments = list(ctx.instruments) + debug_instruments()
    for ins in instruments:
        ins.run_start(tree, ctx)
    for index, (name, p) in enumerate(flatten(passes, ctx), start=1):
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
