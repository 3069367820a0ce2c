"""Pass ``assign``: stochastic token assignment (docs/method.md §3-4).

For every expanded node whose sampled slot is still pending, draw ``Y ~ q~`` (the
tail law over ranks ``m+1..S``, ``rheoplan.distributions.tail_law``) and fill the
slots that depend on it: the SAMPLED child's token (and, for the ``true_q`` proxy,
its weight ``q(Y)``), then the PAD children: the best tail tokens other than ``Y``,
in rank order.

The draw goes through ``ctx.sampler(tree, node, qtilde) -> tail index``; the default
sampler is Gumbel-max over the tail with noise from the counter-based draft stream
(``rheoplan.rng``), so a draw is reproducible and can be injected (the exact oracle
injects every possible ``Y`` in turn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rheoplan.distributions import tail_law
from rheoplan.ir import DraftTree
from rheoplan.pipeline import PassContext, SamplerFn, builtin_pass
from rheoplan.planner.expand import log_weight
from rheoplan.rng import Purpose, Streams, gumbel_from_uniform


@dataclass(frozen=True)
class GumbelSampler:
    """The default sampler: Gumbel-max draw from ``qtilde`` with noise from the draft
    stream of ``(step, tree, node)``.

    Besides the per-row call every sampler has, it offers the batch interface the
    kernel passes use (``rheoplan.pipeline.BatchSampler``): ``gumbel_rows`` gives the
    noise of many rows at once. The sampler names the streams (seed, step, purpose); the
    calling pass brings the generator (numba Philox on the CPU, the Triton Philox on the
    device: the same numbers as ``Streams``). A sampler without it (the exact oracle
    injects draws) is called row by row instead.
    """

    streams: Streams
    step: int

    def __call__(self, b: int, node: int, qtilde: torch.Tensor) -> int:
        g = self.streams.gumbel(self.step, b, node, Purpose.DRAFT_SAMPLE, qtilde.numel())
        return int(torch.argmax(torch.log(qtilde) + g))

    def gumbel_rows(self, trees: torch.Tensor, nodes: torch.Tensor, n: int, uniform) -> torch.Tensor:
        """Noise ``[R, n]`` float64 of rows ``(trees[r], nodes[r])``: row r is
        ``streams.gumbel(step, trees[r], nodes[r], DRAFT_SAMPLE, n)``, made by the caller's
        generator ``uniform(seed, step, trees, nodes, purpose, n) -> [R, n]`` (a batched
        ``Streams.uniform``; ``purpose`` is the counter word, ``Streams.purpose_key``)."""
        key = self.streams.purpose_key(Purpose.DRAFT_SAMPLE)  # mutation (c) collapses purposes here
        return gumbel_from_uniform(uniform(self.streams.seed, self.step, trees, nodes, key, n))


def gumbel_sampler(streams: Streams, step: int) -> SamplerFn:
    """``GumbelSampler(streams, step)``: the sampler ``plan_tree`` uses by default."""
    return GumbelSampler(streams, step)


def has_sampled_slots(tree: DraftTree, ctx: PassContext) -> bool:
    """The input check every ``assign`` implementation shares: ``ctx.sampler`` must be set,
    and with no sampled slot (``rheostat >= slots``, EAGLE's top-K) nothing is drawn."""
    if ctx.sampler is None:
        raise ValueError("assign needs ctx.sampler (e.g. gumbel_sampler(Streams(seed), step))")
    return tree.rheostat < tree.slots


def assign(tree: DraftTree, ctx: PassContext) -> DraftTree:
    if not has_sampled_slots(tree, ctx):
        return tree
    K, m = tree.slots, tree.rheostat
    t = tree.clone()
    for b in range(t.batch):
        for row in range(int(t.n_expanded[b])):
            if int(t.y_token[b, row]) >= 0:
                continue  # drawn at an earlier depth
            v = int(t.exp_node[b, row])
            n = int(t.sup_n[b, row])
            sup_tok, sup_q = t.sup_token[b, row], t.sup_q[b, row]
            qt = tail_law(sup_q, m, n)
            i = ctx.sampler(b, v, qt)
            if not 0 <= i < qt.numel():
                raise ValueError(f"sampler returned tail index {i}, allowed [0, {qt.numel()})")
            y_rank = m + i
            t.y_token[b, row] = sup_tok[y_rank]
            t.y_qtilde[b, row] = float(qt[i])
            base = float(t.score[b, v])
            c = int(t.y_node[b, row])
            t.token[b, c] = sup_tok[y_rank]
            t.q[b, c] = sup_q[y_rank]
            if ctx.tree_cfg.proxy == "true_q":
                t.weight[b, c] = sup_q[y_rank]
                t.score[b, c] = base + log_weight(float(sup_q[y_rank]))
            # PAD slots follow the sampled one; they take tail ranks in order, skipping Y.
            pad_ranks = [r for r in range(m, n) if r != y_rank][: K - m - 1]
            for j, r in enumerate(pad_ranks):
                p = c + 1 + j
                t.token[b, p] = sup_tok[r]
                t.q[b, p] = sup_q[r]
                t.weight[b, p] = sup_q[r]
                t.score[b, p] = base + log_weight(float(sup_q[r]))
    return t


#: the pass with its implementations: torch reference (above), numba CPU, Triton
assign_pass = builtin_pass("assign", assign,
                           numba="rheoplan.kernels.slot_expansion.cpu_pass:assign",
                           triton="rheoplan.kernels.slot_expansion.triton_pass:assign")
