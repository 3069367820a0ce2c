"""Pass ``expand``: structure-distribution expansion (docs/method.md §3, §4 steps 1-2).

Creates the next level: picks the frontier (the root at the first call, else the
``k`` best nodes of the deepest level), asks the draft for their distributions
through ``ctx.draft`` and gives each ``K`` child slots:

* DET   ranks ``1..m``: token and q known now, weight = q.
* SAMPLED (one, when ``m < K``): token pending; weight = the proxy pi (known now for
  ``default`` / ``next_rank``, pending for ``true_q`` because it needs the token).
* PAD   (``K-m-1``): tokens pending, since they skip the sampled token.

Pending slots have ``token == -1``; the ``assign`` pass fills them. Scores are
``score(parent) + log(weight)`` in float32.
"""

from __future__ import annotations

import math

import torch

from rheoplan.config import PROXIES, TreeConfig
from rheoplan.distributions import SubsetLogits, draft_probs, rank_support, tail_mass
from rheoplan.ir import DraftTree, NodeKind, rank_key_order
from rheoplan.pipeline import PassContext, builtin_pass


def proxy_weights(policy: str, sup_q: torch.Tensor, z: torch.Tensor, m: int) -> torch.Tensor:
    """Shaping weight pi of the sampled slot for every row of ``sup_q [R, S]`` (ranked
    support probabilities), float64 ``[R]``; NaN when it needs the drawn token.

    ``z [R]`` is the tail mass (``rheoplan.distributions.tail_mass``, float64).

    * ``default``:   ``min(q(r_m), z)`` for ``m >= 1``, ``q(r_1)`` for ``m = 0``
    * ``next_rank``: ``q(r_{m+1})``
    * ``true_q``:    ``q(Y)`` (NaN here; ``assign`` sets it)

    The one definition: the reference, numba and Triton planners all call it (the
    standalone slot-expansion kernels carry ports pinned to it by parity tests).

    Example: sup_q [[0.5, 0.3, 0.2]], z [0.5], m = 1: default -> [0.5], next_rank -> [0.3].
    """
    if policy == "default":
        if m == 0:
            return sup_q[:, 0].to(torch.float64)
        return torch.minimum(sup_q[:, m - 1].to(torch.float64), z.to(torch.float64))
    if policy == "next_rank":
        return sup_q[:, m].to(torch.float64)
    if policy == "true_q":
        return torch.full((sup_q.shape[0],), math.nan, dtype=torch.float64, device=sup_q.device)
    raise ValueError(f"proxy={policy!r} is not one of {PROXIES}")


def proxy_weight(policy: str, sup_q: torch.Tensor, m: int, n: int) -> float | None:
    """``proxy_weights`` for one node's ``sup_q`` (``n`` valid entries): a float, or None
    when it needs the drawn token (``true_q``).

    Example: sup_q [0.5, 0.3, 0.2], m = 1: default -> min(0.5, 0.5) = 0.5, next_rank -> 0.3.
    """
    row = sup_q[None, :n]
    pi = float(proxy_weights(policy, row, tail_mass(row, m, n), m)[0])
    return None if math.isnan(pi) else pi


def log_weight(w: float) -> float:
    """log of a weight in float32 (``-inf`` for 0), the one place scores get their logs."""
    return float(torch.log(torch.tensor(w, dtype=torch.float32)))


