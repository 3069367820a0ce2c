"""The cost model that plans a tree: latencies, calibrated acceptance, and the decision rule.

A tree pays only when the tokens it is expected to emit outweigh what it costs to draft
and verify it (design notes: COST_MODEL.md). Three kinds of quantity meet here:

* ``Timings``: latencies measured once per machine + model + dtype at load
  (``rheoplan.probe.measure_timings``, cached as JSON) and frozen during a decode:
  ``c_v(n, ctx)`` one verify forward carrying ``n`` tokens over ``ctx`` cached ones
  (piecewise linear in ``n``, linear in ``ctx``), ``c_d(w)`` one draft call over ``w``
  frontier rows, ``c_o`` the loop's bookkeeping per tree step and ``c_o'`` per plain
  autoregressive step; for batched decoding also ``c_v(B, n)``, one verify forward of
  ``B`` rows padded to ``n`` tokens each (a small measured grid, ``Timings.verify_batch``).
* ``Calibration``: online counts of (trials, accepts) per score bucket, from the steps
  this decode already verified (optionally starting from a calibration file). A node's
  estimated acceptance is the calibrated value of its bucket times its parent's.
* ``CostPlan``: the frozen snapshot one step plans with (timings + the calibration as it
  stood before the step + the drafting schedule). The planner passes
  (``planner/cost_depth.py``, ``planner/cost_prune.py``) read only this and the tree, so a
  tree's shape depends on the draft and on past steps, never on the target's output for
  this step, and the same seed + calibration file give the same tokens (no live clock).

The one definition of the decision rule is ``choose_n``:
``N* = argmax_N (1 + sum_{i<=N} a_i) / (c_d + c_v(N + 1) + c_o(D))``, ``N = 0`` included,
``c_o(D)`` the bookkeeping of a step whose tree was drafted ``D`` deep (``Timings.tree_overhead``).
With ``B`` live rows the same rule runs over the batch's merged candidates, with
``c_v(B, widest row)``, one draft call per depth for all rows and ``B`` rows' bookkeeping
(``planner/cost_prune.decide``); ``CostModel.plan_for_batch`` is its a-priori summary per
batch size (the tree depth and per-row budget that pay at ``B`` rows).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import torch

from rheoplan.ir import DraftTree, NodeKind

#: weight buckets per class: bucket ``b`` holds local weights in ``[b/NB, (b+1)/NB)``
N_BUCKETS = 10
#: class 0: DET and PAD children (weight = their draft probability q);
#: class 1: SAMPLED children (weight = the token-independent proxy pi)
N_CLASSES = 2
#: pseudo-trials of the default prior (its mean is the bucket's midpoint weight)
PRIOR_STRENGTH = 2.0
#: pseudo-tokens at ratio 1 in ``Calibration.scale`` (a few steps' worth)
SCALE_PRIOR = 4.0
#: how many depths ``Calibration`` tracks "the walk continued below a reached node" for
MAX_DEPTH = 64
#: the widths (kept children per node) ``Calibration`` tracks the continuation rate of, and
#: ``CostModel.plan_rows`` plans several rows' trees with
PLAN_WIDTHS = 3


def prefill_groups(lengths: Sequence[int], overhead_tokens: float) -> list[list[int]]:
    """Rows (indices into ``lengths``) to prefill together, one forward per group, so that
    padding and forwards cost the least: each group's forward carries ``len(group) *
    max(its lengths)`` tokens (left padding to its longest prompt) plus ``overhead_tokens``
    (``Timings.forward_overhead_tokens``: a forward's fixed cost in tokens). Groups hold
    rows of neighbouring lengths (an optimal partition of the rows sorted by length,
    by dynamic programming over the sorted order: no other partition costs less),
    shortest first, each in length order.

    Example: lengths [40, 100, 44, 96], 46 tokens per forward -> [[0, 2], [3, 1]]
    (2 * 44 + 2 * 100 + 2 * 46 = 380 tokens of work against 4 * 100 + 46 = 446 in one).
    """
    if not overhead_tokens >= 0:
        raise ValueError(f"overhead_tokens={overhead_tokens!r}: allowed a number >= 0 (inf: one group)")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if len(order) <= 1 or math.isinf(overhead_tokens):
        return [order] if order else []
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[i]: cost of the first i sorted rows
    cut = [0] * (n + 1)  # cut[i]: where the last group of the first i rows starts
    for i in range(1, n + 1):
        longest = lengths[order[i - 1]]
        for j in range(i):
            c = best[j] + overhead_tokens + (i - j) * longest
            if c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], n
    while i > 0:
        groups.append(order[cut[i]:i])
        i = cut[i]
    groups.reverse()
    return groups


def weight_bucket(w: float) -> int:
    """Bucket of a local weight in [0, 1]: ``min(NB - 1, floor(w * NB))``.

    Example: 0.0 -> 0, 0.35 -> 3, 1.0 -> 9 (with 10 buckets).
    """
    if not w > 0:
        return 0
    return min(N_BUCKETS - 1, int(w * N_BUCKETS))


def node_class(kind: int) -> int:
    """Calibration class of a node kind: 1 for SAMPLED (proxy weight), else 0 (q weight)."""
    return 1 if kind == int(NodeKind.SAMPLED) else 0


# -- latencies -----------------------------------------------------------------------------


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation past either end.

    Example: xs [1, 4], ys [10, 16] -> x=2: 12.0; x=6: 20.0.
    """
    if len(xs) == 1:
        return float(ys[0])
    i = bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Timings:
    """Latencies in milliseconds (see the module docstring). Frozen during a decode."""

    sizes: tuple[int, ...]  #: verify tokens n measured (root included), increasing
    verify_lo: tuple[float, ...]  #: c_v(n) at ``ctx_lo`` cached tokens
    verify_hi: tuple[float, ...]  #: c_v(n) at ``ctx_hi`` cached tokens
    ctx_lo: int
    ctx_hi: int
    draft_widths: tuple[int, ...]  #: frontier rows w measured, increasing
    draft_ms: tuple[float, ...]  #: c_d(w)
    #: c_o: plan + walk + commit + loop per tree step of one drafted depth (draft and forward
    #: excluded; ``tree_overhead`` adds ``overhead_depth_ms`` per further depth)
    overhead_ms: float
    ar_overhead_ms: float  #: c_o': the same for a plain autoregressive step
    #: batch sizes B of the batched verify grid (empty: batch 1 only; see ``verify_batch``)
    batch_sizes: tuple[int, ...] = ()
    #: tokens per row n of the grid (every row padded to n: one rectangular [B, n] forward)
    batch_row_sizes: tuple[int, ...] = ()
    #: ``batch_verify[i][j]``: one verify forward of ``batch_sizes[i]`` rows x
    #: ``batch_row_sizes[j]`` tokens over ``ctx_lo`` cached tokens per row (ms)
    batch_verify: tuple[tuple[float, ...], ...] = ()
    #: measured by a short batched decode per ``batch_sizes`` entry (empty: modelled from the
    #: batch-1 numbers): one batched draft call (all rows, ``batch_draft_width`` frontier
    #: nodes per row on average), ...
    batch_draft_ms: tuple[float, ...] = ()
    batch_draft_width: float = 1.0
    #: ... the loop's bookkeeping per tree step of the whole batch, ...
    batch_overhead_ms: tuple[float, ...] = ()
    #: ... and per plain autoregressive step of the whole batch
    batch_ar_overhead_ms: tuple[float, ...] = ()
    #: per ``batch_sizes`` entry: a real batched verify forward of a small tree over the
    #: lower of the grid's forward of that shape and the same forward timed right after it
    #: (``probe.measure_batch_tree_verify``, ``probe.batch_forwards``); multiplies the grid
    #: for rows of more than one token (empty: 1)
    batch_tree_scale: tuple[float, ...] = ()
    #: per ``batch_sizes`` entry: the real batched forward of one token per row (a plain
    #: autoregressive step's, ``probe.measure_batch_steps``) over the lower of the grid's
    #: one-token forward and that forward timed right after it; multiplies the grid for rows
    #: of one token (empty: 1)
    batch_ar_scale: tuple[float, ...] = ()
    #: the bookkeeping each drafted depth past the first adds to a tree step of one row (ms):
    #: a deeper tree runs more passes and its walk visits more nodes (measured by decodes of
    #: the fixed tree and of a one-depth tree; 0: one bookkeeping cost for every tree, as
    #: records before it had)
    overhead_depth_ms: float = 0.0
    #: per ``batch_sizes`` entry: the same for a tree step of the whole batch (ms; batched
    #: decodes of the fixed tree and of a one-depth tree, ``probe.measure_batch_steps``).
    #: Given, ``batch_overhead_ms`` is the one-depth price; empty (records before it):
    #: ``batch_overhead_ms`` is the fixed tree's, at every depth
    batch_overhead_depth_ms: tuple[float, ...] = ()
    #: per ``batch_sizes`` entry: the bookkeeping of a tree step of one drafted depth and one
    #: node per row (``probe.narrow_tree``), against ``batch_overhead_ms``' tree of
    #: ``batch_overhead_width`` nodes per row: the one-depth price then grows with the nodes
    #: per row (``overhead_batch``). Empty (records before it): one price at every width
    batch_overhead_narrow_ms: tuple[float, ...] = ()
    #: nodes per row of the one-depth tree behind ``batch_overhead_ms`` (0: not recorded)
    batch_overhead_width: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.verify_lo) or len(self.sizes) != len(self.verify_hi):
            raise ValueError("Timings: sizes, verify_lo and verify_hi must be non-empty and of equal length")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"Timings: sizes={self.sizes} must be increasing ints >= 1")
        if not self.draft_widths or len(self.draft_widths) != len(self.draft_ms):
            raise ValueError("Timings: draft_widths and draft_ms must be non-empty and of equal length")
        if list(self.draft_widths) != sorted(set(self.draft_widths)):
            raise ValueError(f"Timings: draft_widths={self.draft_widths} must be increasing")
        if self.ctx_hi <= self.ctx_lo:
            raise ValueError(f"Timings: ctx_hi={self.ctx_hi} must exceed ctx_lo={self.ctx_lo}")
        if self.batch_sizes or self.batch_row_sizes or self.batch_verify:
            if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
                raise ValueError(f"Timings: batch_sizes={self.batch_sizes} must be increasing ints >= 1")
            if not self.batch_row_sizes or list(self.batch_row_sizes) != sorted(set(self.batch_row_sizes)) \
                    or self.batch_row_sizes[0] < 1:
                raise ValueError(f"Timings: batch_row_sizes={self.batch_row_sizes} must be increasing ints >= 1")
            if len(self.batch_verify) != len(self.batch_sizes) or any(
                    len(r) != len(self.batch_row_sizes) for r in self.batch_verify):
                raise ValueError(f"Timings: batch_verify must be {len(self.batch_sizes)} rows (batch_sizes) of "
                                 f"{len(self.batch_row_sizes)} latencies (batch_row_sizes)")
        steps = (self.batch_draft_ms, self.batch_overhead_ms, self.batch_ar_overhead_ms)
        if any(steps) and (not self.batch_sizes or any(len(x) != len(self.batch_sizes) for x in steps)):
            raise ValueError(f"Timings: batch_draft_ms, batch_overhead_ms and batch_ar_overhead_ms must hold one "
                             f"latency per batch size ({len(self.batch_sizes)}), all three or none")
        if self.batch_overhead_depth_ms and len(self.batch_overhead_depth_ms) != len(self.batch_overhead_ms):
            raise ValueError(f"Timings: batch_overhead_depth_ms must hold one latency per batch size "
                             f"({len(self.batch_sizes)}), with batch_overhead_ms")
        if self.batch_overhead_narrow_ms and (len(self.batch_overhead_narrow_ms) != len(self.batch_overhead_ms)
                                              or self.batch_overhead_width < 2):
            raise ValueError(f"Timings: batch_overhead_narrow_ms must hold one latency per batch size "
                             f"({len(self.batch_sizes)}), with batch_overhead_ms and a batch_overhead_width >= 2 "
                             f"(got {self.batch_overhead_width})")
        for name in ("batch_tree_scale", "batch_ar_scale"):
            f = getattr(self, name)
            if f and (len(f) != len(self.batch_sizes) or any(not (v > 0 and math.isfinite(v)) for v in f)):
                raise ValueError(f"Timings: {name} must hold one finite factor > 0 per batch size "
                                 f"({len(self.batch_sizes)})")
        if not (self.batch_draft_width >= 1 and math.isfinite(self.batch_draft_width)):
            raise ValueError(f"Timings: batch_draft_width={self.batch_draft_width} must be >= 1")
        vals = list(self.verify_lo) + list(self.verify_hi) + list(self.draft_ms) + [self.overhead_ms, self.ar_overhead_ms]
        vals += [v for r in self.batch_verify for v in r] + [v for x in steps for v in x]
        vals.append(self.overhead_depth_ms)
        vals += list(self.batch_overhead_depth_ms) + list(self.batch_overhead_narrow_ms)
        if any(not (v >= 0 and math.isfinite(v)) for v in vals):
            raise ValueError("Timings: every latency must be finite and >= 0 ms")
        # the context-free parts of ``verify_ends`` / ``verify_batch``, computed once per
        # size (a 4-row plan reads ~12 of them a step, each several ``interp`` calls); not
        # a field: equality, hashing and ``to_dict`` see the latencies only
        object.__setattr__(self, "_memo", {})

    def verify(self, n: int, ctx: int) -> float:
        """``c_v(n, ctx)``: one verify forward of ``n`` tokens over ``ctx`` cached tokens (ms)."""
        return max(self.at_ctx(*self.verify_ends(n), ctx), 1e-3)

    def verify_ends(self, n: int) -> tuple[float, float]:
        """``c_v(n)`` at ``ctx_lo`` and at ``ctx_hi`` cached tokens (ms), before ``at_ctx``."""
        key = ("ends", n)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = (interp(self.sizes, self.verify_lo, n), interp(self.sizes, self.verify_hi, n))
        return got

    def at_ctx(self, lo, hi, ctx: int):
        """The verify latency at ``ctx`` cached tokens from its values at ``ctx_lo`` and
        ``ctx_hi`` (linear in the context; floats, or numpy arrays elementwise with the same
        bits: ``rheoplan.kernels.plan.cpu_pass`` prices a whole curve at once)."""
        return lo + (hi - lo) * (ctx - self.ctx_lo) / (self.ctx_hi - self.ctx_lo)

    def draft(self, w: int) -> float:
        """``c_d(w)``: one draft call over ``w`` frontier rows (ms)."""
        return max(interp(self.draft_widths, self.draft_ms, w), 1e-3)

    def ar_step(self, ctx: int) -> float:
        """Cost of a plain autoregressive step (ms): ``c_v(1) + c_o'``."""
        return self.verify(1, ctx) + self.ar_overhead_ms

    # -- batches: B live rows share one verify forward and one draft call per depth ------------

    def verify_batch(self, batch: int, row_tokens: int, ctx: int) -> float:
        """``c_v(B, n, ctx)``: one verify forward of ``batch`` rows, each padded to
        ``row_tokens`` tokens (the widest row's tree), over ``ctx`` cached tokens (ms).

        With a measured grid: piecewise linear in ``n`` at each measured ``B``, then in
        ``B`` (linear extrapolation past either end), at ``ctx_lo``, times
        ``batch_tree_scale`` (interpolated in ``B``) when ``n > 1``: the grid's forwards
        run over a uniform random cache, a real batch's tree forward over rows of different
        lengths with their tree masks (measured on the 2-core machine: 1.00 at 4 and 16 rows
        with a grid of 3 repetitions; 1.09 / 1.06 once the grid itself came out noisy, which
        the factor then corrects), or times ``batch_ar_scale`` when ``n = 1`` (a real
        plain step's forward: 4 rows ran in 35 ms where the grid said 38.5, which made
        drafting look better than it was); the context term is the batch-1 curve's, taken at the batch's total tokens
        ``B * n`` (every row's tokens attend to their own ``ctx`` cached ones). Batch 1 is
        ``verify(n, ctx)``.
        Without a grid (timings measured before batches existed) a batch costs what one
        row of ``B * n`` tokens costs.

        Example: grid B (1, 4) x n (1, 2) = [[10, 12], [14, 22]] ms -> B=2, n=1: 11.33 ms.
        """
        if batch == 1:
            return self.verify(row_tokens, ctx)
        total = batch * row_tokens
        if not self.batch_sizes:
            return self.verify(total, ctx)
        key = ("grid", batch, row_tokens)
        v = self._memo.get(key)
        if v is None:  # the grid at ctx_lo, scaled (no context in it)
            at_b = [interp(self.batch_row_sizes, row, row_tokens) for row in self.batch_verify]
            v = interp(self.batch_sizes, at_b, batch)
            scale = self.batch_tree_scale if row_tokens > 1 else self.batch_ar_scale
            if scale:
                v *= interp(self.batch_sizes, scale, batch)
            self._memo[key] = v
        v += self.verify(total, ctx) - self.verify(total, self.ctx_lo)
        return max(v, 1e-3)

    def draft_batch(self, batch: int, row_width: int) -> float:
        """One draft call over ``batch`` rows of ``row_width`` frontier nodes each (ms).

        Measured (``batch_draft_ms``): the call at ``B`` rows, interpolated in ``B``, plus,
        for a frontier wider than the measured mean width, the batch-1 curve's slope from
        that width to ``row_width`` (both at ``B`` rows); a narrower frontier costs the
        measured call (the batch-1 slope, extrapolated to ``B * w`` rows, once priced a
        one-node frontier at 4 rows at nothing: the batched call's cost is mostly fixed).
        Not measured: one call over ``B * w`` frontier rows, ``c_d(B * w)`` (the batched
        draft runs every row's frontier through one call per depth)."""
        if batch == 1 or not self.batch_draft_ms:
            return self.draft(batch * row_width)
        v = interp(self.batch_sizes, self.batch_draft_ms, batch)
        if row_width > self.batch_draft_width:
            # only a wider frontier adds the slope: the batch-1 curve can fall with the width
            # (its one-node calls are each step's first, which also take the accepted tokens
            # in: 1.9 ms against 1.2 for three nodes on a 2-core Zen 4 EPYC), and extrapolated
            # past its widest point that fall priced a 4-row one-node frontier 0.8 ms above
            # the measured call
            v += max(0.0, self.draft(batch * row_width) - self.draft(batch * self.batch_draft_width))
        return max(v, 1e-3)

    def overhead_batch(self, batch: int, width: int | None = None) -> float:
        """``c_o`` of a tree step with ``batch`` rows (ms), at one drafted depth where the
        bookkeeping was measured by depth (``batch_overhead_depth_ms``), else at the fixed
        tree's: measured (``batch_overhead_ms``, interpolated in ``B``), else ``batch * c_o``
        (each row planned, walked and committed on its own: an upper bound where the loop
        vectorises some of it).

        ``width``: the nodes per row of that depth, where the one-node price was measured
        too (``batch_overhead_narrow_ms``): linear in the width through the one-node and
        the ``batch_overhead_width``-node measurements (never below 0). Why: the walk
        projects and visits, and the commit moves, each row's nodes; on the 2-core Zen 4
        AMD EPYC at 4 rows and T = 1 a one-depth step of one node a row cost 6.3 ms of
        bookkeeping and one of three nodes 8.7; priced at three nodes, 4-row batches at T = 0
        drafted 45% of their steps at 142.4 tok/s, priced by nodes 82% at 147.8 (interleaved;
        docs/results.md, "Thirty-third round")."""
        if batch == 1:
            return self.overhead_ms
        if self.batch_overhead_ms:
            wide = max(interp(self.batch_sizes, self.batch_overhead_ms, batch), 0.0)
            if width is None or not self.batch_overhead_narrow_ms:
                return wide
            narrow = max(interp(self.batch_sizes, self.batch_overhead_narrow_ms, batch), 0.0)
            return max(narrow + (width - 1) * (wide - narrow) / (self.batch_overhead_width - 1), 0.0)
        return batch * self.overhead_ms

    def tree_overhead(self, batch: int, depth: int, width: int | None = None) -> float:
        """``c_o(B, D)``: the bookkeeping of a tree step of ``batch`` rows whose tree was
        drafted ``depth`` deep (ms).

        One row: ``overhead_ms`` (one depth) plus ``overhead_depth_ms`` for each depth past
        the first. Several rows, measured by depth (``batch_overhead_depth_ms``): the same
        rule with the batch's measurements (interpolated in ``B``). Several rows measured
        with the fixed tree only (older records): that measurement at every depth.

        Why by depth at several rows now, and not before: at 4 rows and T = 0 on the 2-core
        machine, pricing shallow trees by their own bookkeeping once let some steps draft,
        and the batch ran at 0.92x ``generate`` against 0.96-0.985x with the flat price
        (plain steps only): the tree steps took 16% longer than predicted (their batched
        forward over rows of different lengths costs more than the grid says; since then
        ``batch_tree_scale``) and the plain steps between them 8% longer (the holes rejected
        nodes leave in the rows' cache; since then compacted); docs/results.md, "Lean steps,
        twelfth round". With the leaner steps since, fixed one-depth trees ran at 1.15x
        against the flat price's plain steps at 1.03x at 4 rows and T = 0 (1.17x against
        1.14x at T = 1), and the flat price, the fixed tree's 15.6 ms against 5-6 ms at one
        depth, kept every step plain ("Twenty-fifth round").
        Several rows without measurements: ``B`` rows' worth of the one-row price, as
        ``overhead_batch``.

        ``width``: the nodes per row at each depth (``overhead_batch``; several rows only,
        the per-depth part as measured).

        Example: c_o 4.5 ms at one depth, 0.8 ms per further depth -> a 3-deep tree 6.1 ms.
        """
        further = max(int(depth) - 1, 0)
        if batch != 1 and self.batch_overhead_ms:
            per = max(interp(self.batch_sizes, self.batch_overhead_depth_ms, batch), 0.0) \
                if self.batch_overhead_depth_ms else 0.0
            return self.overhead_batch(batch, width) + per * further
        one = self.overhead_ms + self.overhead_depth_ms * further
        return one if batch == 1 else batch * one

    def ar_step_batch(self, batch: int, ctx: int) -> float:
        """A plain autoregressive step of ``batch`` rows (ms): ``c_v(B, 1)`` plus the
        measured bookkeeping (``batch_ar_overhead_ms``), else ``B * c_o'``."""
        if batch == 1:
            return self.ar_step(ctx)
        if self.batch_ar_overhead_ms:
            oh = max(interp(self.batch_sizes, self.batch_ar_overhead_ms, batch), 0.0)
        else:
            oh = batch * self.ar_overhead_ms
        return self.verify_batch(batch, 1, ctx) + oh

    def forward_overhead_tokens(self) -> float:
        """What one forward costs before it carries any token, counted in tokens: the
        one-token forward ``c_v(1)`` over the batch-1 curve's slope between its two largest
        sizes (ms per further token, at ``ctx_lo``). ``prefill_groups`` weighs padding
        against this.

        Example: c_v(1) 18.8 ms, c_v(32) 28.7, c_v(64) 41.7 -> 18.8 / 0.406 = 46.3 tokens
        (the 2-core CPU in bfloat16).
        """
        lo = self.ctx_lo
        if len(self.sizes) < 2:
            return float("inf")  # no slope measured: one forward for everything
        a, b = self.sizes[-2], self.sizes[-1]
        slope = (self.verify(b, lo) - self.verify(a, lo)) / (b - a)
        return self.verify(1, lo) / slope if slope > 0 else float("inf")

    def verify_growth(self) -> tuple[int, float]:
        """``(n, r)``: the largest measured tree ``n`` (tokens) and what its verify forward
        costs against a one-token forward, ``c_v(n) / c_v(1)``, the larger ratio of the two
        measured contexts. 3.2 at 64 tokens on the 2-core Zen 4 EPYC (SmolLM2, bfloat16);
        near 1 where a forward's time does not grow with its tokens, as expected of a small
        target on a GPU (``rheoplan.loading.large_tree_note``)."""
        n = self.sizes[-1]
        return n, max(self.verify(n, c) / self.verify(1, c) for c in (self.ctx_lo, self.ctx_hi))

    def with_verify_of(self, ref: "Timings") -> "Timings":
        """These latencies with ``ref``'s verify curve (its sizes and both contexts): the
        same target priced once, each draft's own draft and bookkeeping latencies kept."""
        return replace(self, sizes=ref.sizes, verify_lo=ref.verify_lo, verify_hi=ref.verify_hi,
                       ctx_lo=ref.ctx_lo, ctx_hi=ref.ctx_hi)

    def one_row(self) -> "Timings":
        """These latencies less the batched ones: what a decode of one prompt reads (a
        batch priced with it counts as one row of all its tokens, ``verify_batch``)."""
        batched = {f: v.default for f, v in self.__dataclass_fields__.items() if f.startswith("batch_")}
        return replace(self, **batched)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Timings":
        known = {f: d[f] for f in cls.__dataclass_fields__ if f in d}
        # absent in batch-1 records, and in records from before the per-depth bookkeeping
        optional = {f for f in cls.__dataclass_fields__ if f.startswith("batch_")} | {"overhead_depth_ms"}
        missing = sorted(set(cls.__dataclass_fields__) - set(known) - optional)
        if missing:
            raise ValueError(f"Timings: missing fields {missing}")
        for k in ("sizes", "verify_lo", "verify_hi", "draft_widths", "draft_ms", "batch_sizes", "batch_row_sizes",
                  "batch_draft_ms", "batch_overhead_ms", "batch_overhead_depth_ms", "batch_ar_overhead_ms",
                  "batch_overhead_narrow_ms", "batch_tree_scale",
                  "batch_ar_scale"):
            if k in known:
                known[k] = tuple(known[k])
        if "batch_verify" in known:
            known["batch_verify"] = tuple(tuple(r) for r in known["batch_verify"])
        return cls(**known)


