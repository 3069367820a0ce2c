"""numba CPU path of the verification kernels (same signatures as ``reference``).

Sparse correction: the proposal law (``q~`` for 'rheo', ``e~`` for 'ot') is non-zero on
at most ``S`` support tokens, so the residual ``max(0, p - law)`` equals ``p`` everywhere
else. Per node the kernel writes the law at those tokens only, into a scratch ``[V]``
vector that stays zero elsewhere and is cleared again at the same tokens (O(S) set-up,
no dense law built per node); the residual mass and the Gumbel-max over the residual
are then plain passes over ``p``.

Parity: the returned tokens equal the reference's for the same injected numbers. The
float steps (tail sum, ``log``) round differently from torch's in the last bit, which
can only matter when two Gumbel keys, or ``u`` and the accept probability, agree to
~1e-16: not observed in the tests, and such draws have probability ~1e-15.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from rheoplan.kernels.verify import VERIFIER_CODES
from rheoplan.kernels.verify.reference import WalkOut

from rheoplan.distributions import RESIDUAL_EPS as _RESIDUAL_EPS  # numba reads it as a constant


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
