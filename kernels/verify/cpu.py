"""numba CPU path of the verification kernels (same signatures as ``reference``).

Sparse correction: the proposal law (``q~`` for 'rheo', ``e~`` for 'ot') is non-zero on
at most ``S`` support tokens, so the residual ``max(0, p - law)`` equals ``p`` everywhere
else. Per node the kernel writes the law at those tokens only, into a scratch ``[V]``
vector that stays zero elsewhere and is cleared again at the same tokens (O(S) set-up,
no dense law built per node); the residual mass and the Gumbel-max over the residual
are then plain passes over ``p``. The walk's per-node draw (``walk_node_draw``) makes
those passes only where the proposal is rejected: an accepted node reads ``p`` at the
support alone.

Parity: the returned tokens equal the reference's for the same injected numbers. The
float steps (tail sum, ``log``) round differently from torch's in the last bit, which
can only matter when two Gumbel keys, or ``u`` and the accept probability, agree to
~1e-16: not observed in the tests, and such draws have probability ~1e-15.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from rheoplan.kernels import parallel
from rheoplan.kernels.noise import counter_rows
from rheoplan.kernels.gumbel import NO_LAW, gumbel_max_stream, gumbel_max_stream_split, stream_at
from rheoplan.kernels.verify import VERIFIER_CODES
from rheoplan.kernels.verify.reference import WalkOut

from rheoplan.distributions import RESIDUAL_EPS as _RESIDUAL_EPS  # numba reads it as a constant
from rheoplan.rng import philox_counter


@njit(cache=True)
def _write_proposal(sup_token, sup_q, n, m, K, y, code, law):
    """Write the proposal law (``q~`` for 'rheo', ``e~`` for 'ot') into the zeroed scratch
    ``law`` at the support's tokens; returns the proposal ``E`` (``Y``, or ``e(Y)``)."""
    z = 0.0
    for i in range(m, n):
        z += np.float64(sup_q[i])
    for i in range(m, n):  # q~ on the tail ranks
        law[sup_token[i]] = np.float64(sup_q[i]) / z if z > 0 else 1.0 / (n - m)
    e = y
    if code == 2:  # ot: E = e(Y), e~ moves the mass of A = r_1..r_{K-1} onto r_K
        rK = sup_token[K - 1]
        extra = 0.0
        for i in range(K - 1):
            if sup_token[i] == y:
                e = rK
            extra += law[sup_token[i]]
        law[rK] = law[rK] + extra
        for i in range(K - 1):
            law[sup_token[i]] = 0.0
    return e


@njit(cache=True)
def _coupling_one(p, sup_token, sup_q, n, m, K, y, code, u, g, law):
    """One draw of X (see ``rheoplan.verify.coupling_sample``). ``law`` is a zeroed
    ``[V]`` scratch vector, returned zeroed."""
    V = p.shape[0]
    if code == 0 or m >= K or y < 0:
        best, arg = -np.inf, 0
        for t in range(V):
            key = np.log(p[t]) + g[t]
            if key > best:
                best, arg = key, t
        return arg
    e = _write_proposal(sup_token, sup_q, n, m, K, y, code, law)
    mass = 0.0
    for t in range(V):  # dense pass; the sparse part is where law != 0
        r = p[t] - law[t]
        if r > 0:
            mass += r
    le = law[e]
    if mass <= _RESIDUAL_EPS:
        a = 1.0
    else:
        a = 1.0 if le <= 0.0 else min(1.0, p[e] / le)
    accept = mass <= _RESIDUAL_EPS or u < a
    arg = e
    if not accept:
        best = -np.inf
        arg = 0
        for t in range(V):
            r = p[t] - law[t]
            key = np.log((r if r > 0 else 0.0) / mass) + g[t]
            if key > best:
                best, arg = key, t
    for i in range(m, n):
        law[sup_token[i]] = 0.0
    return arg


@njit(cache=True)
def coupling_rows_kernel(p, sup_token, sup_q, sup_n, m, K, y_token, code, u, g, out):
    law = np.zeros(p.shape[1])
    for j in range(p.shape[0]):
        out[j] = _coupling_one(p[j], sup_token[j], sup_q[j], sup_n[j], m, K, y_token[j], code, u[j], g[j], law)


@njit(cache=True)
def walk_kernel(p, u, g, token, first_child, n_children, exp_row, sup_token, sup_q, sup_n, y_token,
                m, K, code, emitted, n_emitted, path):
    law = np.zeros(p.shape[2])
    for b in range(p.shape[0]):
        i, k = 0, 0
        while True:
            path[b, k] = i
            row = exp_row[b, i]
            if row < 0:
                x = _coupling_one(p[b, i], sup_token[b, 0], sup_q[b, 0], 0, 0, 0, -1, 0, 0.0, g[b, i], law)
            else:
                x = _coupling_one(p[b, i], sup_token[b, row], sup_q[b, row], sup_n[b, row], m, K,
                                  y_token[b, row], code, u[b, i], g[b, i], law)
            emitted[b, k] = x
            k += 1
            nxt = -1
            f = first_child[b, i]
            if f >= 0:
                for c in range(f, f + n_children[b, i]):
                    if token[b, c] == x:
                        nxt = c
                        break
            if nxt < 0:
                break
            i = nxt
        n_emitted[b] = k


