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
    noise of many rows at once (the Triton pass), ``stream_rows`` the streams they read
    (the numba pass, whose kernel draws as it reads them). The sampler names the streams (seed, step, purpose); the
    calling pass brings the generator (numba Philox on the CPU, the Triton Philox on the
    device: the same numbers as ``Streams``). A sampler without it (the exact oracle
    injects draws) is called row by row instead.
    """

    streams: Streams
    #: the step word of the counter: one int, or one per tree (a batch whose rows joined at
    #: different steps counts each row's own steps)
    step: int | tuple[int, ...]
    #: each tree's stream id (the ``tree`` word of the counter); None: its batch index.
    #: A batched decode gives row ``b`` its own id, so a row draws the same numbers
    #: whichever rows share its batch (``plan_and_decode(stream_ids=)``).
    keys: tuple[int, ...] | None = None

    def key(self, b: int) -> int:
        return b if self.keys is None else self.keys[b]

    def step_of(self, b: int) -> int:
        return self.step if isinstance(self.step, int) else self.step[b]

    def __call__(self, b: int, node: int, qtilde: torch.Tensor) -> int:
        g = self.streams.gumbel(self.step_of(b), self.key(b), node, Purpose.DRAFT_SAMPLE, qtilde.numel())
        return int(torch.argmax(torch.log(qtilde) + g))

    def stream_rows(self, trees: torch.Tensor, nodes: torch.Tensor):
        """The streams the draws of rows ``(trees[r], nodes[r])`` read: ``(seed, step, ids,
        purpose)``, row r's uniforms being ``Streams(seed).uniform(step[r], ids[r],
        nodes[r], purpose, n)`` (``step`` one int for every row or ``[R]``; ``purpose`` the
        counter word, ``Streams.purpose_key``). A kernel that reads the stream itself (the
        numba ``assign``) takes these instead of ``gumbel_rows``' noise."""
        key = self.streams.purpose_key(Purpose.DRAFT_SAMPLE)  # mutation (c) collapses purposes here
        ids = trees if self.keys is None else torch.as_tensor(self.keys, dtype=torch.int64, device=trees.device)[trees]
        steps = self.step if isinstance(self.step, int) else torch.as_tensor(self.step, dtype=torch.int64)[trees.cpu()]
        return self.streams.seed, steps, ids, key

    def gumbel_rows(self, trees: torch.Tensor, nodes: torch.Tensor, n: int, uniform) -> torch.Tensor:
        """Noise ``[R, n]`` float64 of rows ``(trees[r], nodes[r])``: row r is
        ``streams.gumbel(step, trees[r], nodes[r], DRAFT_SAMPLE, n)``, made by the caller's
        generator ``uniform(seed, step, trees, nodes, purpose, n) -> [R, n]`` (a batched
        ``Streams.uniform``; ``purpose`` is the counter word, ``Streams.purpose_key``)."""
        _, steps, ids, key = self.stream_rows(trees, nodes)
        steps = None if isinstance(steps, int) else steps
        if steps is None or bool((steps == steps[0]).all()):
            step = self.step if steps is None else int(steps[0]) if steps.numel() else 0
            return gumbel_from_uniform(uniform(self.streams.seed, step, ids, nodes, key, n))
        # rows at different steps: one generator call per step value
        out = torch.empty(trees.shape[0], n, dtype=torch.float64, device=nodes.device)
        for st in steps.unique().tolist():
            sel = (steps == st).nonzero().flatten()
            out[sel.to(out.device)] = uniform(self.streams.seed, st, ids[sel.to(ids.device)],
                                              nodes[sel.to(nodes.device)], key, n).to(out.dtype)
        return gumbel_from_uniform(out)


def gumbel_sampler(streams: Streams, step, keys=None) -> SamplerFn:
    """``GumbelSampler(streams, step, keys)``: the sampler ``plan_tree`` uses by default
    (``step`` an int or one int per tree)."""
    step = int(step) if isinstance(step, int) else tuple(int(x) for x in step)
    return GumbelSampler(streams, step, None if keys is None else tuple(int(k) for k in keys))


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
