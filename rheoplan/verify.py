"""Reference verification (docs/method.md §5): the couplings, the walk, acceptance.

Pure torch, probabilities in float64. This module is the ground truth the kernels are
parity-tested against, and what the exact oracle (``rheoplan.testing``) enumerates.

Three layers:

* ``coupling_law``: the exact conditional law of the emitted token ``X`` at one
  expanded node, given the realised sampled token ``Y``. Averaged over
  ``Y ~ q~`` it is exactly ``p`` for every verifier (the losslessness lemma).
* ``coupling_sample``: draws from that same law with injected random numbers (one
  accept/reject uniform, then Gumbel-max over the log residual), so a kernel given the
  same numbers must return the same token.
* ``walk``: the verification walk over one linearised tree, with numbers from the
  counter-based streams (``rheoplan.rng``).

Two of the test-only lossy switches of ``rheoplan.mutation`` are read here
(``"skip_pruned_sampled"``, ``"raw_q_ratio"``); tests turn them on with
``rheoplan.testing.mutation(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rheoplan.config import SamplingConfig, VERIFIERS
from rheoplan.distributions import RESIDUAL_EPS as _RESIDUAL_EPS, greedy_tokens, tail_law, target_probs
from rheoplan.ir import DraftTree
from rheoplan.mutation import active
from rheoplan.rng import Purpose, Streams, gumbel_from_uniform



def _check_verifier(verifier: str) -> None:
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier={verifier!r} is not one of {VERIFIERS}")


def _proposal(p: torch.Tensor, sup_token: torch.Tensor, sup_q: torch.Tensor, n: int, m: int,
              raw_q: bool = False) -> torch.Tensor:
    """The proposal law of ``Y`` as a dense ``[V]`` float64 vector: ``q~`` over ranks
    ``m+1..n`` (or, with ``raw_q`` (mutation ``raw_q_ratio``), the raw draft ``q`` over the
    whole support)."""
    law = torch.zeros_like(p)
    if raw_q:
        law[sup_token[:n]] = sup_q[:n].to(torch.float64)
    else:
        law[sup_token[m:n]] = tail_law(sup_q, m, n)
    return law


def _speculative(p: torch.Tensor, law: torch.Tensor, e: int) -> tuple[float, torch.Tensor | None, float]:
    """Accept probability of proposal ``e`` against ``p`` under proposal ``law``, the
    residual ``max(0, p - law)`` and its mass (residual None when it has no mass: accept =
    1). The caller normalises (``residual / mass``) only if it needs the residual law: an
    accepted proposal does not."""
    resid = torch.clamp(p - law, min=0.0)
    mass = float(resid.sum())
    if mass <= _RESIDUAL_EPS:
        return 1.0, None, mass
    le = float(law[e])
    a = 1.0 if le <= 0.0 else min(1.0, float(p[e]) / le)
    return a, resid, mass


def _ot_proposal(law: torch.Tensor, sup_token: torch.Tensor, K: int, y: int) -> tuple[int, torch.Tensor]:
    """``E = e(Y)`` and its law ``e~`` for the 'ot' coupling (docs/method.md §5)."""
    A = sup_token[: K - 1]
    rK = int(sup_token[K - 1])
    e = rK if bool((A == y).any()) else y
    et = law.clone()
    et[rK] = law[rK] + law[A].sum()
    et[A] = 0.0
    return e, et


def _coupling_terms(p, sup_token, sup_q, sup_n, m, K, y_token, verifier):
    """(proposal token, accept probability, residual, its mass): ``X`` is the proposal with
    the accept probability, else a draw of ``residual / mass``. Proposal None: ``X ~ p``
    (residual = ``p``, mass None: already a law); residual None: accept = 1."""
    _check_verifier(verifier)
    p = p.to(torch.float64)
    if verifier == "onehot" or m >= K or y_token is None or int(y_token) < 0:
        return None, 0.0, p, None
    n = int(sup_n)
    y = int(y_token)
    law = _proposal(p, sup_token, sup_q, n, m, raw_q=active("raw_q_ratio"))
    if verifier == "rheo":
        e = y
    else:
        e, law = _ot_proposal(law, sup_token, K, y)
    a, resid, mass = _speculative(p, law, e)
    return e, a, resid, mass


def _coupling_parts(p, sup_token, sup_q, sup_n, m, K, y_token, verifier):
    """(proposal token, accept probability, residual law or None); proposal None = X ~ p."""
    e, a, resid, mass = _coupling_terms(p, sup_token, sup_q, sup_n, m, K, y_token, verifier)
    return e, a, resid if resid is None or mass is None else resid / mass


def _coupling_draw(p, sup_token, sup_q, sup_n, m, K, y_token, verifier, u_accept: float,
                   draw: Callable[[torch.Tensor], int]) -> int:
    """``coupling_sample``'s rule with the residual draw ``draw(residual law) -> token``
    called only when it is needed (a rejected or absent proposal): the walk then draws
    its residual noise only at the nodes that use it, and normalises no residual it does
    not draw from."""
    e, a, resid, mass = _coupling_terms(p, sup_token, sup_q, sup_n, m, K, y_token, verifier)
    if e is not None and (resid is None or float(u_accept) < a):
        return int(e)
    return draw(resid if mass is None else resid / mass)


def coupling_law(p: torch.Tensor, sup_token: torch.Tensor, sup_q: torch.Tensor, sup_n: int,
                 m: int, K: int, y_token: int, verifier: str) -> torch.Tensor:
    """Exact law ``[V]`` (float64) of the emitted ``X`` at an expanded node given ``Y``.

    Args:
        p: processed target law at the node, ``[V]``.
        sup_token, sup_q, sup_n: the node's ranked sparse draft support (``DraftTree``).
        m, K: rheostat and slots; ``m >= K`` means no sampled slot and ``X ~ p``.
        y_token: the realised sampled token ``Y`` (ignored by 'onehot'; -1 / None = none).
        verifier: 'onehot' (``X ~ p``), 'rheo' (test ``Y`` against ``q~``) or 'ot'
            (test ``E = e(Y)`` against ``e~``).

    Example:
        >>> p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
        >>> tok, q = torch.tensor([0, 1, 2]), torch.tensor([0.5, 0.3, 0.2])
        >>> law = coupling_law(p, tok, q, 3, 1, 2, 1, "rheo")  # q~ = [0, .6, .4]: accept w.p. 5/6
        >>> [round(x, 4) for x in law.tolist()]  # rejected mass goes to max(0, p - q~) = token 0
        [0.1667, 0.8333, 0.0]
    """
    e, a, resid = _coupling_parts(p, sup_token, sup_q, sup_n, m, K, y_token, verifier)
    if e is None:
        return resid.clone()
    out = torch.zeros_like(p, dtype=torch.float64)
    if resid is not None:
        out += (1.0 - a) * resid
    out[e] += a
    return out


def coupling_sample(p: torch.Tensor, sup_token: torch.Tensor, sup_q: torch.Tensor, sup_n: int,
                    m: int, K: int, y_token: int, verifier: str, u_accept: float,
                    residual_gumbel: torch.Tensor) -> int:
    """One draw of ``X`` from ``coupling_law`` with injected randomness.

    Accept the proposal iff ``u_accept < accept probability``; otherwise (or when there is
    no proposal, e.g. 'onehot') ``X = argmax(log residual + residual_gumbel)``, with
    ``residual_gumbel`` i.i.d. standard Gumbel ``[V]``. Kernels must match this bit for bit
    given the same ``u_accept`` and ``residual_gumbel``.
    """
    return _coupling_draw(p, sup_token, sup_q, sup_n, m, K, y_token, verifier, u_accept,
                          lambda r: int(torch.argmax(torch.log(r) + residual_gumbel.to(torch.float64))))


def node_y(tree: DraftTree, b: int, row: int) -> int:
    """The ``Y`` the verifier uses at expansion row ``row`` (-1: none / ignored).

    Phantom rule: ``Y`` is used even when its sampled child was pruned. Mutation (a),
    ``"skip_pruned_sampled"``, instead ignores ``Y`` when the sampled child was pruned.
    """
    y = int(tree.y_token[b, row])
    if y >= 0 and active("skip_pruned_sampled"):
        c = int(tree.y_node[b, row])
        if c >= 0 and not bool(tree.kept[b, c]):
            return -1
    return y


def node_law(tree: DraftTree, b: int, row: int, p: torch.Tensor, verifier: str) -> torch.Tensor:
    """``coupling_law`` at expansion row ``row`` of tree ``b`` (reads the tables of the IR)."""
    return coupling_law(p, tree.sup_token[b, row], tree.sup_q[b, row], int(tree.sup_n[b, row]),
                        tree.rheostat, tree.slots, node_y(tree, b, row), verifier)


def kept_children(tree: DraftTree, b: int, i: int) -> dict[int, int]:
    """``{token: linear index}`` of the kept children of linear node ``i``."""
    lin = tree.linear
    f, k = int(lin.first_child[b, i]), int(lin.n_children[b, i])
    if f < 0:
        return {}
    # the children are consecutive linear nodes: their tokens in one read
    return {tok: c for c, tok in enumerate(lin.token[b, f:f + k].tolist(), start=f)}


@dataclass(frozen=True)
class WalkResult:
    """Outcome of one verification walk."""

    path: list[int]  #: linear indices: root, then the accepted nodes
    nodes: list[int]  #: creation ids of the same nodes
    emitted: list[int]  #: accepted drafted tokens, then the one extra token
    visited: int  #: nodes whose target logits were read


def gumbel_max(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A draw from ``p [..., V]`` given standard Gumbel noise ``g``: ``argmax(log p + g)``
    (the node's own target sample when nothing was drafted below it)."""
    return torch.argmax(torch.log(p) + g, dim=-1)