# -- the verify walk's output projections ----------------------------------------------------

#: rows measured for ``ProjectionTimings`` (one output projection of k final hidden states)
PROJECTION_SIZES = (1, 2, 4, 8, 16, 32, 64)
PROJECTION_CACHE = "projection.json"


@dataclass(frozen=True)
class ProjectionTimings:
    """``c_p(k)``: one output projection (lm_head) of ``k`` rows, in ms, measured on this
    machine (``measure_projection``). It decides how the CPU walk gets its logits
    (``project_all``): the projection is memory-bound on a CPU (each call reads the whole
    lm_head), so projecting every row of a tree at once costs little more than one row.

    Example (bfloat16 SmolLM2 on a 2-core EPYC: one row 4.3 ms, nine rows 5.5 ms):
        >>> pt = ProjectionTimings((1, 8, 16), (4.3, 5.4, 6.6))
        >>> pt.project_all(9, 5)   # 5.55 <= c_p(5) + c_p(1) = 5.0 + 4.3
        True
        >>> pt.project_all(5, 5)   # the likely path is the whole tree: same rows either way
        False
    """

    sizes: tuple[int, ...]  #: rows k measured, increasing, from 1
    ms: tuple[float, ...]  #: c_p(k)

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.ms):
            raise ValueError("ProjectionTimings: sizes and ms must be non-empty and of equal length")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"ProjectionTimings: sizes={self.sizes} must be increasing ints >= 1")
        if any(not (v >= 0 and math.isfinite(v)) for v in self.ms):
            raise ValueError("ProjectionTimings: every latency must be finite and >= 0 ms")

    def cost(self, k: int) -> float:
        """``c_p(k)`` in ms, interpolated between the measured sizes."""
        return max(interp(self.sizes, self.ms, k), 1e-6)

    def project_all(self, n: int, path_len: int, leaving: int = 1) -> bool:
        """Whether the walk over a tree of ``n`` linear nodes should project all ``n`` rows in
        one call rather than the likely path's ``path_len`` rows (``rheoplan.walk.likely_path``)
        and then, node by node, the ones it visits off that path.

        The lazy side is costed at ``c_p(path_len) + c_p(1)``: the path in one batch plus one
        single-row projection, the least it pays whenever the walk leaves the likely path
        (most tree steps at the acceptance rates measured in docs/results.md). With
        ``n <= path_len`` both project the same rows, and the lazy call is kept.

        A batch's walks (``HFTarget.prefetch_rows``) pass their totals: ``n`` nodes,
        ``path_len`` path rows and ``leaving`` trees that have nodes off their path, each
        costed one single-row projection.
        """
        if n <= path_len or leaving < 1:
            return False
        return self.cost(n) <= self.cost(path_len) + leaving * self.cost(1)

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "ms": list(self.ms)}

    @classmethod
    def from_dict(cls, d: dict) -> "ProjectionTimings":
        return cls(tuple(int(k) for k in d["sizes"]), tuple(float(v) for v in d["ms"]))