# -- the walk's per-node draw with its own noise (what ``backend='numba'`` walks with) --------


@njit(cache=True)
def _mass_certain(p, law, sup_token, n):
    """True when the residual ``max(0, p - law)`` certainly has mass above ``RESIDUAL_EPS``,
    read from the ``n`` support tokens alone (where ``law`` may be non-zero): one of them
    keeps a residual above it (the mass, a sum of non-negative terms, is at least each
    term), or the tokens outside the support hold more than 1e-6 of ``p`` (a law sums to 1
    to ~1e-12 in float64; a token listed twice only lowers that estimate). False: the
    caller sums the residual over ``V`` (``_mass_and_top``)."""
    inside = 0.0
    for i in range(n):
        t = sup_token[i]
        if p[t] - law[t] > _RESIDUAL_EPS:
            return True
        inside += p[t]
    return 1.0 - inside > 1e-6


@njit(cache=True)
def _mass_and_top(p, law):
    """One pass over ``V``: the residual's mass (``rheoplan.verify._speculative``'s) and its
    most likely token (the first maximum), the bound ``gumbel_max_stream`` screens with (the
    same winner as its own search over the scaled residual: any token's key is a valid
    bound)."""
    mass, top, rtop = 0.0, -1, 0.0
    for t in range(p.shape[0]):
        r = p[t] - law[t]
        if r > 0.0:
            mass += r
            if r > rtop:
                top, rtop = t, r
    return mass, top


@njit(cache=True)
def walk_node_draw(p, sup_token, sup_q, n, m, K, y, code, k0, acc, res, law, chunks=1):
    """The emitted token at one node (``rheoplan.verify._coupling_draw`` with the walk's
    streams): the accept uniform is number 0 of counter ``acc``, the residual noise the
    first ``V`` numbers of counter ``res``; neither is generated where it is not used.
    ``p`` is the target law (it sums to 1); ``law`` a zeroed ``[V]`` scratch vector,
    returned zeroed.

    An accepted proposal reads ``p`` at the support only: whether the residual has mass is
    decided there when it can be (``_mass_certain``, nearly always), and its mass and most
    likely token are summed over ``V`` only when the proposal is rejected (0.06 ms a pass
    over 49152 tokens on the Zen 5 EPYC; an accepted node took that pass for nothing).
    ``chunks``: a draw splits the stream into that many ranges on numba's threads
    (``gumbel_max_stream_split``: the serial draw's token for any count; ``NodeDrawer``
    passes ``parallel.threads()`` and launches it with ``parallel.launch``). A count
    argument, not ``numba.get_num_threads()`` inside, which would keep numba from caching
    the compiled function."""
    buf = np.empty(4, dtype=np.uint64)
    if code == 0 or m >= K or y < 0:  # no proposal: X ~ p
        return gumbel_max_stream_split(p, NO_LAW, 1.0, k0, res[1], res[2], res[3], buf, -1, chunks)
    e = _write_proposal(sup_token, sup_q, n, m, K, y, code, law)
    certain = _mass_certain(p, law, sup_token, n)
    mass, top = (0.0, -1) if certain else _mass_and_top(p, law)
    x = e
    if certain or mass > _RESIDUAL_EPS:
        le = law[e]
        a = 1.0 if le <= 0.0 else min(1.0, p[e] / le)
        if not stream_at(k0, acc[1], acc[2], acc[3], 0, buf) < a:
            if certain:
                mass, top = _mass_and_top(p, law)
            x = gumbel_max_stream_split(p, law, mass, k0, res[1], res[2], res[3], buf, top, chunks)
    for i in range(n):  # every entry written above is a support token
        law[sup_token[i]] = 0.0
    return x


@njit(cache=True, parallel=True)
def _root_draws_kernel(p, top, k0, counters, out):
    """``out[r]``: X ~ ``p[r]`` (most likely token ``top[r]``) with the residual stream of
    counter row ``r``, as ``walk_node_draw`` draws at a node with nothing drafted below it.
    Rows are independent (each reads only its own stream), so they run on the threads
    (``kernels.parallel``): the same tokens in any order."""
    for r in prange(p.shape[0]):
        buf = np.empty(4, dtype=np.uint64)
        out[r] = gumbel_max_stream(p[r], NO_LAW, 1.0, k0, counters[r, 1], counters[r, 2], counters[r, 3], buf,
                                    top[r])


