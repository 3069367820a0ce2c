"""Triton verification kernels (same signatures as ``reference``), parallel over nodes.

What is emitted at a node depends only on that node's inputs (its target law, its
expansion tables, its noise), never on the walk that reaches it. So the work over the
vocabulary runs for every node at once, and the walk itself only reads a small table:

1. ``node_mass_kernel``, grid ``(nodes, splits)``: the residual mass
   ``sum max(0, p - law)`` of every node that tests a proposal, each program over one
   chunk of the vocabulary (a partial sum per chunk).
2. ``node_draw_kernel``, grid ``(nodes, splits)``: the proposal's accept test (the chunk
   partial masses summed in a fixed order; every chunk program decides the same), then,
   unless accepted, the chunk's best Gumbel key ``log(max(0, p - law) / mass) + g`` (or
   ``log p + g`` for a node that draws ``X ~ p``) and its index (first index on ties).
   Writes ``prop [nodes]`` (the accepted proposal, or -1) and ``best/arg [nodes, splits]``.
3. ``walk_kernel``, one program per tree: the serial walk over that table, root to the
   first rejection: ``X`` at a node is its accepted proposal or the best chunk's index;
   the child drafted with token ``X`` is next. ``O(depth * splits)`` work, no pass over V.

``coupling_rows`` runs the same three kernels, each row a one-node tree.

The proposal law lives on the <= S support tokens only. No ``[V]`` scratch is needed: the
launcher sorts each row's support tokens (``_sorted_support``), so the support tokens inside
a block of the vocabulary are one contiguous run of the sorted list (two counts over a
register vector), and the law is placed on the block's lanes one token at a time (a run is
a few tokens; all runs of a node together are <= S).

Parity: emitted tokens and paths equal the reference's for the same injected numbers
(the keys are computed with the reference's operations; summation order of the mass and
``log`` rounding can only matter at exact near-ties of two Gumbel keys, ~1e-16).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rheoplan.distributions import RESIDUAL_EPS
from rheoplan.kernels.philox_triton import philox_gumbel, philox_uniform
from rheoplan.kernels.verify import VERIFIER_CODES
from rheoplan.kernels.verify.reference import WalkOut


#: the one residual epsilon (``rheoplan.distributions.RESIDUAL_EPS``) as a compile-time constant
_RESIDUAL_EPS = tl.constexpr(RESIDUAL_EPS)
#: sort key of an unused support entry (after every token id)
_NO_TOKEN = 1 << 62
_NO_TOKEN_K = tl.constexpr(_NO_TOKEN)


@triton.jit
def _row_law(tok_ptr, q_ptr, n, M: tl.constexpr, K: tl.constexpr, CODE: tl.constexpr, S_BLOCK: tl.constexpr):
    """The proposal law of one expanded node over its support ranks (``[S_BLOCK]``, float64):
    q~ on ranks ``m+1..n`` (``rheoplan.distributions.tail_law``), and for 'ot' the law of
    ``E = e(Y)``: ``e~`` moves q~(A) onto rank K (``rheoplan.verify._ot_proposal``)."""
    si = tl.arange(0, S_BLOCK)
    ins = si < n
    sq = tl.load(q_ptr + si, mask=ins, other=0.0).to(tl.float64)
    tail = ins & (si >= M)
    z = tl.sum(tl.where(tail, sq, 0.0), axis=0)
    law = tl.where(tail, tl.where(z > 0, sq / z, 1.0 / (n - M).to(tl.float64)), 0.0)
    if CODE == 2:
        A = si < K - 1
        extra = tl.sum(tl.where(A, law, 0.0), axis=0)
        law = tl.where(A, 0.0, law)
        law = tl.where(si == K - 1, law + extra, law)
    return law


@triton.jit
def support_law_kernel(tok_ptr, q_ptr, n_ptr, perm_ptr, law_ptr, S, M: tl.constexpr, K: tl.constexpr,
                       CODE: tl.constexpr, S_BLOCK: tl.constexpr):
    """``law [R, S]``: row r's proposal law in its sorted-token order (``law[r, j]`` belongs
    to support rank ``perm[r, j]``), once per expansion row for every node and chunk that
    reads it. Written in rank order, then permuted in place (barriers between)."""
    r = tl.program_id(0).to(tl.int64)
    si = tl.arange(0, S_BLOCK)
    law = _row_law(tok_ptr + r * S, q_ptr + r * S, tl.load(n_ptr + r), M, K, CODE, S_BLOCK)
    tl.store(law_ptr + r * S + si, law, mask=si < S)
    tl.debug_barrier()
    perm = tl.load(perm_ptr + r * S + si, mask=si < S, other=0)
    sorted_law = tl.load(law_ptr + r * S + perm, mask=si < S, other=0.0)
    tl.debug_barrier()
    tl.store(law_ptr + r * S + si, sorted_law, mask=si < S)


@triton.jit
def _proposal(tok_ptr, ss, ls, y, K: tl.constexpr, CODE: tl.constexpr, S_BLOCK: tl.constexpr):
    """The proposal token ``e`` of one expanded node (``Y``; for 'ot' ``e(Y)``: rank K's token
    when ``Y`` is among the first K - 1) and its law ``le``, from the sorted support ``ss``
    and its law ``ls``."""
    e = y
    if CODE == 2:
        si = tl.arange(0, S_BLOCK)
        stok = tl.load(tok_ptr + si, mask=si < K, other=-1)
        A = si < K - 1
        rK = tl.sum(tl.where(si == K - 1, stok, 0), axis=0)
        y_in_A = tl.sum((A & (stok == y)).to(tl.int32), axis=0) > 0
        e = tl.where(y_in_A, rK, y)
    le = tl.sum(tl.where(ss == e, ls, 0.0), axis=0)
    return e, le


@triton.jit
def _block_law(t, start, ss, sst_ptr, law_ptr, BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
               DENSE: tl.constexpr):
    """The proposal law on the block ``t = start + arange(BLOCK)`` of the vocabulary.
    ``ss`` is the row's sorted support (``_NO_TOKEN`` past its end), so the tokens inside
    the block are ``ss[lo:hi]``, their law ``law_ptr[lo:hi]`` (``support_law_kernel``):
    placed one token at a time (a run is a few tokens; all runs of a node are <= S).
    DENSE: one ``[BLOCK, S_BLOCK]`` comparison instead, the same values; for the
    interpreter, where each loop step costs a Python round trip (on a GPU that tile would
    not fit in registers)."""
    if DENSE:
        ls = tl.load(law_ptr + tl.arange(0, S_BLOCK), mask=ss < _NO_TOKEN_K, other=0.0)
        law = tl.sum(tl.where(t[:, None] == ss[None, :], ls[None, :], 0.0), axis=1)
    else:
        lo = tl.sum((ss < start).to(tl.int32), axis=0)
        hi = tl.sum((ss < start + BLOCK).to(tl.int32), axis=0)
        law = tl.zeros([BLOCK], tl.float64)
        for j in range(lo, hi):
            law = tl.where(t == tl.load(sst_ptr + j), tl.load(law_ptr + j), law)
    return law


@triton.jit
def _node(j, erow_ptr, y_ptr, n_ptr, M: tl.constexpr, K: tl.constexpr, CODE: tl.constexpr):
    """(expansion row, Y, support size, tests a proposal?) of node ``j``."""
    row = tl.load(erow_ptr + j)
    rs = tl.maximum(row, 0)
    y = tl.load(y_ptr + rs)
    n = tl.load(n_ptr + rs)
    tests = (row >= 0) & (y >= 0) & (CODE != 0) & (M < K)
    return rs, y, n, tests


@triton.jit
def node_mass_kernel(p_ptr, erow_ptr, y_ptr, n_ptr, sst_ptr, law_ptr, mass_ptr, V, S, CHUNK, NB,
                     M: tl.constexpr, K: tl.constexpr, CODE: tl.constexpr, S_BLOCK: tl.constexpr,
                     BLOCK: tl.constexpr, DENSE: tl.constexpr):
    """``mass [nodes, NB]``: node j's ``sum max(0, p - law)`` over vocabulary chunk c
    (written only for nodes that test a proposal)."""
    j = tl.program_id(0).to(tl.int64)  # j * V overflows int32 past ~16.7k rows at V = 128k
    c = tl.program_id(1)
    rs, y, n, tests = _node(j, erow_ptr, y_ptr, n_ptr, M, K, CODE)
    if tests:
        sb = rs * S
        ss = tl.load(sst_ptr + sb + tl.arange(0, S_BLOCK), mask=tl.arange(0, S_BLOCK) < S, other=_NO_TOKEN_K)
        mass = tl.full((), 0.0, tl.float64)
        for start in range(c * CHUNK, tl.minimum(V, (c + 1) * CHUNK), BLOCK):
            t = start + tl.arange(0, BLOCK)
            ok = t < V
            law = _block_law(t, start, ss, sst_ptr + sb, law_ptr + sb, BLOCK, S_BLOCK, DENSE)
            r = tl.load(p_ptr + j * V + t, mask=ok, other=0.0).to(tl.float64) - law
            mass += tl.sum(tl.where(r > 0, r, 0.0), axis=0)
        tl.store(mass_ptr + j * NB + c, mass)


@triton.jit
def node_draw_kernel(p_ptr, u_ptr, g_ptr, erow_ptr, y_ptr, tok_ptr, n_ptr, sst_ptr, law_ptr, mass_ptr,
                     nid_ptr, nkey_ptr, prop_ptr, best_ptr, arg_ptr, seed_arg, step_arg, V, S, CHUNK, NB,
                     M: tl.constexpr, K: tl.constexpr, CODE: tl.constexpr, S_BLOCK: tl.constexpr,
                     BLOCK: tl.constexpr, NB_BLOCK: tl.constexpr, NOISE: tl.constexpr, PA: tl.constexpr,
                     PR: tl.constexpr, DENSE: tl.constexpr):
    """Node j, chunk c: ``prop[j]`` (the accepted proposal or -1; chunk 0 writes it) and,
    unless accepted, ``best/arg[j, c]``: the chunk's best Gumbel key and its token.

    NOISE: node j's accept uniform and Gumbel noise are drawn here from the streams
    ``(seed, [0, step, nkey[j], nid[j] * 8 + PA or PR])`` of ``rheoplan.verify.walk``
    instead of read from ``u_ptr [nodes]`` / ``g_ptr [nodes, V]``."""
    j = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seed = tl.full((), seed_arg, tl.int64)  # a scalar argument equal to 1 arrives as a constexpr
    step = tl.full((), step_arg, tl.int64)
    if NOISE:
        sk = tl.load(nkey_ptr + j)
        v = tl.load(nid_ptr + j)
        w3 = v * 8 + PR
        # number 0 of the accept stream; drawn as a [1] vector (tl.philox's key has shape [1])
        u = tl.sum(philox_uniform(seed, step, sk, v * 8 + PA, tl.zeros([1], tl.int64)), axis=0)
    else:
        sk = tl.full((), 0, tl.int64)
        w3 = tl.full((), 0, tl.int64)
        u = tl.load(u_ptr + j).to(tl.float64)
    rs, y, n, tests = _node(j, erow_ptr, y_ptr, n_ptr, M, K, CODE)
    sb = rs * S
    prop = tl.full((), -1, tl.int64)
    mass = tl.full((), 1.0, tl.float64)
    si = tl.arange(0, S_BLOCK)
    ss = tl.load(sst_ptr + sb + si, mask=si < S, other=_NO_TOKEN_K)
    if tests:
        e, le = _proposal(tok_ptr + sb, ss, tl.load(law_ptr + sb + si, mask=si < S, other=0.0), y, K, CODE,
                          S_BLOCK)
        cb = tl.arange(0, NB_BLOCK)
        mass = tl.sum(tl.load(mass_ptr + j * NB + cb, mask=cb < NB, other=0.0), axis=0)
        pe = tl.load(p_ptr + j * V + e).to(tl.float64)
        a = tl.where(le <= 0.0, 1.0, tl.minimum(1.0, pe / le))
        accept = (mass <= _RESIDUAL_EPS) | (u < a)
        prop = tl.where(accept, e, -1).to(tl.int64)
    if c == 0:
        tl.store(prop_ptr + j, prop)
    if prop < 0:
        # loop-carried values get their final types up front (compiled Triton requires it)
        best = tl.full((), float("-inf"), tl.float64)
        arg = (c * CHUNK).to(tl.int64)
        for start in range(c * CHUNK, tl.minimum(V, (c + 1) * CHUNK), BLOCK):
            t = start + tl.arange(0, BLOCK)
            ok = t < V
            p = tl.load(p_ptr + j * V + t, mask=ok, other=0.0).to(tl.float64)  # native dtype in memory
            if NOISE:
                g = philox_gumbel(seed, step, sk, w3, t.to(tl.int64))
            else:
                g = tl.load(g_ptr + j * V + t, mask=ok, other=0.0).to(tl.float64)
            if tests:
                law = _block_law(t, start, ss, sst_ptr + sb, law_ptr + sb, BLOCK, S_BLOCK, DENSE)
                key = tl.log(tl.maximum(p - law, 0.0) / mass) + g
            else:
                key = tl.log(p) + g
            key = tl.where(ok, key.to(tl.float64), float("-inf"))
            bmax = tl.max(key, axis=0)
            barg = start + tl.argmax(key, axis=0)
            take = bmax > best
            arg = tl.where(take, barg, arg).to(tl.int64)
            best = tl.where(take, bmax, best)
        tl.store(best_ptr + j * NB + c, best)
        tl.store(arg_ptr + j * NB + c, arg)


def _sorted_support(sup_token: torch.Tensor, sup_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's support tokens in increasing order (unused entries ``_NO_TOKEN``, last)
    and their ranks: ``[R, S]`` int64 each, on the device (no host sync)."""
    S = sup_token.shape[-1]
    used = torch.arange(S, device=sup_token.device) < sup_n.to(sup_token.device)[..., None]
    keyed = torch.where(used, sup_token.to(torch.int64), _NO_TOKEN)
    sst, perm = keyed.sort(dim=-1)
    return sst.contiguous(), perm.contiguous()


