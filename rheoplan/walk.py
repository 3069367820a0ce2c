"""The verification walk of one decode step, by backend (RHEOSAMPLING.md §5).

* ``reference`` and ``numba``: ``rheoplan.verify.walk`` on the host. Its target logits
  come either from one projection of every node (``TreeLogits.all_logits``) or from one
  projection of the likely path and then node by node at the nodes the walk visits off
  it, whichever the adapter measured cheaper (``TreeLogits.prefers_all_logits``; an
  ``HFTarget`` times its output projection once, ``rheoplan.costmodel.ProjectionTimings``).
  ``numba`` lowers each visited node's draw to ``kernels.verify.cpu.walk_node_draw``,
  which generates only the stream numbers it uses (the reference walk builds a numpy
  generator and ``V`` uniforms per draw and filters them in torch).
* ``triton``: the whole walk on the target's device. Every node's logits in one
  projection (``TreeLogits.all_logits``), the target law by ``distributions.target_probs``,
  the phantom rule as a tensor op, then the Triton walk kernel, which draws the accept
  uniforms and residual noise itself (the device Philox: the same streams as
  ``Streams``); the host receives the emitted tokens, the path and the step's
  statistics in one transfer.

All return a ``StepWalk`` with the same fields; for the same seed the tokens are equal
(``tests/rheoplan/test_backends.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rheoplan.config import SamplingConfig
from rheoplan.distributions import BROKEN_TARGET, broken_rows, greedy_tokens, target_probs
from rheoplan.ir import DraftTree
from rheoplan.kernels.argmax import first_max
from rheoplan.kernels.verify.cpu import NodeDrawer, root_draws
from rheoplan.models.base import TreeLogits
from rheoplan.mutation import active
from rheoplan.rng import Purpose, Streams
from rheoplan.verify import walk, walk_roots


@dataclass(frozen=True)
class StepWalk:
    """What one verification walk decided, on the host."""

    path: list[int]  #: linear indices: root, then the accepted nodes
    nodes: list[int]  #: creation ids of the same nodes
    emitted: list[int]  #: accepted drafted tokens, then the one extra token
    visited: int  #: nodes whose target law the walk read
    trials: int  #: path nodes with kept children (acceptance trials)
    tree_size: int  #: drafted nodes kept (root excluded)


def verify_tree(tree: DraftTree, fw, sampling: SamplingConfig, verifier: str, streams: Streams, step: int,
                backend: str, history: Sequence[int] | None = None, processors: Sequence = (),
                b: int = 0, key: int | None = None, prefetched: bool = False,
                greedy: dict[int, int] | None = None) -> StepWalk:
    """Walk tree ``b`` (default 0) of ``tree`` given ``fw`` (the target's ``TreeLogits`` of
    that tree) with ``backend``; ``key`` is the tree's stream id (default ``b``, as in
    ``rheoplan.verify.walk``). The device walk handles a one-tree batch only.

    ``history`` / ``processors``: a context-dependent target law (repetition penalty,
    logits processors; ``rheoplan.verify.walk``). The device walk runs when the backend is
    'triton', the law needs no context, and ``fw`` has ``all_logits()``; otherwise the lazy
    reference walk runs (an adapter that projects only node by node; the per-node contexts
    of a context-dependent law, which live on the host). The test-only switch
    ``raw_q_ratio`` (``rheoplan.mutation``) exists only in the reference walk, so it runs
    there too.

    ``prefetched``: the caller already projected what it wants projected (the batched loop's
    ``TargetModel.prefetch_rows``, one call for every row); the walk then reads ``fw.logits``
    node by node and projects nothing in bulk itself. ``greedy``: for a greedy,
    context-free walk, the greedy token of linear nodes the caller read already (the
    batched loop's prefetched nodes of every row in one pass); the walk reads the others.
    """
    context_free = history is None and not processors
    if backend == "triton" and tree.batch > 1:
        raise ValueError(f"backend='triton' walks one tree per call, got a batch of {tree.batch}: "
                         "allowed backend='reference' or 'numba' for batched decoding")
    if backend == "triton" and context_free and not active("raw_q_ratio") and _has_all_logits(fw):
        return _walk_device(tree, fw, sampling, verifier, streams, step, 0 if key is None else int(key))
    # the reference walk reads the tree and draws its noise on the host (a device tree of the
    # 'triton' planner comes over in one copy); logits of a GPU target come over per node
    tree = tree.to("cpu")
    # Each output projection reads the whole lm_head, so rows are projected in batches: every
    # row at once when the adapter measured that cheaper (``prefers_all_logits``), else the
    # path the walk most likely takes, then the nodes it visits off that path one by one.
    if prefetched:
        read = lambda i: fw.logits(i).cpu()  # noqa: E731
    else:
        path = likely_path(tree, b)
        if fw.prefers_all_logits(len(path)) and _has_all_logits(fw):
            read = fw.all_logits().cpu().__getitem__
        else:
            fw.prefetch(path)
            read = lambda i: fw.logits(i).cpu()  # noqa: E731
    # 'numba' (a sampled law; a greedy walk draws nothing): each visited node's draw is one
    # kernel call that makes its own noise (the reference builds a numpy generator and V
    # uniforms per draw, then filters in torch)
    draw = None
    if backend == "numba" and not sampling.greedy and not active("raw_q_ratio"):
        draw = NodeDrawer(tree, b, verifier, streams.seed, step, b if key is None else int(key),
                          streams.purpose_key(Purpose.VERIFY_ACCEPT), streams.purpose_key(Purpose.VERIFY_RESIDUAL))
    greedy_at = None if greedy is None else greedy.get
    if backend == "numba" and sampling.greedy and context_free:
        greedy_at = _greedy_reader(read, sampling, greedy or {})
    res = walk(tree, b, read, sampling, verifier, streams, step, key=key, history=history,
               processors=processors, node_draw=draw, greedy_at=greedy_at)
    lin = tree.linear
    trials = sum(1 for i in res.path if int(lin.n_children[b, i]) > 0)
    return StepWalk(list(res.path), list(res.nodes), list(res.emitted), res.visited, trials,
                    int(lin.n[b]) - 1)


def _greedy_reader(read, sampling: SamplingConfig, known: dict[int, int]):
    """``walk``'s ``greedy_at`` for the numba backend: the greedy token of linear node ``i``
    from ``known`` (read already), else from ``read(i)``'s logits by the numba scan for
    the first maximum (``kernels.argmax``: torch's max with indices took ~4x as long over
    49,152 logits), with ``greedy_tokens``' check."""
    def at(i: int) -> int:
        x = known.get(i)
        return x if x is not None else int(greedy_tokens(read(i), sampling, first_max=first_max))
    return at


def verify_roots(tree: DraftTree, fws: Sequence, rows: Sequence[int], sampling: SamplingConfig, streams: Streams,
                 steps: Sequence[int], keys: Sequence[int], backend: str = "reference") -> list[StepWalk]:
    """``verify_tree`` of trees ``rows`` of ``tree``, each only its root (nothing drafted:
    a batch's autoregressive rows), in one ``rheoplan.verify.walk_roots`` call: the same
    tokens as one ``verify_tree`` per row, for a context-free target law. ``fws[r]``,
    ``steps[r]`` and ``keys[r]`` belong to tree ``rows[r]``.

    ``backend`` other than 'reference': the rows draw in one numba call that generates
    each row's stream as it reads it (``rheoplan.kernels.verify.cpu.root_draws``); greedy
    rows take their tokens from the numba scan (``rheoplan.kernels.argmax``)."""
    lin = tree.linear
    if not rows:
        return []
    sel = torch.as_tensor(list(rows), dtype=torch.int64, device=lin.n.device)
    sizes, nodes = lin.n[sel].tolist(), lin.node[sel, 0].tolist()  # one host read each, not per row
    for b, n in zip(rows, sizes):
        if n != 1:
            raise ValueError(f"verify_roots: tree {b} has {n} linear nodes: allowed 1 (the root)")
    logits = torch.stack([fw.logits(0).cpu() for fw in fws])

    def kernel_draw(p, steps, keys, nodes):
        return root_draws(p, streams.seed, steps, keys, nodes, streams.purpose_key(Purpose.VERIFY_RESIDUAL))

    fast = backend != "reference"
    tokens = walk_roots(logits, sampling, streams, steps, keys, nodes, kernel_draw if fast else None,
                        first_max if fast else None)
    return [StepWalk([0], [v], [x], 1, 0, 0) for v, x in zip(nodes, tokens)]


def likely_path(tree: DraftTree, b: int = 0) -> list[int]:
    """Linear indices of the walk's most likely route: from the root, always the kept
    child with the best score (the first kept child: DET rank 1 when ``m >= 1``).

    Example: a chain root -> 1 -> 3 with 2 a sibling of 1 gives [0, 1, 3].
    """
    lin = tree.linear
    # the rows as lists: one read each instead of a tensor index per visited entry (the walk
    # runs right after the verify forward, where each of those costs a few microseconds)
    n_children, first_child = lin.n_children[b].tolist(), lin.first_child[b].tolist()
    node, score = lin.node[b].tolist(), tree.score[b].tolist()
    out, i = [0], 0
    while n_children[i] > 0:
        first = first_child[i]
        i = max(range(first, first + n_children[i]), key=lambda c: (score[node[c]], -c))
        out.append(i)
    return out


def _has_all_logits(fw) -> bool:
    impl = getattr(type(fw), "all_logits", None)
    return impl is not None and impl is not TreeLogits.all_logits


def phantom_y(tree: DraftTree) -> torch.Tensor:
    """``y_token [B, E]`` as the verifier uses it (``rheoplan.verify.node_y`` for every row):
    ``Y`` even when its sampled child was pruned; the test-only switch
    ``skip_pruned_sampled`` drops it then."""
    y = tree.y_token
    if active("skip_pruned_sampled"):
        c = tree.y_node
        pruned = (c >= 0) & ~tree.kept.gather(1, c.clamp(min=0))
        y = torch.where((y >= 0) & pruned, -1, y)
    return y


def _walk_device(tree, fw, sampling, verifier, streams, step, key: int = 0) -> StepWalk:
    from rheoplan.kernels.verify.triton import WalkNoise, verify_walk

    lin = tree.linear
    L = lin.token.shape[1]
    logits = fw.all_logits()  # [n, V], n <= L real nodes
    dev = lin.token.device
    logits = logits.to(dev)
    V = logits.shape[-1]
    bad = broken_rows(logits)  # sent to the host with the tokens, not synced here
    if logits.shape[0] < L:  # padding rows are never visited; zeros keep them finite
        logits = torch.cat([logits, logits.new_zeros(L - logits.shape[0], V)])
    # a broken output is reported after the walk (with its tokens, no extra sync); until
    # then the kernels get a finite stand-in law
    p = torch.where(bad, 1.0 / V, target_probs(logits, sampling, check=False))
    # the walk draws its accept uniforms and residual noise in the kernel, from the very
    # streams rheoplan.verify.walk reads: no [L, V] noise tensor, no extra launch
    noise = WalkNoise(streams.seed, step, lin.node, torch.full((1,), key, dtype=torch.int64, device=dev),
                      streams.purpose_key(Purpose.VERIFY_ACCEPT), streams.purpose_key(Purpose.VERIFY_RESIDUAL))
    out = verify_walk(p[None], None, None, lin.token, lin.first_child, lin.n_children, lin.exp_row,
                      tree.sup_token, tree.sup_q, tree.sup_n, phantom_y(tree), tree.rheostat,
                      tree.slots, verifier, noise=noise)
    path = out.path[0]
    on = path >= 0
    safe = path.clamp(min=0)
    nodes = torch.where(on, lin.node[0].gather(0, safe), -1)
    trial = (on & (lin.n_children[0].gather(0, safe) > 0)).sum()
    # the one device-to-host transfer of the walk
    head = torch.stack([out.n_emitted[0], lin.n[0], trial, bad.to(torch.int64)])
    host = torch.cat([head, out.emitted[0], path, nodes]).tolist()
    k, n, trials, broken = host[:4]
    if broken:
        raise ValueError(BROKEN_TARGET)
    emitted = host[4:4 + k]
    path_h = host[4 + L:4 + L + k]
    nodes_h = host[4 + 2 * L:4 + 2 * L + k]
    return StepWalk(path_h, nodes_h, emitted, k, trials, n - 1)