def measure_projection(project: Callable[[torch.Tensor], object], width: int, *,
                       device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       sizes: Sequence[int] = PROJECTION_SIZES, reps: int = 3,
                       timer: Callable[[], float] = time.perf_counter) -> ProjectionTimings:
    """Time ``project(hidden [k, width])`` for every ``k`` in ``sizes`` (median of ``reps``
    after one warm-up, sizes timed round-robin so a machine slowing down slows all alike)."""
    if reps < 1:
        raise ValueError(f"reps={reps} is out of range: allowed >= 1")
    dev = torch.device(device)
    rows = {k: torch.randn(k, width, generator=torch.Generator().manual_seed(k)).to(dev, dtype) for k in sizes}

    def run(k: int) -> None:
        project(rows[k])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    samples: dict[int, list[float]] = {k: [] for k in sizes}
    with torch.no_grad():
        for k in sizes:
            run(k)
        for _ in range(reps):
            for k in sizes:
                t0 = timer()
                run(k)
                samples[k].append(1e3 * (timer() - t0))
    ms = [sorted(v)[len(v) // 2] for v in (samples[k] for k in sizes)]
    for i in range(1, len(ms)):  # more rows never cost less: a dip is noise
        ms[i] = max(ms[i], ms[i - 1])
    return ProjectionTimings(tuple(sizes), tuple(ms))


#: process-wide memo of ``projection_timings``: measured once per process and shape
_PROJECTION: dict[str, ProjectionTimings] = {}


def projection_timings(project: Callable[[torch.Tensor], object], vocab: int, width: int, *,
                       device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> ProjectionTimings:
    """``measure_projection`` for a ``[vocab, width]`` output projection, once per process
    and cached on disk (``cache_dir()/projection.json``, per machine, torch version,
    threads, shape, dtype); ``RHEOPLAN_REMEASURE=1`` measures again. About a tenth of a
    second for SmolLM2's 49152 x 576 head, the first time on a machine."""
    key = cache_key("projection", f"lm_head {vocab}x{width}", device, dtype=str(dtype).removeprefix("torch."))
    pt = _PROJECTION.get(key)
    if pt is not None:
        return pt
    rec = cache_read(PROJECTION_CACHE, key) if not remeasure_requested() else None
    if rec is not None:
        try:
            pt = ProjectionTimings.from_dict(rec)
        except (KeyError, TypeError, ValueError):
            pt = None  # a stale record: measure again
    if pt is None:
        pt = measure_projection(project, width, device=device, dtype=dtype)
        cache_write(PROJECTION_CACHE, key, pt.to_dict())
    _PROJECTION[key] = pt
    return pt


def remeasure_requested() -> bool:
    """``RHEOPLAN_REMEASURE`` is set (not '' or '0'): measure again, overwrite the caches."""
    return os.environ.get("RHEOPLAN_REMEASURE", "") not in ("", "0")


# -- calibration ---------------------------------------------------------------------------


@dataclass
class Calibration:
    """Online acceptance statistics of one decode (mutable; snapshot per step).

    ``trials[c][b]`` / ``accepts[c][b]``: kept children of reached nodes in weight bucket
    ``b`` of class ``c``, and how many of them the walk accepted. ``cont_trials[d]`` /
    ``cont_accepts[d]``: reached nodes at depth ``d`` with kept children, and how often the
    walk went on below them (the depth gate's bound). ``width_trials[d][w - 1]`` /
    ``width_accepts[d][w - 1]``: reached nodes at depth ``d`` with at least ``w`` kept
    children, and how often the walk went on through one of their first ``w`` (in the
    linear order: slot order), for ``w`` up to ``PLAN_WIDTHS``: the continuation of a node
    that keeps ``w`` children (``continuation(width=w)``). The token the walk draws at a
    node does not depend on which of its children were kept, so the first ``w`` of a wider
    node stand for a node of ``w``; the all-children rate ``cont_*`` of the cost passes'
    trees runs high for narrow trees (at 4 rows, T = 1: chains reached 1.37 / 1.73 tokens
    per step at depth 1 / 2 where it predicted 1.64 / 2.09). The prior (default: bucket
    midpoint, ``PRIOR_STRENGTH`` pseudo-trials) is added when estimating. ``predicted`` /
    ``realized``: drafted tokens the kept trees were expected to get accepted, and how
    many were (``record_step``), whose ratio ``scale`` corrects what the per-node estimates
    miss together.
    """

    trials: list[list[float]] = field(default_factory=lambda: [[0.0] * N_BUCKETS for _ in range(N_CLASSES)])
    accepts: list[list[float]] = field(default_factory=lambda: [[0.0] * N_BUCKETS for _ in range(N_CLASSES)])
    cont_trials: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    cont_accepts: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    width_trials: list[list[float]] = field(default_factory=lambda: [[0.0] * PLAN_WIDTHS for _ in range(MAX_DEPTH)])
    width_accepts: list[list[float]] = field(default_factory=lambda: [[0.0] * PLAN_WIDTHS for _ in range(MAX_DEPTH)])
    predicted: float = 0.0
    realized: float = 0.0

    def acceptance(self) -> tuple[tuple[float, ...], ...]:
        """Estimated acceptance per (class, bucket): (accepts + prior) / (trials + prior)."""
        out = []
        for c in range(N_CLASSES):
            row = []
            for b in range(N_BUCKETS):
                mid = (b + 0.5) / N_BUCKETS
                row.append((self.accepts[c][b] + PRIOR_STRENGTH * mid) / (self.trials[c][b] + PRIOR_STRENGTH))
            out.append(tuple(row))
        return tuple(out)

    def continuation(self, width: int | None = None, depths: int | None = None) -> tuple[float, ...]:
        """Estimated P(the walk goes on below a reached node at depth d): the counts over
        ``PRIOR_STRENGTH`` pseudo-trials at the estimate of the depth above (0.5 at depth
        0), so a depth no tree reached yet is believed to continue as the one above it;
        with ``width`` (1 .. ``PLAN_WIDTHS``), for a node that keeps ``width`` children,
        its prior the all-children rate (what a calibration without width counts, e.g. an
        older file, gives).

        Why the depth above and not 0.5: the depth gate drafts depth ``d + 1`` only where
        ``d``'s rate says it pays, and only trees that reach ``d + 1`` count ``d``'s rate.
        From 0.5 everywhere, ``rheoplan calibrate`` of the shipped head from nothing kept
        its trees one level deep (rates 0.60, 0.20, 0.50 at T = 1; one row then decoded
        with tau 1.68 / 1.73 at T = 1 / 0 against 2.10 / 2.33 with the shipped priors,
        1.39x against 1.50x ``generate`` at T = 0); chained, 0.62, 0.66, 0.67, and 2.10 /
        2.34. With the shipped priors one row ran 1.55x / 1.53x chained against 1.57x /
        1.54x with 0.5 (T = 1 / 0, 24 held-out prompts, interleaved).

        ``depths``: the rates of the first ``depths`` depths only (the same numbers: each
        depth's rate reads the ones above it), for a caller that plans no deeper.

            >>> cal = Calibration()
            >>> cal.cont_trials[0], cal.cont_accepts[0] = 98.0, 79.0
            >>> [round(c, 2) for c in cal.continuation()[:3]]
            [0.8, 0.8, 0.8]
            >>> cal.continuation(2, depths=3) == cal.continuation(2)[:3]
            True
        """
        if depths is not None and (isinstance(depths, bool) or not isinstance(depths, int)
                                   or not 0 <= depths <= len(self.cont_trials)):
            raise ValueError(f"depths={depths!r} is out of range: allowed an int in [0, {len(self.cont_trials)}]")
        every, prior = [], 0.5
        n = len(self.cont_trials) if depths is None else depths
        for t, a in zip(self.cont_trials[:n], self.cont_accepts[:n]):
            prior = (a + prior * PRIOR_STRENGTH) / (t + PRIOR_STRENGTH)
            every.append(prior)
        every = tuple(every)
        if width is None:
            return every
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= PLAN_WIDTHS:
            raise ValueError(f"width={width!r} is out of range: allowed an int in [1, {PLAN_WIDTHS}]")
        return tuple((a[width - 1] + c * PRIOR_STRENGTH) / (t[width - 1] + PRIOR_STRENGTH)
                     for t, a, c in zip(self.width_trials[:n], self.width_accepts[:n], every))

    def scale(self) -> float:
        """Accepted drafted tokens realised per token predicted, over the drafted steps so
        far (``SCALE_PRIOR`` pseudo-tokens at 1). The per-node estimates multiply a bucket's
        rate along the path as if the levels were independent, and a step keeps the nodes
        whose estimates are highest, so their sum runs high: measured on SmolLM2 at batch 4,
        7.51 tokens predicted per step against 7.18 realised. ``node_acceptance`` multiplies
        by this; it reads only verified steps, so the output law is unchanged."""
        return (self.realized + SCALE_PRIOR) / (self.predicted + SCALE_PRIOR)

    def record_step(self, predicted: float, realized: float) -> None:
        """Count one drafted step: its kept nodes' summed estimated acceptances as the step
        planned them (the decision's ``expected`` less one token per row, already multiplied
        by this calibration's current ``scale``, which is divided out: the ratio compares raw
        estimates with outcomes, or it would drift back to 1) and the drafted tokens accepted."""
        if not (predicted >= 0 and realized >= 0 and math.isfinite(predicted) and math.isfinite(realized)):
            raise ValueError(f"record_step({predicted!r}, {realized!r}): allowed finite counts >= 0")
        self.predicted += float(predicted) / self.scale()
        self.realized += float(realized)

    def update(self, tree: DraftTree, path: Sequence[int], b: int = 0) -> None:
        """Count the trials and accepts of one verified step.

        ``path``: linear indices the walk accepted, root first (``WalkResult.path``). Every
        kept child of a path node was a trial; the next path node is its accept.
        """
        lin = tree.linear
        for j, i in enumerate(path):
            n_kids = int(lin.n_children[b, i])
            if n_kids == 0:
                continue
            nxt = path[j + 1] if j + 1 < len(path) else -1
            d = int(lin.depth[b, i])
            first = int(lin.first_child[b, i])
            if d < MAX_DEPTH:
                self.cont_trials[d] += 1
                self.cont_accepts[d] += 1 if nxt >= 0 else 0
                rank = nxt - first if nxt >= 0 else PLAN_WIDTHS  # the accepted child's place
                wt, wa = self.width_trials[d], self.width_accepts[d]
                for w in range(min(n_kids, PLAN_WIDTHS)):
                    wt[w] += 1
                    wa[w] += 1 if rank <= w else 0
            for c in range(first, first + n_kids):
                v = int(lin.node[b, c])
                cls = node_class(int(tree.kind[b, v]))
                bk = weight_bucket(float(tree.weight[b, v]))
                self.trials[cls][bk] += 1
                self.accepts[cls][bk] += 1 if c == nxt else 0

    def capped(self, max_trials: float) -> "Calibration":
        """A copy whose every bucket and depth holds at most ``max_trials`` trials, its
        accept rate unchanged (counts scaled down). As a prior it sets the first steps'
        estimates and yields to the decode's own counts after about ``max_trials`` trials
        (a prior of thousands of trials would never let a prompt's own rates show).

        Example: 200 trials / 50 accepts capped at 40 -> 40 trials / 10 accepts.
        """
        if not (isinstance(max_trials, (int, float)) and max_trials > 0 and math.isfinite(max_trials)):
            raise ValueError(f"max_trials={max_trials!r} is out of range: allowed a finite number > 0")

        def cap(t: float, a: float) -> tuple[float, float]:
            f = min(1.0, max_trials / t) if t > 0 else 1.0
            return t * f, a * f

        out = Calibration()
        for c in range(N_CLASSES):
            for b in range(N_BUCKETS):
                out.trials[c][b], out.accepts[c][b] = cap(self.trials[c][b], self.accepts[c][b])
        for d in range(MAX_DEPTH):
            out.cont_trials[d], out.cont_accepts[d] = cap(self.cont_trials[d], self.cont_accepts[d])
            for w in range(PLAN_WIDTHS):
                out.width_trials[d][w], out.width_accepts[d][w] = cap(self.width_trials[d][w],
                                                                      self.width_accepts[d][w])
        out.predicted, out.realized = cap(self.predicted, self.realized)
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        cal = cls()
        for k in ("trials", "accepts"):
            rows = d.get(k)
            if (not isinstance(rows, list) or len(rows) != N_CLASSES
                    or any(not isinstance(r, list) or len(r) != N_BUCKETS for r in rows)):
                raise ValueError(f"calibration: {k} must be {N_CLASSES} lists of {N_BUCKETS} counts")
            setattr(cal, k, [[float(x) for x in r] for r in rows])
        for k in ("cont_trials", "cont_accepts"):
            rows = d.get(k, [0.0] * MAX_DEPTH)
            if not isinstance(rows, list) or len(rows) > MAX_DEPTH:
                raise ValueError(f"calibration: {k} must be a list of at most {MAX_DEPTH} counts")
            setattr(cal, k, [float(x) for x in rows] + [0.0] * (MAX_DEPTH - len(rows)))
        for k in ("width_trials", "width_accepts"):  # absent in files written before they existed
            rows = d.get(k, [])
            if (not isinstance(rows, list) or len(rows) > MAX_DEPTH
                    or any(not isinstance(r, list) or len(r) != PLAN_WIDTHS for r in rows)):
                raise ValueError(f"calibration: {k} must be at most {MAX_DEPTH} lists of {PLAN_WIDTHS} counts")
            setattr(cal, k, [[float(x) for x in r] for r in rows]
                    + [[0.0] * PLAN_WIDTHS for _ in range(MAX_DEPTH - len(rows))])
        for k in ("predicted", "realized"):  # absent in files written before they existed
            v = d.get(k, 0.0)
            if not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise ValueError(f"calibration: {k}={v!r} must be a finite count >= 0")
            setattr(cal, k, float(v))
        bad = [(t, a) for tr, ac in zip(cal.trials, cal.accepts) for t, a in zip(tr, ac) if not 0 <= a <= t]
        bad += [(t, a) for t, a in zip(cal.cont_trials, cal.cont_accepts) if not 0 <= a <= t]
        bad += [(t, a) for tr, ac in zip(cal.width_trials, cal.width_accepts) for t, a in zip(tr, ac)
                if not 0 <= a <= t]
        if bad:
            raise ValueError(f"calibration: counts {bad[:3]} break 0 <= accepts <= trials")
        return cal

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        return cls.from_dict(_read_json(path, "calibration"))


def _read_json(path: str | os.PathLike, what: str):
    """The JSON in ``path``; a ValueError naming ``what`` when it is missing or not JSON."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}={str(path)!r}: no such file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}={str(path)!r} is not valid JSON: {exc}") from None


# -- a draft head's shipped priors -------------------------------------------------------------

#: the file a draft head directory may hold next to its weights (``save_priors``)
PRIORS_FILE = "calibration.json"
PRIORS_FORMAT = "rheoplan-calibration-priors/1"


def save_priors(path: str | os.PathLike, priors: dict[float, Calibration], meta: dict | None = None) -> Path:
    """Write one prior calibration per sampling temperature (``rheoplan calibrate``)."""
    if not priors:
        raise ValueError("priors is empty: allowed one Calibration per temperature")
    rec = {"format": PRIORS_FORMAT, "temperatures": {f"{float(t)}": c.to_dict() for t, c in sorted(priors.items())},
           "meta": meta or {}}
    p = Path(path)
    p.write_text(json.dumps(rec, indent=1))
    return p


def load_priors(path: str | os.PathLike) -> dict[float, Calibration]:
    """``{temperature: Calibration}`` from a ``save_priors`` file."""
    rec = _read_json(path, "priors")
    if not isinstance(rec, dict) or rec.get("format") != PRIORS_FORMAT or not isinstance(rec.get("temperatures"), dict):
        raise ValueError(f"priors={str(path)!r}: not a {PRIORS_FORMAT} file")
    out = {}
    for t, d in rec["temperatures"].items():
        try:
            temp = float(t)
        except ValueError:
            raise ValueError(f"priors={str(path)!r}: temperature {t!r} is not a number") from None
        out[temp] = Calibration.from_dict(d)
    if not out:
        raise ValueError(f"priors={str(path)!r} holds no temperature")
    return out


# -- the snapshot a step plans with ------------------------------------------------------------


@dataclass(frozen=True)
class CostPlan:
    """Everything the cost-aware passes read besides the tree (frozen for one step)."""

    timings: Timings
    acceptance: tuple[tuple[float, ...], ...]  #: [class][bucket] (``Calibration.acceptance``)
    continuation: tuple[float, ...]  #: [depth] (``Calibration.continuation``)
    skip_draft: bool = False  #: the schedule says: no drafting this step (an AR step)
    scale: float = 1.0  #: ``Calibration.scale``: realised / predicted accepted tokens so far

    @classmethod
    def from_calibration(cls, timings: Timings, cal: Calibration, skip_draft: bool = False,
                         depths: int | None = None) -> "CostPlan":
        """The plan of ``cal`` as it stands. ``depths``: keep the continuation rates of the
        first ``depths`` depths only (``Calibration.continuation``): the gates of a tree
        ``depths`` deep read no others, and the decode computes 64 rates a step otherwise."""
        return cls(timings, cal.acceptance(), cal.continuation(depths=depths), skip_draft, cal.scale())


def node_acceptance(plan: CostPlan, tree: DraftTree, b: int = 0) -> torch.Tensor:
    """Estimated P(node reached and accepted) for every created node of tree ``b``
    (float64 ``[capacity]``; the root 1, nodes with a pending token 0).

    Nodes are visited in creation order, so a parent is done before its children:
    ``a(v) = acceptance[class(v)][bucket(weight(v))] * a(parent(v))``; then every
    drafted node's ``a(v)`` is multiplied by ``plan.scale`` (at most 1).
    """
    n = int(tree.n_nodes[b])
    out = torch.zeros(tree.capacity, dtype=torch.float64)
    out[0] = 1.0
    kind = tree.kind[b, :n].tolist()
    weight = tree.weight[b, :n].tolist()
    parent = tree.parent[b, :n].tolist()
    token = tree.token[b, :n].tolist()
    acc = out.tolist()
    for v in range(1, n):
        if token[v] < 0:
            continue
        acc[v] = plan.acceptance[node_class(kind[v])][weight_bucket(weight[v])] * acc[parent[v]]
    if plan.scale != 1.0:
        acc = [acc[0]] + [min(1.0, a * plan.scale) for a in acc[1:]]
    return torch.tensor(acc, dtype=torch.float64)


def _expanded_widths(tree: DraftTree, b: int) -> dict[int, int]:
    """{depth: nodes of tree ``b`` expanded at that depth} (one draft call per depth)."""
    rows = int(tree.n_expanded[b])
    widths: dict[int, int] = {}
    if rows == 0:
        return widths
    for d in tree.depth[b, tree.exp_node[b, :rows]].tolist():
        widths[d] = widths.get(d, 0) + 1
    return widths


def draft_ms_of_depths(timings: Timings, batch: int, widths: Sequence[int]) -> float:
    """Latency of one draft call per drafted depth, ``widths`` the widest row's frontier at
    each depth in depth order (0: no call at that depth): ``Timings.draft`` for one row,
    ``Timings.draft_batch`` for ``batch`` rows, summed in depth order (the one definition
    ``draft_ms_so_far``, ``draft_ms_batch`` and the numba decision share)."""
    total = 0
    for w in widths:
        if w:
            total += timings.draft(w) if batch == 1 else timings.draft_batch(batch, w)
    return total


def draft_ms_so_far(plan: CostPlan, tree: DraftTree, b: int = 0) -> float:
    """Latency of the draft calls that built tree ``b``: one call per drafted depth, as
    wide as the number of nodes expanded at that depth."""
    return draft_ms_of_depths(plan.timings, 1, list(_expanded_widths(tree, b).values()))


def draft_ms_batch(plan: CostPlan, tree: DraftTree) -> float:
    """Latency of the draft calls that built all ``tree.batch`` rows: one batched call per
    drafted depth for every row, each row padded to the widest row's frontier at that
    depth (``Timings.draft_batch``). One row: ``draft_ms_so_far``."""
    B = tree.batch
    if B == 1:
        return draft_ms_so_far(plan, tree, 0)
    widest: dict[int, int] = {}
    for b in range(B):
        for d, w in _expanded_widths(tree, b).items():
            widest[d] = max(widest.get(d, 0), w)
    return draft_ms_of_depths(plan.timings, B, list(widest.values()))


def choose_n(acceptances: Sequence[float], draft_ms: float, verify_ms: Callable[[int], float],
             overhead_ms: float, base: float = 1.0) -> tuple[int, float, float]:
    """The decision rule: ``(N*, E, cost)`` with
    ``N* = argmax_N (base + sum_{i<=N} a_i) / (draft_ms + verify_ms(N + 1) + overhead_ms)``
    over ``N = 0 .. len(acceptances)``; ties go to the smaller N.

    ``acceptances`` are the candidates' estimated acceptances in the prune order (best
    first). ``base`` is what a step emits with no drafted node: 1 token per row (``B`` for
    a batch of ``B`` rows). ``E`` is the expected emitted tokens, ``cost`` the predicted
    step latency (ms).

    Example: a = [0.9, 0.1], no draft cost, c_v(n) = 10 n, c_o = 0:
    N=0: 1/10, N=1: 1.9/20, N=2: 2.0/30 -> (0, 1.0, 10.0).
    """
    best = (0, float(base), draft_ms + verify_ms(1) + overhead_ms)
    best_rate = best[1] / best[2]
    e = float(base)
    for i, a in enumerate(acceptances, start=1):
        e += float(a)
        cost = draft_ms + verify_ms(i + 1) + overhead_ms
        rate = e / cost
        if rate > best_rate:
            best, best_rate = (i, e, cost), rate
    return best


#: how much the rows of a batch differ in drafted tokens per step over a decode: the standard
#: deviation of their mean accepted drafted tokens per step (tokens per step less the one a
#: plain step emits too), relative to that mean; ``slowest_row_tokens``. Measured on the
#: 2-core Zen 5 EPYC (SmolLM2, the shipped head, bfloat16, 8 static batches of 4 held-out
#: prompts x 64 tokens drafting every step, 2026-12-05): rows' tokens per step 1.64 +- 0.116
#: at T = 1, 2.12 +- 0.276 at T = 0, so 0.18 and 0.25 (greedy text is more predictable for
#: some prompts than for others; the steps' own noise over ~35 steps is about half of it).
ROW_SPREAD = 0.2


@lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for one): how far, in standard
    deviations, the last of ``n`` rows to finish lags the average one.

        >>> [round(expected_max_normal(n), 3) for n in (1, 2, 4, 16)]
        [0.0, 0.564, 1.029, 1.766]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} is out of range: allowed an int >= 1")
    if n == 1:
        return 0.0
    # E[max] = integral of x * n * phi(x) * Phi(x)^(n-1): a midpoint sum over [-9, 9]
    h, total = 1e-3, 0.0
    for i in range(18000):
        x = -9.0 + (i + 0.5) * h
        total += x * n * math.exp(-0.5 * x * x) * (0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))) ** (n - 1)
    return total * h / math.sqrt(2.0 * math.pi)


def slowest_row_tokens(expected: float, batch: int, rows_waiting: bool = False) -> float:
    """Tokens per step of the slowest of ``batch`` rows whose average row emits ``expected``:
    what a static batch's steps are worth, since it runs until its slowest row is done.

    A plain step moves every row on by one token, so the rows of a static batch finish
    together. Drafted steps move each row on by a number of tokens that differs from step
    to step and from prompt to prompt, so the rows finish at different steps, and the
    batch's last steps carry a few rows at nearly the price of all of them. The slowest of
    ``B`` rows lags the average by about ``z_B`` standard deviations (``z_B =
    expected_max_normal(B)``), and rows differ in their drafted tokens by ``ROW_SPREAD`` of
    them:

        slowest = E - z_B * ROW_SPREAD * (E - 1)

    ``E`` itself for one row, and while ``rows_waiting`` (continuous batching: prompts wait
    to take the place of a row that finishes, so no row waits for the slowest). Deeper
    trees spread the rows more, so the rule also prefers shallower trees as rows are added.

        >>> [round(slowest_row_tokens(2.0, b), 3) for b in (1, 2, 4, 16)]
        [2.0, 1.887, 1.794, 1.647]
        >>> slowest_row_tokens(2.0, 4, rows_waiting=True), slowest_row_tokens(1.0, 16)
        (2.0, 1.0)

    Measured on the 2-core Zen 5 EPYC (bfloat16, static batches of held-out prompts x 64
    tokens, the shipped head; docs/results.md, "Twenty-seventh round" and "Thirty-second
    measurement"): static batches of 4 rows ran 1.22x / 1.12x ``generate`` at T = 1 / 0
    with it, where the rule it replaced (trees predicted 1.4x a plain step from three rows
    on, for the average row) took plain steps at 1.13x / 1.02x; side by side against the
    average row's plan drafting every step, 4 rows at T = 0 1.14x against 1.11x and 3 rows
    at T = 1 1.22x against 1.14x; 8 rows at T = 0 take plain steps (1.05x, where drafting
    ran 1.02x). Trees one level deep ran 5-12% faster than the two-level ones the average row's plan
    picked at 3 and 4 rows, and the rows' own steps filled 92% / 86% of a 4-row batch's
    steps at T = 1 / 0.
    """
    if batch <= 1 or rows_waiting:
        return float(expected)
    return float(expected) - expected_max_normal(batch) * ROW_SPREAD * (float(expected) - 1.0)


def _check_plan(batch: int, max_depth: int, width: int, cont: Sequence[float], scale: float) -> None:
    """``CostModel.plan_for_batch``'s argument checks (``cont``: the continuation rates)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} is out of range: allowed an int >= 1")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth={max_depth!r} is out of range: allowed an int >= 0")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width={width!r} is out of range: allowed an int >= 1")
    if len(cont) < max_depth or any(not 0.0 <= float(c) <= 1.0 for c in cont[:max_depth]):
        raise ValueError(f"continuation must hold at least max_depth={max_depth} rates in [0, 1]")
    if not (isinstance(scale, (int, float)) and 0.0 <= scale < math.inf):
        raise ValueError(f"scale={scale!r} is out of range: allowed a finite number >= 0")


@dataclass(frozen=True)
class CostModel:
    """What ``plan_and_decode(cost_model=...)`` takes: the frozen latencies and an optional
    prior calibration (e.g. ``Calibration.load`` of a file), or else the draft head's priors
    per sampling temperature (``load_priors``; ``rheoplan calibrate`` makes them). Each
    decode starts from a copy of the prior and calibrates online, so the same seed + cost
    model give the same tokens."""

    timings: Timings
    calibration: Calibration | None = None
    #: ``((temperature, Calibration), ...)``: used when ``calibration`` is None; a decode at
    #: temperature T starts from the prior of the nearest temperature (ties: the lower one)
    priors: tuple[tuple[float, Calibration], ...] = ()

    def prior_for(self, temperature: float | None) -> tuple[float | None, Calibration | None]:
        """``(its temperature, the prior)`` a decode at ``temperature`` starts from;
        ``(None, calibration)`` when an explicit calibration is set, ``(None, None)`` without one."""
        if self.calibration is not None or temperature is None or not self.priors:
            return None, self.calibration
        t, cal = min(self.priors, key=lambda tc: (abs(tc[0] - float(temperature)), tc[0]))
        return t, cal

    def fresh_calibration(self, temperature: float | None = None) -> Calibration:
        """A decode's own calibration: a copy of its prior (``prior_for(temperature)``) or an
        empty one."""
        _, prior = self.prior_for(temperature)
        return Calibration.from_dict(prior.to_dict()) if prior is not None else Calibration()

    def plan_for_batch(self, batch: int, *, ctx: int, max_depth: int, width: int = 1,
                       continuation: Sequence[float] | None = None, scale: float = 1.0,
                       rows_waiting: bool = False) -> "BatchPlan":
        """The tree that pays at ``batch`` live rows, a priori: the depth ``D`` (0: plain
        autoregressive steps) and per-row budget ``width * D`` maximising the whole batch's
        tokens per millisecond, ``B * slowest(E(D)) / cost(D)`` with

        * ``E(D) = 1 + scale * sum_{d=1..D} prod_{j<d} continuation[j]`` (expected emitted
          tokens per row: the walk reaches depth ``d`` with the product of the per-depth
          rates; ``scale``: ``Calibration.scale``, realised / predicted so far);
        * ``slowest(E)``: ``slowest_row_tokens(E, B, rows_waiting)``, the slowest row's
          tokens per step, which a static batch waits for (``E`` while rows wait to join);
        * ``cost(D) = D * c_d(B, width) + c_v(B, 1 + width * D, ctx) + c_o(B, D, width)``, and for
          ``D = 0`` a plain autoregressive step, ``c_v(B, 1) + B * c_o'``.

        ``continuation`` defaults to the prior calibration's (``Calibration.continuation``;
        0.5 per depth without one). Ties go to the shallower tree. ``plan_rows`` takes the
        best width of it for the batched loop's several-row steps; ``rheoplan bench batch``
        prints it per batch size.

        Example: a verify forward that costs 10 ms at any size pays for every depth even at
        16 rows; one that costs 1 ms per token of the batch does not pay for any:

            >>> flat = Timings((1, 64), (10.0, 10.0), (10.0, 10.0), 0, 1000, (1,), (0.5,), 0.0, 0.0)
            >>> CostModel(flat).plan_for_batch(16, ctx=64, max_depth=4, continuation=[0.9] * 4).depth
            4
            >>> linear = Timings((1, 64), (1.0, 64.0), (1.0, 64.0), 0, 1000, (1,), (0.5,), 0.0, 0.0)
            >>> CostModel(linear).plan_for_batch(16, ctx=64, max_depth=4, continuation=[0.9] * 4).depth
            0
        """
        cont = list(continuation if continuation is not None else self.fresh_calibration().continuation())
        _check_plan(batch, max_depth, width, cont, scale)
        return self._best_depth(batch, ctx, max_depth, width, cont, scale, rows_waiting,
                                self.timings.ar_step_batch(batch, ctx), {}, {})

    def _best_depth(self, batch: int, ctx: int, max_depth: int, width: int, cont: Sequence[float],
                    scale: float, rows_waiting: bool, ar_ms: float, verify_ms: dict[int, float],
                    overhead_ms: dict[int, float]) -> "BatchPlan":
        """``plan_for_batch`` past its checks, given the plain step's latency ``ar_ms``;
        ``verify_ms`` / ``overhead_ms`` memoise ``c_v(batch, n, ctx)`` by ``n`` and
        ``c_o(batch, d, width)`` by ``(d, width)`` across the widths ``plan_rows`` tries (the same
        numbers, computed once: the loop's latency reads were ~0.25 ms a 4-row step)."""
        tm = self.timings
        best = BatchPlan(batch, 0, 0, 1.0, ar_ms, batch / ar_ms * 1e3, batch / ar_ms * 1e3)
        e, reach = 1.0, 1.0
        draft_ms = tm.draft_batch(batch, width)
        for d in range(1, max_depth + 1):
            reach *= float(cont[d - 1])
            e += scale * reach
            n = 1 + width * d
            v = verify_ms.get(n)
            if v is None:
                v = verify_ms[n] = tm.verify_batch(batch, n, ctx)
            o = overhead_ms.get((d, width))
            if o is None:
                o = overhead_ms[(d, width)] = tm.tree_overhead(batch, d, width)
            cost = d * draft_ms + v + o
            rate = batch * slowest_row_tokens(e, batch, rows_waiting) / cost * 1e3
            if rate > best.tokens_per_s:
                best = BatchPlan(batch, d, width * d, e, cost, rate, best.ar_tokens_per_s, width)
        return best

    def plan_rows(self, batch: int, *, ctx: int, max_depth: int, max_width: int,
                  calibration: Calibration, rows_waiting: bool = False) -> "BatchPlan":
        """The tree several live rows draft, a priori: ``plan_for_batch`` at every width
        ``1 .. min(max_width, PLAN_WIDTHS)`` with that width's continuation rates
        (``calibration.continuation(width)``, measured per width, so unscaled), the best
        one (ties: the narrower). The batched loop drafts its shape (``depth`` levels,
        ``width`` expanded per level, ``budget`` kept per row) whenever its depth is not 0,
        i.e. whenever the batch's slowest row (every row while ``rows_waiting``) gets
        further per millisecond with it than with plain steps. Depends only on the
        latencies, past steps and ``rows_waiting``.

        Example: with a verify forward that costs 1 ms per token, where a second child
        per level doubles the continuation (0.4 -> 0.8), two children per level, two levels
        deep, pay; where it adds almost nothing (0.41), one child one level deep does:

            >>> linear = Timings((1, 64), (10.0, 73.0), (10.0, 73.0), 0, 1000, (1,), (0.5,), 0.0, 0.0)
            >>> cal = Calibration()
            >>> for d in range(2):
            ...     cal.width_trials[d] = [100.0, 100.0, 0.0]
            ...     cal.width_accepts[d] = [40.0, 80.0, 0.0]
            >>> p = CostModel(linear).plan_rows(1, ctx=64, max_depth=2, max_width=2, calibration=cal)
            >>> p.width, p.depth, p.budget
            (2, 2, 4)
            >>> cal.width_accepts[0][1] = cal.width_accepts[1][1] = 41.0
            >>> p = CostModel(linear).plan_rows(1, ctx=64, max_depth=2, max_width=2, calibration=cal)
            >>> p.width, p.depth, p.budget
            (1, 1, 1)
        """
        if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 1:
            raise ValueError(f"max_width={max_width!r} is out of range: allowed an int >= 1")
        # plan_for_batch at each width, with the latencies read once for all of them (the
        # plain step, the verify forward by tree size, the bookkeeping by depth)
        ar_ms = self.timings.ar_step_batch(batch, ctx)
        verify_ms: dict[int, float] = {}
        overhead_ms: dict[int, float] = {}
        best = None
        for w in range(1, min(max_width, PLAN_WIDTHS) + 1):
            cont = calibration.continuation(w, depths=max_depth)
            _check_plan(batch, max_depth, w, cont, 1.0)
            p = self._best_depth(batch, ctx, max_depth, w, cont, 1.0, rows_waiting, ar_ms, verify_ms, overhead_ms)
            if best is None or p.tokens_per_s > best.tokens_per_s:
                best = p
        return best


    def needed_continuation(self, batch: int, speedup: float, *, ctx: int, max_depth: int,
                            width: int = 1, step: float = 0.01) -> tuple[float, int] | None:
        """The smallest per-depth continuation rate ``c`` (on a grid of ``step``) at which
        ``plan_for_batch(batch, continuation=[c] * max_depth)`` predicts at least ``speedup``
        times plain autoregressive steps, with the tree depth it picks; None when not even
        ``c = 1`` (every drafted token accepted) gets there. What a head must reach on this
        machine for a speed goal: the latencies are measured, only acceptance is free. For
        ``batch > 1`` it is a static batch's goal (``plan_for_batch`` counts the slowest
        row's tokens).

        Example: with the flat verify cost of ``plan_for_batch``'s example, a 1.5x speed-up
        needs about half of the drafted tokens at every depth:

            >>> flat = Timings((1, 64), (10.0, 10.0), (10.0, 10.0), 0, 1000, (1,), (0.5,), 0.0, 0.0)
            >>> CostModel(flat).needed_continuation(1, 1.5, ctx=64, max_depth=4)
            (0.45, 3)
        """
        if not (isinstance(speedup, (int, float)) and speedup > 0):
            raise ValueError(f"speedup={speedup!r} is out of range: allowed a number > 0")
        if not (isinstance(step, float) and 0.0 < step <= 0.5):
            raise ValueError(f"step={step!r} is out of range: allowed a float in (0, 0.5]")
        n = int(round(1.0 / step))
        for i in range(n + 1):
            c = round(i * step, 10)
            p = self.plan_for_batch(batch, ctx=ctx, max_depth=max_depth, width=width, continuation=[c] * max_depth)
            if p.tokens_per_s >= speedup * p.ar_tokens_per_s:
                return c, p.depth
        return None


@dataclass(frozen=True)
class BatchPlan:
    """``CostModel.plan_for_batch``'s answer for one batch size."""

    batch: int  #: live rows B
    depth: int  #: draft depth D (0: plain autoregressive steps)
    budget: int  #: drafted nodes kept per row
    expected_tokens: float  #: E: expected emitted tokens per row per step (the average row's)
    predicted_ms: float  #: predicted latency of one step of the whole batch
    #: the whole batch's predicted tokens per second with this tree, as fast as its slowest
    #: row goes (``slowest_row_tokens``; the average row's where rows wait to join)
    tokens_per_s: float
    ar_tokens_per_s: float  #: the same for plain autoregressive steps
    width: int = 1  #: nodes expanded per level (``budget = width * depth``)

    def as_dict(self) -> dict:
        return asdict(self)


# -- the cache of measured timings --------------------------------------------------------------


def cache_dir() -> Path:
    """``$RHEOPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/rheoplan``, else ``~/.cache/rheoplan``."""
    env = os.environ.get("RHEOPLAN_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rheoplan"


def machine_name(device: torch.device | str = "cpu") -> str:
    """The CPU model (``/proc/cpuinfo``'s model name) or the GPU's name: the cache key's machine."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cache_key(kind: str, model_id: str, device: torch.device | str = "cpu", **extra) -> str:
    """A readable key: what was measured, on which machine, torch version, threads, model."""
    parts = [kind, machine_name(device), f"torch {torch.__version__}",
             f"threads {torch.get_num_threads()}", model_id]
    parts += [f"{k}={v}" for k, v in sorted(extra.items())]
    return " | ".join(parts)


def cache_read(name: str, key: str) -> dict | None:
    """The record stored under ``key`` in ``cache_dir()/name`` (a JSON object of records)."""
    f = cache_dir() / name
    try:
        data = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    rec = data.get(key) if isinstance(data, dict) else None
    return rec if isinstance(rec, dict) else None


def cache_write(name: str, key: str, record: dict) -> Path:
    """Store ``record`` under ``key`` in ``cache_dir()/name`` (other keys are kept)."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    f = d / name
    try:
        data = json.loads(f.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, json.JSONDecodeError):
        data = {}
    data[key] = record
    tmp = f.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(f)
    return f