def _splits(device: torch.device, nodes: int, V: int, block: int, splits: int | None) -> tuple[int, int]:
    """(chunk, splits): the vocabulary cut into ``splits`` chunks of ``chunk`` tokens (a
    multiple of ``block``). Automatic on CUDA: about two programs per SM over all nodes;
    elsewhere (the interpreter runs programs one after another) one chunk per node."""
    n_blocks = triton.cdiv(V, block)
    if splits is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = triton.next_power_of_2(triton.cdiv(2 * sms, max(nodes, 1)))
        else:
            splits = 1
    elif not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits={splits!r} is out of range: allowed an int >= 1 (or None: automatic)")
    chunk = triton.cdiv(n_blocks, min(splits, n_blocks)) * block
    return chunk, triton.cdiv(V, chunk)


def _on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """``t`` on the kernel's device, contiguous; the dtype is kept (the kernels upcast in
    registers, so a float32 or bfloat16 ``p`` is never copied to a float64 tensor)."""
    return t.to(device).contiguous()


def _draw_nodes(p2, u, g, erow, y, sup_token, sup_q, sup_n, m, K, verifier, block, splits, nid=None, nkey=None,
                noise=None, dense_law=None):
    """The per-node kernels over ``N`` nodes: ``p2 [N, V]``, ``erow [N]`` (row of the flat
    expansion tables ``sup_* [R, S]`` / ``y [R]``, or -1). Returns (prop, best, arg)."""
    N, V = p2.shape
    S = sup_token.shape[-1]
    dev = p2.device
    BLOCK = min(block, triton.next_power_of_2(V))
    chunk, NB = _splits(dev, N, V, BLOCK, splits)
    tok, q, n = _on(dev, sup_token), _on(dev, sup_q.float()), _on(dev, sup_n)
    sst, perm = _sorted_support(tok, n)
    erow, y = _on(dev, erow), _on(dev, y)
    if noise is not None:  # a kernel reads every tensor as contiguous (an expanded view would read garbage)
        nid, nkey = _on(dev, nid), _on(dev, nkey)
    mass = torch.empty(N, NB, dtype=torch.float64, device=dev)
    prop = torch.empty(N, dtype=torch.int64, device=dev)
    best = torch.empty(N, NB, dtype=torch.float64, device=dev)
    arg = torch.empty(N, NB, dtype=torch.int64, device=dev)
    law = torch.empty(tok.shape[0], S, dtype=torch.float64, device=dev)
    dense = dev.type != "cuda" if dense_law is None else bool(dense_law)  # the interpreter: see _block_law
    code, S_BLOCK = VERIFIER_CODES[verifier], triton.next_power_of_2(S)
    if code != 0 and m < K:  # nothing tests a proposal otherwise
        support_law_kernel[(tok.shape[0],)](tok, q, n, perm, law, S, M=m, K=K, CODE=code, S_BLOCK=S_BLOCK)
        node_mass_kernel[(N, NB)](p2, erow, y, n, sst, law, mass, V, S, chunk, NB, M=m, K=K, CODE=code,
                                  S_BLOCK=S_BLOCK, BLOCK=BLOCK, DENSE=dense)
    if noise is None:
        seed, step, pa, pr, nid, nkey = 0, 0, 0, 0, erow, erow  # nid / nkey unread
    else:
        seed, step, pa, pr = noise.seed, noise.step, int(noise.accept), int(noise.residual)
        u, g = p2, p2  # unread placeholders
    node_draw_kernel[(N, NB)](p2, u, g, erow, y, tok, n, sst, law, mass, nid, nkey, prop, best, arg, seed, step,
                              V, S, chunk, NB, M=m, K=K, CODE=code, S_BLOCK=S_BLOCK, BLOCK=BLOCK,
                              NB_BLOCK=triton.next_power_of_2(NB), NOISE=noise is not None, PA=pa, PR=pr,
                              DENSE=dense)
    return prop, best, arg