#: relative slack of ``gumbel_max_uniform``'s filter; the keys' rounding is ~1e-13 of a
#: key, so 1e-9 keeps every possible winner (a test breaks it on purpose)
FILTER_SLACK = 1e-9


def gumbel_max_uniform(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``gumbel_max(p, gumbel_from_uniform(u))`` for ``p, u [R, V]`` (float64), taking the
    two logarithms only where a token can still win. Returns ``[R]`` int64.

    Why: the Gumbel transform costs two ``log`` per vocabulary entry, most of a root draw
    on a CPU (a batch's autoregressive rows draw ``R x V`` of them each step). The key
    ``log p_i + g_i`` of token ``i`` beats a bound ``B`` only if ``-log u_i <= p_i e^-B``,
    and ``1 - u_i <= -log u_i``, so only tokens with ``1 - u_i <= p_i e^-B`` can. ``B`` is
    the key of each row's most likely token; with ``p`` spread over ``V`` tokens a few
    pass. The keys of those are computed exactly as ``gumbel_max`` computes them, in
    token order, so the winner (first index on ties) is ``gumbel_max``'s.

    Example:
        >>> p = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
        >>> u = torch.tensor([[0.2, 0.5, 0.999]], dtype=torch.float64)
        >>> gumbel_max_uniform(p, u).tolist() == gumbel_max(p, gumbel_from_uniform(u)).tolist()
        True
    """
    top = p.argmax(dim=-1, keepdim=True)
    bound = torch.log(p.gather(-1, top)) + gumbel_from_uniform(u.gather(-1, top))
    can_win = (1.0 - u) <= p * (torch.exp(-bound) * (1.0 + FILTER_SLACK))
    can_win.scatter_(-1, top, True)
    rows, cols = can_win.nonzero(as_tuple=True)  # row-major: tokens in increasing order per row
    keys = torch.log(p[rows, cols]) + gumbel_from_uniform(u[rows, cols])
    # best key per row, first token on ties: stable sorts by key (descending) then by row
    order = torch.sort(keys, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]
    first = torch.searchsorted(rows[order], torch.arange(p.shape[0], device=p.device))
    return cols[order[first]]


def walk_roots(logits: torch.Tensor, sampling: SamplingConfig, streams: Streams, steps: Sequence[int],
               keys: Sequence[int], nodes: Sequence[int],
               draw: Callable[[torch.Tensor, list, list, list], list[int]] | None = None,
               first_max: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[int]:
    """``walk`` of R root-only trees at once (a batch's autoregressive rows): row ``r``
    emits a draw of ``target_probs(logits[r])`` with the noise ``walk`` uses at that root,
    ``streams.gumbel(steps[r], keys[r], nodes[r], VERIFY_RESIDUAL, V)``. One softmax and
    one Gumbel-max over ``[R, V]`` instead of R; the tokens are ``walk``'s. Context-free
    target laws only (no ``history`` / processors).

    ``draw(p, steps, keys, nodes)``: those rows' tokens from a faster implementation of
    the same draws (the numba kernel ``rheoplan.kernels.verify.cpu.root_draws``, which
    generates the stream as it filters, never the whole ``[R, V]`` of uniforms); default:
    ``streams.uniform`` row by row, then ``gumbel_max_uniform``. ``first_max``: greedy
    rows' pick by a faster ``max(dim=-1)`` (``greedy_tokens``)."""
    if not (len(steps) == len(keys) == len(nodes) == logits.shape[0]):
        raise ValueError(f"walk_roots: {logits.shape[0]} rows of logits for {len(steps)} steps, "
                         f"{len(keys)} keys and {len(nodes)} nodes")
    if logits.shape[0] == 0:
        return []
    if sampling.greedy:
        # the law is a one-hot on the processed scores' argmax: argmax(log p + g) is that
        # token whatever the noise, so draw none, and skip building the [R, V] one-hot
        return greedy_tokens(logits, sampling, first_max=first_max).tolist()
    p = target_probs(logits, sampling)
    steps, keys, nodes = list(steps), list(keys), list(nodes)
    if active("batch_shared_root_noise"):  # test-only: every row draws with the first row's noise
        R = len(steps)
        steps, keys, nodes = steps[:1] * R, keys[:1] * R, nodes[:1] * R
    if draw is not None:
        return list(draw(p, steps, keys, nodes))
    V = p.shape[-1]
    u = torch.stack([streams.uniform(s, k, v, Purpose.VERIFY_RESIDUAL, V) for s, k, v in zip(steps, keys, nodes)])
    return gumbel_max_uniform(p, u).tolist()


def _draw_at(tree: DraftTree, b: int, i: int, p: torch.Tensor, verifier: str, streams: Streams, step: int,
             sk: int, node_draw) -> int:
    """The token ``walk`` emits at linear node ``i`` of tree ``b`` whose target law is ``p``."""
    lin = tree.linear
    V = p.shape[-1]
    v = int(lin.node[b, i])
    row = int(lin.exp_row[b, i])

    # the residual noise (V numbers) is drawn only where a draw from p or from a
    # residual happens: an accepted proposal needs none
    def draw(r):
        u = streams.uniform(step, sk, v, Purpose.VERIFY_RESIDUAL, V)
        return int(gumbel_max_uniform(r[None], u[None])[0])

    if node_draw is not None:
        return node_draw(p, row, node_y(tree, b, row) if row >= 0 else -1, v)
    if row < 0:
        return draw(p)
    u = float(streams.uniform(step, sk, v, Purpose.VERIFY_ACCEPT, 1)[0])
    return _coupling_draw(p, tree.sup_token[b, row], tree.sup_q[b, row], int(tree.sup_n[b, row]),
                          tree.rheostat, tree.slots, node_y(tree, b, row), verifier, u, draw)


def walk(tree: DraftTree, b: int, logits_at: Callable[[int], torch.Tensor], sampling: SamplingConfig,
         verifier: str, streams: Streams, step: int, key: int | None = None,
         history: Sequence[int] | None = None, processors: Sequence = (),
         node_draw: Callable[[torch.Tensor, int, int, int], int] | None = None,
         greedy_at: Callable[[int], int | None] | None = None) -> WalkResult:
    """Verify tree ``b`` (docs/method.md §5), reading target logits only where the walk goes.

    ``logits_at(i)`` returns the raw target logits ``[V]`` at linear node ``i``; they are
    processed with ``target_probs`` (greedy: only their ``greedy_tokens``, the token the
    one-hot law would emit under every verifier, with no numbers drawn); when the law
    depends on the context (repetition penalty, ``processors``), node ``i``'s context is
    ``history`` (every token up to and including the root) followed by the path's tokens
    down to ``i``. Randomness: at node ``v`` (creation id) the accept
    uniform is ``streams.uniform(step, b, v, VERIFY_ACCEPT, 1)`` and the Gumbel noise
    ``streams.gumbel(step, b, v, VERIFY_RESIDUAL, V)`` (drawn only where the node draws a
    token: not at an accepted proposal; the streams are counter-based, so what is not
    drawn changes no other number). ``key`` replaces ``b`` in those
    counters when the tree's index in the batch is not its stream id (default: ``b``);
    the draft sampler must use the same id.

    ``node_draw(p, row, y, v) -> token``: a lowered draw at a node (``row`` its expansion
    row, -1 when nothing was drafted below it; ``y`` its ``node_y``; ``v`` its creation
    id) that reads the same stream numbers as the rule below and returns the same token
    (``rheoplan.kernels.verify.cpu.NodeDrawer``, what ``backend='numba'`` walks with).

    ``greedy_at(i) -> token or None``: greedy and context-free only, the token
    ``greedy_tokens`` gives at linear node ``i`` when the caller computed it already (a
    batch's prefetched nodes in one pass, ``rheoplan.decode``), None where it did not
    (then ``logits_at(i)`` is read as without it).

    Example (one node, nothing drafted below the root: emits one target sample):
        >>> import torch
        >>> from rheoplan import plan_tree, TreeConfig, SamplingConfig
        >>> s = SamplingConfig(temperature=0)
        >>> t = plan_tree(lambda tr, nd: torch.zeros(1, nd.shape[1], 4), [0],
        ...               tree=TreeConfig(depth=1, frontier=1, slots=2, budget=2, support=4), sampling=s)
        >>> walk(t, 0, lambda i: torch.tensor([0., 0., 3., 0.]), s, "ot", Streams(0), 0).emitted
        [2]
    """
    _check_verifier(verifier)
    if tree.linear is None:
        raise ValueError("tree has no linear form: run the linearize pass (plan_tree does)")
    lin = tree.linear
    sk = b if key is None else int(key)
    i = 0
    path, nodes, emitted = [0], [int(lin.node[b, 0])], []
    visited = 0
    needs_ids = sampling.needs_context or bool(processors)
    if needs_ids and history is None:
        raise ValueError("history is None but the target law depends on the context "
                         "(repetition_penalty != 1 or processors): pass the tokens up to the root")
    while True:
        ids = list(history) + emitted if needs_ids else None
        visited += 1
        if sampling.greedy:
            # p is a one-hot on the greedy token, and every coupling emits it, whatever was
            # proposed and whatever the numbers (an accepted proposal is that token; a
            # rejected one leaves a residual on it alone): no law, no draw, no noise
            # (test_greedy_walk_is_the_couplings_walk checks it against the couplings)
            x = None if greedy_at is None or needs_ids else greedy_at(i)
            if x is None:
                x = int(greedy_tokens(logits_at(i), sampling, ids, processors))
        else:
            x = _draw_at(tree, b, i, target_probs(logits_at(i), sampling, ids, processors), verifier,
                         streams, step, sk, node_draw)
        emitted.append(x)
        c = kept_children(tree, b, i).get(x)
        if c is None:
            return WalkResult(path, nodes, emitted, visited)
        i = c
        path.append(c)
        nodes.append(int(lin.node[b, c]))


# --------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------

def children_tokens(sup_token: torch.Tensor, m: int, K: int, n: int, y_rank: int) -> list[int]:
    """Tokens of all ``K`` children (before pruning) when ``Y`` has rank index ``y_rank``."""
    pads = [r for r in range(m, n) if r != y_rank][: K - m - 1]
    return [int(sup_token[r]) for r in list(range(m)) + [y_rank] + pads]


def accept_prob(p: torch.Tensor, sup_token: torch.Tensor, sup_q: torch.Tensor, sup_n: int,
                m: int, K: int, verifier: str) -> float:
    """P(X is a child of the node), averaged over ``Y ~ q~`` (children before pruning).

    Closed forms (``r`` the residual ``max(0, p - law)``, ``R`` its mass):

    * 'onehot': ``sum_Y q~(Y) p(children(Y))``;
    * 'rheo':   ``sum_Y q~(Y) [a(Y) + (1 - a(Y)) r(children(Y)) / R]``, ``a = min(1, p/q~)``;
    * 'ot':     ``p(A) + sum_t min(p(t), e~(t))``.

    With no sampled slot (``m >= K``) every verifier is one-hot on the top-``K``.
    """
    _check_verifier(verifier)
    p = p.to(torch.float64)
    n = int(sup_n)
    if m >= K:
        return float(p[sup_token[:K]].sum())
    qt = tail_law(sup_q, m, n)
    if verifier == "ot":
        law = _proposal(p, sup_token, sup_q, n, m)
        _, et = _ot_proposal(law, sup_token, K, int(sup_token[K - 1]))
        return float(p[sup_token[: K - 1]].sum() + torch.minimum(p, et).sum())
    total = 0.0
    law = _proposal(p, sup_token, sup_q, n, m)
    resid = torch.clamp(p - law, min=0.0)
    R = float(resid.sum())
    for i in range(n - m):
        if float(qt[i]) <= 0.0:
            continue
        ch = children_tokens(sup_token, m, K, n, m + i)
        if verifier == "onehot":
            got = float(p[ch].sum())
        else:
            y = ch[m]
            a = 1.0 if R <= _RESIDUAL_EPS else min(1.0, float(p[y]) / float(qt[i]))
            got = a + ((1.0 - a) * float(resid[ch].sum()) / R if R > _RESIDUAL_EPS else 0.0)
        total += float(qt[i]) * got
    return total
