"""numba CPU path of the slot-expansion kernel (same signature as ``reference``).

Split into row kernels that the numba passes (``cpu_pass.py``) also call:

* ``rank_support_rows``: top-S by q (ties lower id) by radix select on the float32
  bits, O(V) per row instead of a full sort; it counts the broken rows (NaN laws) as it
  goes, the check ``distributions.draft_probs`` makes.
* ``proxy_weight``: ``planner.expand.proxy_weights`` for one row, a port pinned to it
  by ``tests/kernels/slot_expansion/test_slot_expansion_parity.py`` (a min or a copy of
  float64 values: the same bits), so the numba ``expand`` writes a row's slots without
  torch ops between its kernels.
* tail mass: not ported; its one definition (``distributions.tail_mass``).
* ``tail_draws``: the sampled slot's draw straight from its Philox stream; its tail law
  divides by the torch tail mass as ``distributions.tail_law_rows`` does (a division
  rounds the same everywhere: the same bits).
* ``fill_children_rows``: child tokens / q / weights given the drawn tail index.

Three steps deliberately stay in torch, because the reference computes them with
torch's vectorised (SLEEF) ``exp``/``log`` and the pipeline must be bit-identical:
the draft softmax, ``log(q~) + noise`` before the Gumbel argmax of ``slot_expansion``
(whose noise is injected), and the scores ``parent_score + log(weight)``. numba's
``log`` is glibc's, which differs from SLEEF in the last bit for ~0.1% of float32
inputs. The numba ``assign`` pass draws its sampled slots with ``tail_draws`` instead:
only the winner leaves it, which a last-bit difference changes only at a ~1e-16 tie of
two keys (``kernels.gumbel``).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from rheoplan.distributions import tail_law_rows, tail_mass
from rheoplan.kernels.gumbel import NO_LAW, gumbel_max_stream
from rheoplan.kernels.slot_expansion.reference import SlotExpansion, check_args
from rheoplan.planner.expand import add_log_weight, proxy_weights  # noqa: F401  (re-exported)


@njit(cache=True, inline="always")
def _worse(qa, ia, qb, ib):
    """Whether support entry a ranks below b (lower q, or equal q and higher id)."""
    return qa < qb or (qa == qb and ia > ib)


@njit(cache=True)
def _sift_down(hq, hi, start, size):
    i = start
    while True:
        l = 2 * i + 1
        if l >= size:
            return
        w = l
        r = l + 1
        if r < size and _worse(hq[r], hi[r], hq[l], hi[l]):
            w = r
        if _worse(hq[w], hi[w], hq[i], hi[i]):
            hq[i], hq[w] = hq[w], hq[i]
            hi[i], hi[w] = hi[w], hi[i]
            i = w
        else:
            return


@njit(cache=True)
def _heap_topk(cq, cid, c, s, tok, val):
    """Top-``s`` of candidates ``(cq[:c], cid[:c])`` (ids ascending) with a size-s heap."""
    hq = np.empty(s, dtype=np.float32)  # min-heap whose root is the worst kept entry
    hi = np.empty(s, dtype=np.int64)
    for i in range(s):
        hq[i] = cq[i]
        hi[i] = cid[i]
    for i in range(s // 2 - 1, -1, -1):
        _sift_down(hq, hi, i, s)
    for i in range(s, c):
        if cq[i] > hq[0]:  # ids arrive ascending, so an equal q never beats a kept entry
            hq[0] = cq[i]
            hi[0] = cid[i]
            _sift_down(hq, hi, 0, s)
    size = s
    while size > 0:  # pop worst first, fill from the back
        size -= 1
        tok[size] = hi[0]
        val[size] = hq[0]
        hq[0] = hq[size]
        hi[0] = hi[size]
        _sift_down(hq, hi, 0, size)


_RADIX_SHIFT = 19  # 4096 bins over the top 12 bits of a non-negative float32


@njit(cache=True)
def rank_support_rows(q, s, tok, val):
    """Top-``s`` of each row of ``q [R, V]`` (float32, >= 0) into ``tok [R, s]`` / ``val``,
    ranked by q descending, ties lower id (as ``rheoplan.distributions.rank_support``).
    Returns how many rows are broken (``q[r, 0]`` NaN: a NaN law, the test of
    ``distributions.draft_probs``); those rows are left unranked.

    Radix select: a histogram of the top 12 bits of the float32 bit patterns (monotone
    for q >= 0) finds the bin holding the s-th largest value; only entries in that bin
    or above are candidates (usually a few hundred), ordered by a stable sort on -q
    (ids ascending on ties). Near-flat rows put most of V in one bin: then a size-s
    heap over the candidates, O(c log s), replaces the sort.
    """
    V = q.shape[1]
    hist = np.zeros(1 << (31 - _RADIX_SHIFT), dtype=np.int64)
    cid = np.empty(V, dtype=np.int64)
    cq = np.empty(V, dtype=np.float32)
    broken = 0
    for r in range(q.shape[0]):
        row = q[r]
        if V and np.isnan(row[0]):
            broken += 1
            continue
        bits = row.view(np.int32)
        hist[:] = 0
        for i in range(V):
            hist[max(bits[i] >> _RADIX_SHIFT, 0)] += 1
        acc = 0
        t = hist.shape[0] - 1
        while t > 0:
            acc += hist[t]
            if acc >= s:
                break
            t -= 1
        c = 0
        for i in range(V):
            if (bits[i] >> _RADIX_SHIFT) >= t:
                cid[c] = i
                cq[c] = row[i]
                c += 1
        if c > 8 * s:
            _heap_topk(cq, cid, c, s, tok[r], val[r])
            continue
        order = np.argsort(-cq[:c], kind="mergesort")  # stable: lower id first on ties
        for j in range(s):
            tok[r, j] = cid[order[j]]
            val[r, j] = cq[order[j]]
    return broken


@njit(cache=True, inline="always")
def proxy_weight(code, sup_q, z, m):
    """``planner.expand.proxy_weights`` of one row (``code``: ``config.PROXY_CODES[policy]``;
    ``sup_q`` the row's ranked support, float32; ``z`` its tail mass, float64): the same
    float64 value, NaN for ``true_q``. ``torch.minimum`` propagates a NaN, as this does."""
    if code == 0:
        if m == 0:
            return np.float64(sup_q[0])
        a = np.float64(sup_q[m - 1])
        if np.isnan(a) or np.isnan(z):
            return np.nan
        return min(a, z)
    if code == 1:
        return np.float64(sup_q[m])
    return np.nan


@njit(cache=True)
def fill_children_rows(sup_tok, sup_q, s, m, K, y_rank, pi, child_token, child_q, child_weight):
    """Children of each row: DET ranks 0..m-1, then (m < K) the sampled rank ``y_rank[r]``
    with weight ``pi[r]`` (its own q when pi is NaN), then PAD: tail ranks skipping Y."""
    for r in range(sup_tok.shape[0]):
        c = 0
        for k in range(min(m, K)):
            child_token[r, c] = sup_tok[r, k]
            child_q[r, c] = sup_q[r, k]
            child_weight[r, c] = sup_q[r, k]
            c += 1
        if m < K:
            y = y_rank[r]
            child_token[r, c] = sup_tok[r, y]
            child_q[r, c] = sup_q[r, y]
            child_weight[r, c] = sup_q[r, y] if np.isnan(pi[r]) else np.float32(pi[r])
            c += 1
            k = m
            while c < K:
                if k != y:
                    child_token[r, c] = sup_tok[r, k]
                    child_q[r, c] = sup_q[r, k]
                    child_weight[r, c] = sup_q[r, k]
                    c += 1
                k += 1


@njit(cache=True, inline="always")
def tail_draw_row(sup_q, m, nt, z, k0, c1, c2, c3, qt, buf):
    """One row's draw: ``q~ = tail_law_rows`` of its ranked support ``sup_q`` (tail mass
    ``z``; the same divisions, so the same bits) into ``qt [>= nt]``, then its Gumbel-max
    draw with the stream of counter words ``(0, c1, c2, c3)``. Returns the tail index;
    ``qt`` holds its law (``buf``: 4 uint64 of scratch)."""
    for j in range(nt):
        qt[j] = np.float64(sup_q[m + j]) / z if z > 0.0 else 1.0 / max(nt, 1)
    return gumbel_max_stream(qt[:nt], NO_LAW, 1.0, k0, c1, c2, c3, buf, -1)


@njit(cache=True)
def _tail_draws_kernel(sup_q, m, nt, z, k0, counters, out_i, out_qt):
    """Row ``r``: ``tail_draw_row`` with the stream of counter row ``r``."""
    buf = np.empty(4, dtype=np.uint64)
    qt = np.empty(nt)
    for r in range(sup_q.shape[0]):
        i = tail_draw_row(sup_q[r], m, nt, z[r], k0, counters[r, 1], counters[r, 2], counters[r, 3], qt, buf)
        out_i[r] = i
        out_qt[r] = qt[i]


def tail_draws(sup_q: torch.Tensor, m: int, n_tail: int, seed: int, counters: np.ndarray,
               z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled slot of every row of ``sup_q [R, S]`` (float32, ranks ``m..m+n_tail-1``
    its tail): ``(tail index [R] int64, q~ of it [R] float64)``, drawn as the reference
    sampler draws, ``argmax(log q~ + gumbel_from_uniform(u))`` with ``u`` the first
    ``n_tail`` numbers of ``Streams(seed)`` at counter row ``r`` of ``counters [R, 4]``
    (``kernels.noise.counter_rows``). One numba call instead of the tail law, the noise,
    the log, the argmax and the gather as torch ops: 0.09 against 0.20 ms per depth for
    1-9 rows on the AMX Xeon (docs/results.md, "Lean steps, nineteenth round"). The tail
    mass is ``distributions.tail_mass`` (its one definition: the torch sum's bits); ``z``:
    the caller's ``tail_mass(sup_q, m, m + n_tail)``, when it has it."""
    R = sup_q.shape[0]
    z = (tail_mass(sup_q, m, m + n_tail) if z is None else z).numpy()
    out_i = np.empty(R, dtype=np.int64)
    out_qt = np.empty(R, dtype=np.float64)
    _tail_draws_kernel(sup_q.detach().cpu().contiguous().numpy(), int(m), int(n_tail), z, np.uint64(seed),
                       counters, out_i, out_qt)
    return torch.from_numpy(out_i), torch.from_numpy(out_qt)