def coupling_rows(p, sup_token, sup_q, sup_n, m, K, y_token, verifier, u_accept, gumbel, block=1024, splits=None,
                  dense_law=None):
    """Same contract as ``reference.coupling_rows``; ``p`` and ``gumbel`` may be any float
    dtype (upcast to float64 inside the kernel, exactly as ``.double()`` would).
    ``splits``: vocabulary chunks per row (None: automatic, ``_splits``); ``dense_law``:
    ``_block_law``'s layout (None: dense under the interpreter only)."""
    n, V = p.shape
    dev = p.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    erow = torch.arange(n, device=dev)
    prop, best, arg = _draw_nodes(_on(dev, p), _on(dev, u_accept.to(torch.float64)), _on(dev, gumbel), erow,
                                  y_token, sup_token, sup_q, sup_n, m, K, verifier, block, splits,
                                  dense_law=dense_law)
    # each row a one-node tree: the walk kernel's table read is the one rule for "the best chunk"
    out = torch.empty(n, 1, dtype=torch.int64, device=dev)
    leaf = torch.full((n, 1), -1, dtype=torch.int64, device=dev)
    walk_kernel[(n,)](prop, best, arg, leaf, leaf, leaf + 1, out, torch.empty(n, dtype=torch.int64, device=dev),
                      torch.empty(n, 1, dtype=torch.int64, device=dev), 1, best.shape[1], C_BLOCK=2,
                      NB_BLOCK=triton.next_power_of_2(best.shape[1]))
    return out[:, 0]