def add_log_weight(base: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``float32(float64(base) + float64(log(weight)))`` elementwise: the score rule
    ``base + log_weight(w)`` for many children at once (what the kernel passes call)."""
    return (base.to(torch.float64) + torch.log(weight).to(torch.float64)).to(torch.float32)


def select_frontier(tree: DraftTree, b: int, k: int) -> list[int]:
    """Node ids of the ``k`` best nodes at the deepest level of tree ``b`` (root at depth 0)."""
    n = int(tree.n_nodes[b])
    ids = torch.nonzero(tree.depth[b, :n] == tree.cur_depth).flatten()
    order = rank_key_order(tree.score[b, ids], ids)
    return [int(i) for i in ids[order[:k]]]


def frontier_width(cfg: TreeConfig, slots: int, level: int) -> int:
    """How many nodes ``expand`` drafts at ``level`` (0 = the root), known on the host.

    Every expanded node gets exactly ``slots`` children, so level ``d`` holds
    ``slots * width(d - 1)`` nodes and the frontier takes ``min(frontier, that)``; the
    device planner sizes its draft call from this and never asks the device.

    Example: frontier 3, slots 2: widths 1, 2, 3, 3, ...
    """
    w = 1
    for _ in range(level):
        w = min(cfg.frontier, w * slots)
    return w


def check_can_expand(tree: DraftTree, ctx: PassContext) -> None:
    """Refuse to grow past ``depth`` or without a draft callback (shared with the kernel pass)."""
    if tree.cur_depth >= ctx.tree_cfg.depth:
        raise ValueError(f"tree already has depth {tree.cur_depth} = depth={ctx.tree_cfg.depth}")
    if ctx.draft is None:
        raise ValueError("expand needs ctx.draft, the draft-forward callback")


def draft_columns(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft's answer as ``(logits [B, width, V'], ids)``: a dense ``[B, width, V]``
    tensor gives ``ids = None`` (column = token id); a ``SubsetLogits`` its target ids of
    the columns, which the ``expand`` passes map the ranked columns through
    (``sup_token = ids[column]``) after the same softmax and top-S over ``V'`` columns."""
    if isinstance(out, SubsetLogits):
        return out.logits, out.ids
    return out, None


def check_draft_logits(logits: torch.Tensor, B: int, width: int, K: int, support: int) -> int:
    """Check the draft's answer ``[B, width, V]`` and that K distinct slots fit; return V
    (``V'`` of a ``SubsetLogits``: the tokens it can propose)."""
    if logits.dim() != 3 or logits.shape[:2] != (B, width):
        raise ValueError(f"draft returned logits of shape {tuple(logits.shape)}, expected ({B}, {width}, V)")
    V = logits.shape[-1]
    if K > min(support, V):
        raise ValueError(f"slots={K} exceeds the draft support min(support={support}, vocab={V})")
    return V


def expand(tree: DraftTree, ctx: PassContext) -> DraftTree:
    cfg = ctx.tree_cfg
    check_can_expand(tree, ctx)
    K, m = tree.slots, tree.rheostat
    B = tree.batch
    frontiers = [select_frontier(tree, b, 1 if tree.cur_depth == 0 else cfg.frontier) for b in range(B)]
    width = max(len(f) for f in frontiers)
    nodes = torch.full((B, width), -1, dtype=torch.int64)
    for b, f in enumerate(frontiers):
        nodes[b, :len(f)] = torch.tensor(f, dtype=torch.int64)
    logits, ids = draft_columns(ctx.draft(tree, nodes))
    check_draft_logits(logits, B, width, K, cfg.support)

    t = tree.clone()
    for b, frontier in enumerate(frontiers):
        q = draft_probs(logits[b, :len(frontier)], ctx.sampling)
        sup_tok, sup_q = rank_support(q, cfg.support)
        if ids is not None:  # ranked columns of a SubsetLogits -> target ids
            sup_tok = ids.to(sup_tok.device)[sup_tok]
        n_sup = sup_tok.shape[-1]
        for j, v in enumerate(frontier):
            row = int(t.n_expanded[b])
            t.n_expanded[b] += 1
            t.expanded[b, v] = True
            t.exp_row[b, v] = row
            t.exp_node[b, row] = v
            t.sup_token[b, row, :n_sup] = sup_tok[j]
            t.sup_q[b, row, :n_sup] = sup_q[j]
            t.sup_n[b, row] = n_sup
            t.z[b, row] = float(tail_mass(sup_q[j:j + 1], m, n_sup)[0])
            base = float(t.score[b, v])
            pi = proxy_weight(ctx.tree_cfg.proxy, sup_q[j], m, n_sup) if m < K else None
            for s in range(K):
                c = int(t.n_nodes[b])
                t.n_nodes[b] += 1
                t.parent[b, c] = v
                t.depth[b, c] = tree.cur_depth + 1
                t.slot[b, c] = s
                if s < m:  # DET: the s-th best token
                    t.kind[b, c] = int(NodeKind.DET)
                    t.token[b, c] = sup_tok[j, s]
                    t.q[b, c] = sup_q[j, s]
                    t.weight[b, c] = sup_q[j, s]
                    t.score[b, c] = base + log_weight(float(sup_q[j, s]))
                elif s == m:  # SAMPLED: token drawn by assign
                    t.kind[b, c] = int(NodeKind.SAMPLED)
                    t.y_node[b, row] = c
                    if pi is not None:
                        t.weight[b, c] = pi
                        t.score[b, c] = base + log_weight(pi)
                    else:
                        t.score[b, c] = math.nan  # pending: true_q needs the token
                else:  # PAD: token chosen by assign (it skips the sampled token)
                    t.kind[b, c] = int(NodeKind.PAD)
                    t.score[b, c] = math.nan
    return t.replace(cur_depth=tree.cur_depth + 1, sup_width=n_sup)


#: the pass with its implementations: torch reference (above), numba CPU, Triton
expand_pass = builtin_pass("expand", expand,
                           numba="rheoplan.kernels.slot_expansion.cpu_pass:expand",
                           triton="rheoplan.kernels.slot_expansion.triton_pass:expand")