def root_draws(p: torch.Tensor, seed: int, steps, keys, nodes, residual: int) -> list[int]:
    """``rheoplan.verify.walk_roots``' tokens (its ``draw``): row ``r`` draws from ``p[r]``
    (``[R, V]``) with the stream ``Streams(seed)`` gives ``(steps[r], keys[r], nodes[r])``
    (``residual``: the purpose's counter word, ``Streams.purpose_key``), its numbers made
    block by block as the filter reads them and never stored: the ``[R, V]`` uniforms and
    the filter's torch passes over them took 3.25 ms for 4 rows x 49152 tokens on the AMX
    Xeon, this 2.0-2.1 (docs/results.md, "Lean steps, eighteenth round"). Same tokens as the
    reference (the last-bit caveat of this module's docstring)."""
    pn = _f64(p)
    out = np.empty(pn.shape[0], dtype=np.int64)
    parallel.launch(_root_draws_kernel, pn, p.argmax(dim=-1).cpu().numpy(), np.uint64(seed),
                    counter_rows(steps, keys, nodes, residual), out)
    return out.tolist()


_NO_TOKENS, _NO_PROBS = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)


class NodeDrawer:
    """``rheoplan.verify.walk``'s ``node_draw`` for tree ``b``: the token at a visited node,
    drawn by ``walk_node_draw`` from the counter-based streams the reference walk reads
    (``Streams(seed)``, step ``step``, stream id ``key``; ``accept`` / ``residual`` the
    purposes' counter words, ``Streams.purpose_key``). The same tokens as the reference for
    the same seed (the last-bit caveat of this module's docstring)."""

    def __init__(self, tree, b: int, verifier: str, seed: int, step: int, key: int, accept: int, residual: int):
        self.sup_token = _i64(tree.sup_token[b])
        self.sup_q = tree.sup_q[b].detach().cpu().float().contiguous().numpy()
        self.sup_n = _i64(tree.sup_n[b])
        self.m, self.K, self.code = int(tree.rheostat), int(tree.slots), VERIFIER_CODES[verifier]
        self.seed, self.step, self.key = int(seed), int(step), int(key)
        self.accept, self.residual = int(accept), int(residual)
        self.law = None

    def _counter(self, node: int, purpose: int) -> np.ndarray:
        return np.array(philox_counter(self.step, self.key, node, purpose), dtype=np.uint64)

    def __call__(self, p: torch.Tensor, row: int, y: int, node: int) -> int:
        """Token at linear node with creation id ``node``, target law ``p [V]`` (float64),
        expansion row ``row`` (-1: nothing drafted below it) and sampled token ``y``."""
        pn = _f64(p)
        if self.law is None or self.law.shape[0] != pn.shape[0]:
            self.law = np.zeros(pn.shape[0])
        if row < 0:  # nothing drafted below the node: X ~ p, no support read
            n, y = 0, -1
            tok, q = _NO_TOKENS, _NO_PROBS
        else:
            n, tok, q = int(self.sup_n[row]), self.sup_token[row], self.sup_q[row]
        # launched as a parallel kernel: its draw splits the vocabulary over the threads
        return int(parallel.launch(walk_node_draw, pn, tok, q, n, self.m, self.K, int(y), self.code,
                                   np.uint64(self.seed), self._counter(node, self.accept),
                                   self._counter(node, self.residual), self.law, parallel.threads()))


def _f64(x):
    return x.detach().to(device="cpu", dtype=torch.float64).contiguous().numpy()


def _i64(x):
    return x.detach().to(device="cpu", dtype=torch.int64).contiguous().numpy()


def coupling_rows(p, sup_token, sup_q, sup_n, m, K, y_token, verifier, u_accept, gumbel) -> torch.Tensor:
    """Same contract as ``reference.coupling_rows``."""
    out = np.empty(p.shape[0], dtype=np.int64)
    coupling_rows_kernel(_f64(p), _i64(sup_token), sup_q.detach().cpu().float().contiguous().numpy(),
                         _i64(sup_n), int(m), int(K), _i64(y_token), VERIFIER_CODES[verifier],
                         _f64(u_accept), _f64(gumbel), out)
    return torch.from_numpy(out)


def verify_walk(p, u_accept, gumbel, token, first_child, n_children, exp_row, sup_token, sup_q, sup_n,
                y_token, m, K, verifier) -> WalkOut:
    """Same contract as ``reference.verify_walk``."""
    B, L, _ = p.shape
    emitted = np.full((B, L), -1, dtype=np.int64)
    path = np.full((B, L), -1, dtype=np.int64)
    n_emitted = np.zeros(B, dtype=np.int64)
    walk_kernel(_f64(p), _f64(u_accept), _f64(gumbel), _i64(token), _i64(first_child), _i64(n_children),
                _i64(exp_row), _i64(sup_token), sup_q.detach().cpu().float().contiguous().numpy(), _i64(sup_n),
                _i64(y_token), int(m), int(K), VERIFIER_CODES[verifier], emitted, n_emitted, path)
    return WalkOut(torch.from_numpy(emitted), torch.from_numpy(n_emitted), torch.from_numpy(path))