@triton.jit
def walk_kernel(prop_ptr, best_ptr, arg_ptr, token_ptr, first_ptr, nch_ptr, emitted_ptr, n_emitted_ptr, path_ptr,
                L, NB, C_BLOCK: tl.constexpr, NB_BLOCK: tl.constexpr):
    """Tree b's walk over the per-node table of ``node_draw_kernel``: no pass over V."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.full((), 0, tl.int64)
    active = tl.full((), 1, tl.int1)
    count = tl.full((), 0, tl.int32)
    cb = tl.arange(0, NB_BLOCK)
    for step in range(0, L):
        if active:
            tl.store(path_ptr + b * L + step, i)
            jn = b * L + i
            x = tl.load(prop_ptr + jn)
            if x < 0:  # rejected or no proposal: the chunk with the best key, the first on ties
                bv = tl.load(best_ptr + jn * NB + cb, mask=cb < NB, other=float("-inf"))
                first = tl.min(tl.where(bv == tl.max(bv, axis=0), cb, NB_BLOCK), axis=0)
                x = tl.sum(tl.where(cb == first, tl.load(arg_ptr + jn * NB + cb, mask=cb < NB, other=0), 0), axis=0)
            tl.store(emitted_ptr + b * L + step, x.to(tl.int64))
            count = step + 1
            f = tl.load(first_ptr + b * L + i)
            nc = tl.load(nch_ptr + b * L + i)
            ch = f + tl.arange(0, C_BLOCK)
            ctok = tl.load(token_ptr + b * L + ch, mask=ch < f + nc, other=-1)  # f = -1 has nc = 0
            nxt = tl.min(tl.where(ctok == x, ch, L), axis=0).to(tl.int64)
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
                y_token, m, K, verifier, block=1024, noise: WalkNoise | None = None, splits=None,
                dense_law=None) -> WalkOut:
    """Same contract as ``reference.verify_walk``; ``p`` and ``gumbel`` may be any float dtype
    (upcast to float64 inside the kernel, no float64 copy of ``[B, L, V]``). Small tables
    are moved to ``p``'s device. Every linear node's draw is computed in parallel (padding
    rows too: give them a finite ``p``), then the walk reads the table (module docstring).

    ``noise``: draw the randomness in the kernel (Philox, bit-identical to ``Streams``)
    instead of reading ``u_accept`` / ``gumbel``, which may then be None: no ``[B, L, V]``
    noise tensor exists at all. ``splits``: vocabulary chunks per node (None: automatic);
    ``dense_law``: ``_block_law``'s layout (None: dense under the interpreter only).
    """
    B, L, V = p.shape
    E, S = sup_token.shape[1], sup_token.shape[2]
    dev = p.device
    emitted = torch.full((B, L), -1, dtype=torch.int64, device=dev)
    path = torch.full((B, L), -1, dtype=torch.int64, device=dev)
    n_emitted = torch.zeros(B, dtype=torch.int64, device=dev)
    if B == 0:
        return WalkOut(emitted, n_emitted, path)
    nid = nkey = None
    if noise is None:
        if u_accept is None or gumbel is None:
            raise ValueError("u_accept and gumbel are required unless noise=WalkNoise(...) draws them in the kernel")
        u_accept, gumbel = _on(dev, u_accept.to(torch.float64)).reshape(B * L), _on(dev, gumbel).reshape(B * L, V)
    else:
        if not 0 <= noise.seed < 2 ** 63 or noise.step < 0:
            raise ValueError(f"noise.seed={noise.seed} (allowed [0, 2**63)) / noise.step={noise.step} (allowed >= 0)")
        if tuple(noise.node.shape) != (B, L) or tuple(noise.key.shape) != (B,):
            raise ValueError(f"noise.node must be [{B}, {L}] and noise.key [{B}], got "
                             f"{tuple(noise.node.shape)}, {tuple(noise.key.shape)}")
        nid = _on(dev, noise.node.to(torch.int64)).reshape(B * L)
        nkey = _on(dev, noise.key.to(torch.int64)).repeat_interleave(L)  # tree b's key at each of its nodes
    exp_row = _on(dev, exp_row)
    erow = torch.where(exp_row >= 0, exp_row + E * torch.arange(B, device=dev)[:, None], -1).reshape(B * L)
    prop, best, arg = _draw_nodes(_on(dev, p).reshape(B * L, V), u_accept, gumbel, erow, y_token.reshape(B * E),
                                  sup_token.reshape(B * E, S), sup_q.reshape(B * E, S), sup_n.reshape(B * E),
                                  m, K, verifier, block, splits, nid, nkey, noise, dense_law)
    NB = best.shape[1]
    walk_kernel[(B,)](prop, best, arg, _on(dev, token), _on(dev, first_child), _on(dev, n_children), emitted,
                      n_emitted, path, L, NB, C_BLOCK=triton.next_power_of_2(max(K, 2)),
                      NB_BLOCK=triton.next_power_of_2(NB))
    return WalkOut(emitted, n_emitted, path)