def draw_tail(qt: torch.Tensor, noise: torch.Tensor, n_tail: int) -> torch.Tensor:
    """Gumbel-max tail index per row: ``argmax(log(q~) + noise)`` (torch, see module doc)."""
    return torch.argmax(torch.log(qt[:, :n_tail]) + noise[:, :n_tail].to(torch.float64), dim=1)


def slot_expansion(logits: torch.Tensor, parent_score: torch.Tensor, noise: torch.Tensor, *,
                   temperature: float, support: int, rheostat: int, slots: int,
                   proxy: str = "default") -> SlotExpansion:
    """Same contract as ``reference.slot_expansion`` (numba row kernels + torch exp/log)."""
    check_args(logits, parent_score, noise, support, rheostat, slots, proxy)
    m, K = rheostat, slots
    q = torch.softmax(logits.to(torch.float32) / temperature, dim=-1).contiguous()
    n, V = q.shape
    s = min(support, V)
    sup_token = torch.empty(n, s, dtype=torch.int64)
    sup_q = torch.empty(n, s, dtype=torch.float32)
    rank_support_rows(q.numpy(), s, sup_token.numpy(), sup_q.numpy())
    z64 = tail_mass(sup_q, m, s).numpy()
    # the proxy and the tail law: their one definitions (torch, vectorised over rows)
    pi = proxy_weights(proxy, sup_q, torch.from_numpy(z64), m).numpy() if m < K else np.full(n, np.nan)
    qt = tail_law_rows(sup_q, m, s) if m < K else torch.zeros(n, 1, dtype=torch.float64)
    y_rank = torch.full((n,), -1, dtype=torch.int64)
    y_token = torch.full((n,), -1, dtype=torch.int64)
    y_qtilde = torch.zeros(n, dtype=torch.float32)
    if m < K and n > 0:
        i = draw_tail(qt, noise, s - m)
        y_rank = i + m
        y_token = sup_token.gather(1, y_rank[:, None])[:, 0]
        y_qtilde = qt.gather(1, i[:, None])[:, 0].to(torch.float32)
    child_token = torch.full((n, K), -1, dtype=torch.int64)
    child_q = torch.zeros(n, K, dtype=torch.float32)
    child_weight = torch.zeros(n, K, dtype=torch.float32)
    fill_children_rows(sup_token.numpy(), sup_q.numpy(), s, m, K, y_rank.numpy(), pi,
                       child_token.numpy(), child_q.numpy(), child_weight.numpy())
    child_score = add_log_weight(parent_score.to(torch.float32)[:, None].expand(n, K), child_weight)
    return SlotExpansion(sup_token, sup_q, torch.full((n,), s, dtype=torch.int64),
                         torch.from_numpy(z64).to(torch.float32), y_rank, y_token, y_qtilde,
                         child_token, child_q, child_weight, child_score)
