"""A kernel-backed planner pipeline: the passes of ``planner/default.DEFAULT_PIPELINE``
(``expand@d``, ``assign@d``, ``prune``, ``linearize``) with their bookkeeping done by the
numba CPU kernels. It produces a ``DraftTree`` identical (every tensor equal) to the
reference pipeline's for the same seed; ``tests/kernels/pipeline`` checks it.

    >>> from rheoplan.kernels.pipeline import kernel_pipeline
    >>> t = plan_tree(draft, roots, tree=cfg, sampling=s, passes=kernel_pipeline())  # doctest: +SKIP

Randomness. ``assign`` needs the Gumbel noise of every pending sampled slot. With the
default sampler (``rheoplan.planner.assign.GumbelSampler(streams, step)``, what
``plan_tree`` installs) the pass reads ``streams`` and ``step`` from it and generates
all the noise of the depth in one numba call (``rheoplan.kernels.philox``, bit-identical to numpy's
Philox). Any other sampler (the exact oracle injects draws) is called once per row with
the same ``q~`` tensor the reference passes, so results stay identical. No field was
added to ``PassContext``.

Bit-identity. The kernels do the selection, ranking and table writes; the few float
steps whose rounding torch decides (softmax, ``log``, the float64 tail sum) stay in
torch, in the same vectorised ops the reference uses (see ``slot_expansion/cpu.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from rheoplan.distributions import draft_probs, tail_law
from rheoplan.ir import DraftTree, LinearTree, NodeKind
from rheoplan.kernels.philox import streams_uniform
from rheoplan.kernels.plan.cpu import frontier_rows, linearize as linearize_kernel, prune_rows
from rheoplan.kernels.slot_expansion.cpu import PROXY_CODES, rank_support_rows, tail_mass
from rheoplan.pipeline import FnPass, PassContext, Repeat
from rheoplan.planner.assign import GumbelSampler
from rheoplan.planner.expand import check_can_expand, check_draft_logits
from rheoplan.rng import Purpose, Streams, philox_counter

_DET, _SAMPLED, _PAD = int(NodeKind.DET), int(NodeKind.SAMPLED), int(NodeKind.PAD)


def _default_gumbel(sampler) -> tuple[Streams, int] | None:
    """``(streams, step)`` when ``sampler`` is the default ``GumbelSampler``, else None."""
    if type(sampler) is not GumbelSampler:
        return None
    return sampler.streams, sampler.step


def _clone(tree: DraftTree, names: tuple[str, ...]) -> DraftTree:
    """A new tree whose ``names`` tensors are fresh copies (the others are shared and
    not written: passes stay pure without copying all ~25 tensors)."""
    # numpy copies: a third of the cost of torch.clone for these small CPU tensors
    return tree.replace(**{n: torch.from_numpy(getattr(tree, n).numpy().copy()) for n in names})


# -- shared ------------------------------------------------------------------------------


@njit(cache=True)
def _write_scores(score, parent, out_b, out_c, logw, ns):
    """score[c] = float32(float64(score[parent(c)]) + float64(log w)), the reference's
    rule (``base + log_weight(w)`` in Python floats); the log itself comes from torch."""
    for r in range(ns):
        b, c = out_b[r], out_c[r]
        score[b, c] = np.float32(np.float64(score[b, parent[b, c]]) + np.float64(logw[r]))


def _score_children(t: DraftTree, out_b, out_c, wbuf, ns: int) -> None:
    if ns:
        logw = torch.log(torch.from_numpy(wbuf[:ns])).numpy()  # SLEEF log, as the reference
        _write_scores(t.score.numpy(), t.parent.numpy(), out_b, out_c, logw, ns)


# -- expand -------------------------------------------------------------------------------


@njit(cache=True)
def _broken_rows(x):
    """Whether any row has NaN or +inf, or no finite entry (``draft_probs``'s check)."""
    for r in range(x.shape[0]):
        finite = False
        for v in x[r]:
            if np.isnan(v) or v == np.inf:
                return True
            finite = finite or v > -np.inf
        if not finite:
            return True
    return False


def _draft_probs(rows: torch.Tensor, sampling) -> torch.Tensor:
    """``rheoplan.distributions.draft_probs`` (same bits, same error) with its input
    check done in one numba scan instead of five torch reductions."""
    x = rows.to(device="cpu", dtype=torch.float32).contiguous()
    if _broken_rows(x.numpy()):
        return draft_probs(x, sampling)  # raises the reference's error
    T = sampling.draft_temperature
    return torch.softmax(x if T == 1.0 else x / T, dim=-1)  # x / 1 is exact: skipping it changes no bit


@njit(cache=True)
def _frontier_rows(nodes, count, rows_b, rows_v):
    """Flatten the -1 padded frontier ``nodes [B, w]`` into (tree, node) rows, b-major."""
    r = 0
    for b in range(nodes.shape[0]):
        for j in range(count[b]):
            rows_b[r] = b
            rows_v[r] = nodes[b, j]
            r += 1
    return r


@njit(cache=True)
def _expand_write(rows_b, rows_v, sup_tok, sup_q, s, z64, proxy_code, m, K, level,
                  n_nodes, n_expanded, expanded, exp_row, exp_node, t_sup_token, t_sup_q, t_sup_n, t_z,
                  parent, depth, slot, kind, token, q, weight, score, y_node, out_b, out_c, wbuf):
    """Create the K slots of every frontier row (``planner.expand`` body). Children whose
    weight is known get ``(b, c, w)`` in ``out_b/out_c/wbuf`` for scoring; the pending
    ones (PAD, and SAMPLED under 'true_q') get a NaN score like the reference. Returns
    how many were listed."""
    ns = 0
    for r in range(rows_b.shape[0]):
        b, v = rows_b[r], rows_v[r]
        row = n_expanded[b]
        n_expanded[b] += 1
        expanded[b, v] = True
        exp_row[b, v] = row
        exp_node[b, row] = v
        t_sup_token[b, row, :s] = sup_tok[r]
        t_sup_q[b, row, :s] = sup_q[r]
        t_sup_n[b, row] = s
        t_z[b, row] = np.float32(z64[r])
        pi = np.nan
        if m < K:
            if proxy_code == 0:  # default: min(q(r_m), z), or q(r_1) when m == 0
                pi = np.float64(sup_q[r, 0]) if m == 0 else min(np.float64(sup_q[r, m - 1]), z64[r])
            elif proxy_code == 1:  # next_rank: q(r_{m+1})
                pi = np.float64(sup_q[r, m])
        for sl in range(K):
            c = n_nodes[b]
            n_nodes[b] += 1
            parent[b, c] = v
            depth[b, c] = level + 1
            slot[b, c] = sl
            if sl < m:
                kind[b, c] = _DET
                token[b, c] = sup_tok[r, sl]
                q[b, c] = sup_q[r, sl]
                weight[b, c] = sup_q[r, sl]
            elif sl == m:
                kind[b, c] = _SAMPLED
                y_node[b, row] = c
                if np.isnan(pi):
                    score[b, c] = np.nan
                    continue
                weight[b, c] = np.float32(pi)
            else:
                kind[b, c] = _PAD
                score[b, c] = np.nan
                continue
            out_b[ns] = b
            out_c[ns] = c
            wbuf[ns] = weight[b, c]
            ns += 1
    return ns


_EXPAND_FIELDS = ("n_nodes", "n_expanded", "expanded", "exp_row", "exp_node", "sup_token", "sup_q",
                  "sup_n", "z", "parent", "depth", "slot", "kind", "token", "q", "weight", "score", "y_node")


def expand(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.expand.expand`` with numba frontier selection, top-S and slot writes."""
    cfg = ctx.tree_cfg
    check_can_expand(tree, ctx)
    K, m, B = tree.slots, tree.rheostat, tree.batch
    k = 1 if tree.cur_depth == 0 else cfg.frontier
    nodes_np = np.empty((B, k), dtype=np.int64)
    count = np.empty(B, dtype=np.int64)
    frontier_rows(tree.score.numpy(), tree.depth.numpy(), tree.n_nodes.numpy(), tree.cur_depth, k,
                  nodes_np, count)
    width = int(count.max())
    nodes = torch.from_numpy(nodes_np[:, :width].copy())
    logits = ctx.draft(tree, nodes)
    V = check_draft_logits(logits, B, width, K, cfg.support)
    rows_b = np.empty(B * width, dtype=np.int64)
    rows_v = np.empty(B * width, dtype=np.int64)
    R = _frontier_rows(nodes_np, count, rows_b, rows_v)
    rows = logits.reshape(B * width, V) if R == B * width else logits[nodes >= 0]  # b-major
    q = _draft_probs(rows, ctx.sampling)  # row-wise: same bits as per-tree calls
    s = min(cfg.support, V)
    sup_tok = np.empty((R, s), dtype=np.int64)
    sup_q = np.empty((R, s), dtype=np.float32)
    rank_support_rows(q.numpy(), s, sup_tok, sup_q)
    z64 = tail_mass(torch.from_numpy(sup_q), m, s).numpy()
    t = _clone(tree, _EXPAND_FIELDS)
    out_b = np.empty(R * K, dtype=np.int64)
    out_c = np.empty(R * K, dtype=np.int64)
    wbuf = np.empty(R * K, dtype=np.float32)
    a = [getattr(t, f).numpy() for f in _EXPAND_FIELDS]
    ns = _expand_write(rows_b[:R], rows_v[:R], sup_tok, sup_q, s, z64, PROXY_CODES[cfg.proxy], m, K,
                       tree.cur_depth, *a, out_b, out_c, wbuf)
    _score_children(t, out_b, out_c, wbuf, ns)
    return t.replace(cur_depth=tree.cur_depth + 1)


# -- assign -------------------------------------------------------------------------------


@njit(cache=True)
def _pending_rows(n_expanded, y_token, exp_node, sup_n, m, bi, ri, nodes, n_tail):
    """Expansion rows whose Y is not drawn yet, b-major (the reference's loop order)."""
    R = 0
    for b in range(n_expanded.shape[0]):
        for row in range(n_expanded[b]):
            if y_token[b, row] < 0:
                bi[R] = b
                ri[R] = row
                nodes[R] = exp_node[b, row]
                n_tail[R] = sup_n[b, row] - m
                R += 1
    return R


@njit(cache=True)
def _tail_rows(sup_q, bi, ri, n_tail, z64, m, qt):
    """``qt[r, :n_tail[r]]`` = the tail law of row ``(bi[r], ri[r])``; padding stays 1
    (its log, 0, is masked out by the draw)."""
    for r in range(bi.shape[0]):
        b, row = bi[r], ri[r]
        for i in range(n_tail[r]):
            qt[r, i] = np.float64(sup_q[b, row, m + i]) / z64[r] if z64[r] > 0 else 1.0 / n_tail[r]


@njit(cache=True)
def _gather_tails(sup_q, bi, ri, m, out):
    """``out[r] = sup_q[bi[r], ri[r], m:m + out.shape[1]]`` (contiguous, for torch's sum)."""
    for r in range(bi.shape[0]):
        out[r, :] = sup_q[bi[r], ri[r], m:m + out.shape[1]]


@njit(cache=True)
def _negate(x, out):
    for i in range(x.size):
        out.flat[i] = -x.flat[i]


@njit(cache=True)
def _gumbel_argmax(log_qt, log_neg_log_u, n_tail, qt, y_tail, y_qt):
    """``argmax(log q~ + g)`` per row with ``g = -log(-log u)`` (first max on ties)."""
    for r in range(log_qt.shape[0]):
        best = -np.inf
        arg = 0
        for i in range(n_tail[r]):
            key = log_qt[r, i] + (-log_neg_log_u[r, i])
            if key > best:
                best = key
                arg = i
        y_tail[r] = arg
        y_qt[r] = qt[r, arg]


@njit(cache=True)
def _assign_write(bi, ri, y_tail, y_qt, m, K, proxy_true_q, sup_token, sup_q, y_node,
                  token, q, weight, y_token, y_qtilde, out_b, out_c, wbuf):
    """Fill the SAMPLED and PAD slots of each drawn row (``planner.assign`` body)."""
    ns = 0
    for r in range(bi.shape[0]):
        b, row = bi[r], ri[r]
        yr = m + y_tail[r]
        y_token[b, row] = sup_token[b, row, yr]
        y_qtilde[b, row] = np.float32(y_qt[r])
        c = y_node[b, row]
        token[b, c] = sup_token[b, row, yr]
        q[b, c] = sup_q[b, row, yr]
        if proxy_true_q:
            weight[b, c] = sup_q[b, row, yr]
            out_b[ns], out_c[ns], wbuf[ns] = b, c, weight[b, c]
            ns += 1
        p = c + 1
        rank = m
        while p < c + K - m:  # PAD: tail ranks in order, skipping Y
            if rank != yr:
                token[b, p] = sup_token[b, row, rank]
                q[b, p] = sup_q[b, row, rank]
                weight[b, p] = sup_q[b, row, rank]
                out_b[ns], out_c[ns], wbuf[ns] = b, p, weight[b, p]
                ns += 1
                p += 1
            rank += 1
    return ns


_ASSIGN_FIELDS = ("token", "q", "weight", "score", "y_token", "y_qtilde")


def _draw_default(tree: DraftTree, streams: Streams, step: int, m: int, bi, ri, nodes, n_tail):
    """Gumbel-max draws of ``gumbel_sampler(streams, step)`` for all rows at once."""
    R, width = bi.shape[0], int(n_tail.max())
    if bool((n_tail == n_tail[0]).all()):
        tails = np.empty((R, width), dtype=np.float32)
        _gather_tails(tree.sup_q.numpy(), bi, ri, m, tails)
        z64 = torch.from_numpy(tails).to(torch.float64).sum(dim=1)  # = tail_mass (same reduction)
    else:  # ragged supports (mixed vocabularies): the reference's own 1-D sums
        sq = tree.sup_q[torch.from_numpy(bi), torch.from_numpy(ri)]
        z64 = torch.stack([sq[r, m:m + int(n_tail[r])].to(torch.float64).sum() for r in range(R)])
    # x[0] = q~ (padding 1), x[1] = the uniforms of Streams.uniform (padding 0.5)
    x = np.ones((2, R, width))
    _tail_rows(tree.sup_q.numpy(), bi, ri, n_tail, z64.numpy(), m, x[0])
    x[1] = 0.5
    ctr = np.empty((R, 4), dtype=np.uint64)
    for w, word in enumerate(philox_counter(step, bi.astype(np.uint64), nodes.astype(np.uint64),
                                            streams.purpose_key(Purpose.DRAFT_SAMPLE))):
        ctr[:, w] = word
    streams_uniform(streams.seed, ctr, n_tail, x[1])
    logs = torch.log(torch.from_numpy(x)).numpy()  # log q~ and log u: torch's log, as the reference
    neg = np.empty((R, width))
    _negate(logs[1], neg)
    lnl = torch.log(torch.from_numpy(neg)).numpy()
    y_tail = np.empty(R, dtype=np.int64)
    y_qt = np.empty(R)
    _gumbel_argmax(logs[0], lnl, n_tail, x[0], y_tail, y_qt)
    return y_tail, y_qt


def assign(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.assign.assign`` with batched noise, draws and slot writes."""
    if ctx.sampler is None:
        raise ValueError("assign needs ctx.sampler (e.g. gumbel_sampler(Streams(seed), step))")
    K, m = tree.slots, tree.rheostat
    if m >= K:
        return tree
    cap = tree.batch * tree.exp_node.shape[1]
    bi, ri, nodes, n_tail = (np.empty(cap, dtype=np.int64) for _ in range(4))
    R = _pending_rows(tree.n_expanded.numpy(), tree.y_token.numpy(), tree.exp_node.numpy(),
                      tree.sup_n.numpy(), m, bi, ri, nodes, n_tail)
    if R == 0:
        return tree
    bi, ri, nodes, n_tail = bi[:R], ri[:R], nodes[:R], n_tail[:R]
    gum = _default_gumbel(ctx.sampler)
    if gum is not None:
        y_tail, y_qt = _draw_default(tree, gum[0], gum[1], m, bi, ri, nodes, n_tail)
    else:
        y_tail = np.empty(R, dtype=np.int64)
        y_qt = np.empty(R)
        for r in range(R):
            law = tail_law(tree.sup_q[int(bi[r]), int(ri[r])], m, m + int(n_tail[r]))
            i = ctx.sampler(int(bi[r]), int(nodes[r]), law)
            if not 0 <= i < law.numel():
                raise ValueError(f"sampler returned tail index {i}, allowed [0, {law.numel()})")
            y_tail[r], y_qt[r] = i, float(law[i])
    t = _clone(tree, _ASSIGN_FIELDS)
    out_b = np.empty(R * K, dtype=np.int64)
    out_c = np.empty(R * K, dtype=np.int64)
    wbuf = np.empty(R * K, dtype=np.float32)
    ns = _assign_write(bi, ri, y_tail, y_qt, m, K, ctx.tree_cfg.proxy == "true_q",
                       tree.sup_token.numpy(), tree.sup_q.numpy(), tree.y_node.numpy(), t.token.numpy(),
                       t.q.numpy(), t.weight.numpy(), t.y_token.numpy(), t.y_qtilde.numpy(),
                       out_b, out_c, wbuf)
    _score_children(t, out_b, out_c, wbuf, ns)
    return t


# -- prune, linearize ---------------------------------------------------------------------


def prune(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.prune.prune``: global top-N by (score desc, id asc), numba selection."""
    kept = np.zeros(tuple(tree.kept.shape), dtype=np.bool_)
    prune_rows(tree.score.numpy(), tree.n_nodes.numpy(), ctx.tree_cfg.budget, kept)
    return tree.replace(kept=torch.from_numpy(kept))


def linearize(tree: DraftTree, ctx: PassContext) -> DraftTree:
    """``planner.linearize.linearize`` with the numba linearisation kernel."""
    lin = linearize_kernel(tree.kept, tree.n_nodes, tree.parent, tree.token, tree.depth, tree.exp_row,
                           tree.prefix_len, ctx.tree_cfg.budget, ctx.tree_cfg.depth)
    return tree.replace(linear=LinearTree(*lin))


def kernel_pipeline(device: str = "cpu") -> list:
    """The default pass list with kernel-backed passes (same names, same output).

    Only ``device='cpu'`` (numba) exists: on GPU the planner state would live on the
    device and the Triton kernels in ``rheoplan.kernels.{slot_expansion,plan}`` take over;
    that lowering is not wired into a pipeline yet.

    Example:
        >>> [p.name for p in kernel_pipeline()]
        ['grow', 'prune', 'linearize']
    """
    if device != "cpu":
        raise ValueError(f"device={device!r}: only 'cpu' (numba kernels) has a kernel pipeline so far")
    return [
        Repeat("grow", (FnPass("expand", expand), FnPass("assign", assign)),
               times=lambda ctx: ctx.tree_cfg.depth),
        FnPass("prune", prune),
        FnPass("linearize", linearize),
    ]
