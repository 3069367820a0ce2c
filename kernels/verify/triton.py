"""Triton verification kernels (same signatures as ``reference``).

``coupling_kernel``: one program per node. ``walk_kernel``: one program per tree, the
whole verification walk (root to the first rejection) given the target law at every
linear node, writing emitted tokens and the accepted path.

Per node (``_coupling``): the proposal law lives on the <= S support tokens only, kept
as a register vector over support ranks; it is scattered into a zeroed ``[V]`` scratch
row (cleared again afterwards), so the residual ``max(0, p - law)`` and its mass are one
blocked pass over V and the residual draw is a blocked Gumbel-max (running best; the
first index wins ties, as ``torch.argmax``).

Parity: emitted tokens and paths equal the reference's for the same injected numbers
(``log`` rounding can only matter at exact near-ties of two Gumbel keys, ~1e-16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rheoplan.kernels.philox_triton import philox_gumbel, philox_uniform
from rheoplan.kernels.verify import VERIFIER_CODES
from rheoplan.kernels.verify.reference import WalkOut


@triton.jit
def _gumbel_argmax(p_ptr, g_ptr, law_ptr, mass, V, USE_LAW: tl.constexpr, BLOCK: tl.constexpr,
                   NOISE: tl.constexpr, seed, step, sk, w3):
    """argmax_t log(max(0, p_t - law_t) / mass) + g_t (or log p_t + g_t), first index on ties.
    NOISE: g_t is drawn in the kernel from stream (seed, [0, step, sk, w3]) instead of read."""
    # loop-carried values get their final types up front (compiled Triton requires it)
    best = tl.full((), float("-inf"), tl.float64)
    arg = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        t = start + tl.arange(0, BLOCK)
        ok = t < V
        p = tl.load(p_ptr + t, mask=ok, other=0.0).to(tl.float64)  # native dtype in memory
        if NOISE:
            g = philox_gumbel(seed, step, sk, w3, t.to(tl.int64))
        else:
            g = tl.load(g_ptr + t, mask=ok, other=0.0).to(tl.float64)
        if USE_LAW:
            r = p - tl.load(law_ptr + t, mask=ok, other=0.0)
            key = tl.log(tl.maximum(r, 0.0) / mass) + g
        else:
            key = tl.log(p) + g
        key = tl.where(ok, key.to(tl.float64), float("-inf"))
        bmax = tl.max(key, axis=0)
        barg = start + tl.argmax(key, axis=0)
        take = bmax > best
        arg = tl.where(take, barg, arg)
        best = tl.where(take, bmax, best)
    return arg


@triton.jit
def _coupling(p_ptr, g_ptr, law_ptr, tok_ptr, q_ptr, n, y, u, V, M: tl.constexpr, K: tl.constexpr,
              CODE: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK: tl.constexpr, NOISE: tl.constexpr, seed, step,
              sk, w3):
    """X at one node (``rheoplan.verify.coupling_sample``); ``law_ptr`` a zeroed [V] row."""
    if CODE == 0 or M >= K:
        x = _gumbel_argmax(p_ptr, g_ptr, law_ptr, 1.0, V, False, BLOCK, NOISE, seed, step, sk, w3).to(tl.int64)
    else:
        si = tl.arange(0, S_BLOCK)
        ins = si < n
        stok = tl.load(tok_ptr + si, mask=ins, other=-1)
        sq = tl.load(q_ptr + si, mask=ins, other=0.0).to(tl.float64)
        tail = ins & (si >= M)
        z = tl.sum(tl.where(tail, sq, 0.0), axis=0)
        law = tl.where(tail, tl.where(z > 0, sq / z, 1.0 / (n - M)), 0.0)
        e = y
        if CODE == 2:  # ot: E = e(Y); e~ moves q~(A) onto r_K
            A = si < K - 1
            rK = tl.sum(tl.where(si == K - 1, stok, 0), axis=0)
            y_in_A = tl.sum((A & (stok == y)).to(tl.int32), axis=0) > 0
            e = tl.where(y_in_A, rK, y)
            extra = tl.sum(tl.where(A, law, 0.0), axis=0)
            law = tl.where(A, 0.0, law)
            law = tl.where(si == K - 1, law + extra, law)
        tl.store(law_ptr + stok, law, mask=ins)
        tl.debug_barrier()
        mass = tl.full((), 0.0, tl.float64)
        for start in range(0, V, BLOCK):
            t = start + tl.arange(0, BLOCK)
            ok = t < V
            r = tl.load(p_ptr + t, mask=ok, other=0.0).to(tl.float64) - tl.load(law_ptr + t, mask=ok, other=0.0)
            mass += tl.sum(tl.where(r > 0, r, 0.0), axis=0)
        le = tl.sum(tl.where(ins & (stok == e), law, 0.0), axis=0)
        pe = tl.load(p_ptr + e).to(tl.float64)
        a = tl.where(le <= 0.0, 1.0, tl.minimum(1.0, pe / le))
        accept = (mass <= 1e-300) | (u < a)
        xr = _gumbel_argmax(p_ptr, g_ptr, law_ptr, mass, V, True, BLOCK, NOISE, seed, step, sk, w3)
        x = tl.where(accept, e, xr).to(tl.int64)
        tl.debug_barrier()
        tl.store(law_ptr + stok, tl.zeros([S_BLOCK], tl.float64), mask=ins)
        tl.debug_barrier()
    return x


@triton.jit
def coupling_kernel(p_ptr, tok_ptr, q_ptr, n_ptr, y_ptr, u_ptr, g_ptr, law_ptr, out_ptr, V, S,
                    M: tl.constexpr, K: tl.constexpr, CODE: tl.constexpr, S_BLOCK: tl.constexpr,
                    BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)  # j * V overflows int32 past ~16.7k rows at V = 128k
    y = tl.load(y_ptr + j)
    code = CODE
    if y < 0:  # no sampled slot recorded: X ~ p
        x = _coupling(p_ptr + j * V, g_ptr + j * V, law_ptr + j * V, tok_ptr + j * S, q_ptr + j * S,
                      tl.load(n_ptr + j), y, tl.load(u_ptr + j), V, M, K, 0, S_BLOCK, BLOCK, False, 0, 0, 0, 0)
    else:
        x = _coupling(p_ptr + j * V, g_ptr + j * V, law_ptr + j * V, tok_ptr + j * S, q_ptr + j * S,
                      tl.load(n_ptr + j), y, tl.load(u_ptr + j), V, M, K, code, S_BLOCK, BLOCK, False, 0, 0, 0, 0)
    tl.store(out_ptr + j, x.to(tl.int64))


_SCRATCH: dict[tuple[str, int], torch.Tensor] = {}


def _law_scratch(device: torch.device, rows: int, V: int) -> torch.Tensor:
    """A zeroed float64 ``[rows, V]`` scratch, reused across calls: the kernels put the
    proposal law on <= S entries of a row and zero them again before they finish, so the
    buffer is all zeros between launches and needs neither a new allocation nor a memset."""
    key = (str(device), V)
    buf = _SCRATCH.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = torch.zeros(max(rows, 1), V, dtype=torch.float64, device=device)
        _SCRATCH[key] = buf
    return buf


def _on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """``t`` on the kernel's device, contiguous; the dtype is kept (the kernels upcast in
    registers, so a float32 or bfloat16 ``p`` is never copied to a float64 tensor)."""
    return t.to(device).contiguous()


def coupling_rows(p, sup_token, sup_q, sup_n, m, K, y_token, verifier, u_accept, gumbel, block=1024):
    """Same contract as ``reference.coupling_rows``; ``p`` and ``gumbel`` may be any float
    dtype (upcast to float64 inside the kernel, exactly as ``.double()`` would)."""
    n, V = p.shape
    S = sup_token.shape[1]
    dev = p.device
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    law = _law_scratch(dev, n, V)
    coupling_kernel[(n,)](_on(dev, p), _on(dev, sup_token), _on(dev, sup_q.float()), _on(dev, sup_n),
                          _on(dev, y_token), _on(dev, u_accept.to(torch.float64)), _on(dev, gumbel), law, out,
                          V, S, M=m, K=K, CODE=VERIFIER_CODES[verifier], S_BLOCK=triton.next_power_of_2(S),
                          BLOCK=min(block, triton.next_power_of_2(V)))
    return out


@triton.jit
def walk_kernel(p_ptr, u_ptr, g_ptr, token_ptr, first_ptr, nch_ptr, erow_ptr, tok_ptr, q_ptr, n_ptr, y_ptr,
                law_ptr, emitted_ptr, n_emitted_ptr, path_ptr, node_ptr, key_ptr, seed_arg, step_arg, L, V, E, S,
                M: tl.constexpr, K: tl.constexpr, CODE: tl.constexpr, S_BLOCK: tl.constexpr,
                C_BLOCK: tl.constexpr, BLOCK: tl.constexpr, NOISE: tl.constexpr, PA: tl.constexpr,
                PR: tl.constexpr):
    """NOISE: the accept uniform and the Gumbel noise at linear node i are drawn in the kernel
    from the streams ``(seed, [0, step, key[b], node[b, i] * 8 + PA or PR])`` of
    ``rheoplan.verify.walk`` instead of read from ``u_ptr`` / ``g_ptr``."""
    b = tl.program_id(0).to(tl.int64)
    seed = tl.full((), seed_arg, tl.int64)  # a scalar argument equal to 1 arrives as a constexpr
    step_ = tl.full((), step_arg, tl.int64)
    sk = tl.load(key_ptr + b) if NOISE else 0
    i = tl.full((), 0, tl.int64)
    active = tl.full((), 1, tl.int1)
    count = tl.full((), 0, tl.int32)
    for step in range(0, L):
        if active:
            tl.store(path_ptr + b * L + step, i.to(tl.int64))
            row = tl.load(erow_ptr + b * L + i)
            base = (b * L + i) * V
            if NOISE:
                v = tl.load(node_ptr + b * L + i)
                w3r = v * 8 + PR
                # number 0 of the accept stream; drawn as a [1] vector (tl.philox's key has shape [1])
                u = tl.sum(philox_uniform(seed, step_, sk, v * 8 + PA, tl.zeros([1], tl.int64)), axis=0)
            else:
                w3r = 0
                u = tl.load(u_ptr + b * L + i)
            if row < 0:
                x = _gumbel_argmax(p_ptr + base, g_ptr + base, law_ptr + b * V, 1.0, V, False, BLOCK, NOISE,
                                   seed, step_, sk, w3r).to(tl.int64)
            else:
                y = tl.load(y_ptr + b * E + row)
                sb = (b * E + row) * S
                if y < 0:
                    x = _coupling(p_ptr + base, g_ptr + base, law_ptr + b * V, tok_ptr + sb, q_ptr + sb,
                                  tl.load(n_ptr + b * E + row), y, u, V, M, K, 0, S_BLOCK, BLOCK, NOISE,
                                  seed, step_, sk, w3r)
                else:
                    x = _coupling(p_ptr + base, g_ptr + base, law_ptr + b * V, tok_ptr + sb, q_ptr + sb,
                                  tl.load(n_ptr + b * E + row), y, u, V, M, K, CODE, S_BLOCK, BLOCK, NOISE,
                                  seed, step_, sk, w3r)
            tl.store(emitted_ptr + b * L + step, x.to(tl.int64))
            count = step + 1
            f = tl.load(first_ptr + b * L + i)
            nc = tl.load(nch_ptr + b * L + i)
            c = f + tl.arange(0, C_BLOCK)
            ctok = tl.load(token_ptr + b * L + c, mask=c < f + nc, other=-1)  # f = -1 has nc = 0
            hit = ctok == x
            nxt = tl.min(tl.where(hit, c, L), axis=0).to(tl.int64)
            active = nxt < L
            i = tl.where(active, nxt, i)
    tl.store(n_emitted_ptr + b, count.to(tl.int64))


class WalkNoise(NamedTuple):
    """In-kernel randomness of ``verify_walk``: the streams ``rheoplan.verify.walk`` reads.

    ``node [B, L]`` creation ids of the linear nodes (``LinearTree.node``), ``key [B]`` each
    tree's stream id (its batch index unless the caller says otherwise), ``accept`` /
    ``residual`` the purpose codes (``Streams.purpose_key(Purpose.VERIFY_ACCEPT)`` and
    ``...VERIFY_RESIDUAL``).
    """

    seed: int
    step: int
    node: torch.Tensor
    key: torch.Tensor
    accept: int
    residual: int


def verify_walk(p, u_accept, gumbel, token, first_child, n_children, exp_row, sup_token, sup_q, sup_n,
                y_token, m, K, verifier, block=1024, noise: WalkNoise | None = None) -> WalkOut:
    """Same contract as ``reference.verify_walk``; ``p`` and ``gumbel`` may be any float dtype
    (upcast to float64 inside the kernel; the walk reads only the rows it visits, so no
    ``[B, L, V]`` float64 copy is made). Small tables are moved to ``p``'s device.

    ``noise``: draw the randomness in the kernel (Philox, bit-identical to ``Streams``)
    instead of reading ``u_accept`` / ``gumbel``, which may then be None: no ``[B, L, V]``
    noise tensor exists at all.
    """
    B, L, V = p.shape
    E, S = sup_token.shape[1], sup_token.shape[2]
    dev = p.device
    emitted = torch.full((B, L), -1, dtype=torch.int64, device=dev)
    path = torch.full((B, L), -1, dtype=torch.int64, device=dev)
    n_emitted = torch.zeros(B, dtype=torch.int64, device=dev)
    if B == 0:
        return WalkOut(emitted, n_emitted, path)
    if noise is None:
        if u_accept is None or gumbel is None:
            raise ValueError("u_accept and gumbel are required unless noise=WalkNoise(...) draws them in the kernel")
        node, key, seed, step, pa, pr = emitted, n_emitted, 0, 0, 0, 0  # unread placeholders
        u_accept, gumbel = _on(dev, u_accept.to(torch.float64)), _on(dev, gumbel)
    else:
        if not 0 <= noise.seed < 2 ** 63 or noise.step < 0:
            raise ValueError(f"noise.seed={noise.seed} (allowed [0, 2**63)) / noise.step={noise.step} (allowed >= 0)")
        if tuple(noise.node.shape) != (B, L) or tuple(noise.key.shape) != (B,):
            raise ValueError(f"noise.node must be [{B}, {L}] and noise.key [{B}], got "
                             f"{tuple(noise.node.shape)}, {tuple(noise.key.shape)}")
        node, key = _on(dev, noise.node.to(torch.int64)), _on(dev, noise.key.to(torch.int64))
        seed, step, pa, pr = noise.seed, noise.step, int(noise.accept), int(noise.residual)
        u_accept, gumbel = emitted, p  # unread placeholders
    law = _law_scratch(dev, B, V)
    walk_kernel[(B,)](_on(dev, p), u_accept, gumbel, _on(dev, token),
                      _on(dev, first_child), _on(dev, n_children), _on(dev, exp_row), _on(dev, sup_token),
                      _on(dev, sup_q.float()), _on(dev, sup_n), _on(dev, y_token), law,
                      emitted, n_emitted, path, node, key, seed, step, L, V, E, S, M=m, K=K,
                      CODE=VERIFIER_CODES[verifier], S_BLOCK=triton.next_power_of_2(S),
                      C_BLOCK=triton.next_power_of_2(max(K, 2)), BLOCK=min(block, triton.next_power_of_2(V)),
                      NOISE=noise is not None, PA=pa, PR=pr)
    return WalkOut(emitted, n_emitted, path)
