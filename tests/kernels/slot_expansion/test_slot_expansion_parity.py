"""Parity of the slot-expansion kernel: reference (torch) vs numba CPU vs Triton.

Integer outputs (support tokens, Y, child tokens) must be equal exactly with injected
Gumbel noise. Float outputs: the numba path is bit-identical to the reference (it keeps
the exp/log steps in torch). Triton computes its own exp/log: see the tolerances there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from rheoplan.config import PROXIES, PROXY_CODES
from rheoplan.distributions import tail_mass
from rheoplan.kernels.slot_expansion import cpu, reference
from rheoplan.planner.expand import proxy_weights
from rheoplan.rng import Purpose, Streams

CASES = [  # (V, support, m, K, proxy, temperature)
    (50, 16, 1, 4, "default", 1.0),
    (50, 16, 0, 4, "next_rank", 0.7),
    (50, 16, 2, 5, "true_q", 1.3),
    (300, 128, 1, 10, "default", 1.0),
    (12, 128, 3, 8, "default", 1.0),  # support clipped to V
    (40, 8, 4, 4, "default", 1.0),  # m = K: greedy / top-K, no sampled slot
]


def _noise(n, s, m, seed=5):
    st = Streams(seed)
    return torch.stack([st.gumbel(3, 0, j, Purpose.DRAFT_SAMPLE, max(s - m, 1)) for j in range(n)])


def _assert_same(a, b, float_exact=True):
    for name, x, y in zip(a._fields, a, b):
        if x.dtype.is_floating_point and not float_exact:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(x, y), f"{name}: {x} != {y}"


@pytest.mark.parametrize("V,S,m,K,proxy,T", CASES)
def test_numba_matches_reference(logit_rows, V, S, m, K, proxy, T):
    logits = logit_rows(10, V, seed=V + m)
    parent = -torch.rand(10)
    s = min(S, V)
    noise = _noise(10, s, m)
    kw = dict(temperature=T, support=S, rheostat=m, slots=K, proxy=proxy)
    _assert_same(reference.slot_expansion(logits, parent, noise, **kw),
                 cpu.slot_expansion(logits, parent, noise, **kw))


def test_bad_arguments_rejected(logit_rows):
    x = logit_rows(2, 10, 0)
    with pytest.raises(ValueError, match="noise"):
        cpu.slot_expansion(x, torch.zeros(2), torch.zeros(2, 3), temperature=1.0, support=8,
                           rheostat=1, slots=4)
    with pytest.raises(ValueError, match="proxy"):
        cpu.slot_expansion(x, torch.zeros(2), torch.zeros(2, 9), temperature=1.0, support=8,
                           rheostat=1, slots=4, proxy="nope")


# Triton: q is computed with Triton's exp (not torch's), so floats match to ~1e-6
# relative (float32 softmax rounding), integers exactly on these logits (no two distinct
# logits within rounding of each other).
TRITON_CASES = [(40, 16, 1, 4, "default", 1.0), (24, 8, 0, 3, "next_rank", 0.7),
                (30, 16, 2, 5, "true_q", 1.0), (20, 8, 4, 4, "default", 1.0)]


def _case(logit_rows, V, S, m, K, proxy, T, seed):
    """Five rows of logits, parent scores and slot noise, the kernel arguments, and the
    reference's answer."""
    logits = logit_rows(5, V, seed=seed)
    parent = -torch.rand(5)
    noise = _noise(5, min(S, V), m)
    kw = dict(temperature=T, support=S, rheostat=m, slots=K, proxy=proxy)
    return logits, parent, noise, kw, reference.slot_expansion(logits, parent, noise, **kw)

@pytest.mark.interpreter
@pytest.mark.parametrize("V,S,m,K,proxy,T", TRITON_CASES)
def test_triton_matches_reference(logit_rows, device, V, S, m, K, proxy, T):
    from rheoplan.kernels.slot_expansion import triton as tk

    logits, parent, noise, kw, ref = _case(logit_rows, V, S, m, K, proxy, T, seed=V + m)
    got = tk.slot_expansion(logits.to(device), parent.to(device), noise.to(device), block=16, **kw)
    _assert_same(ref, type(ref)(*(x.cpu() for x in got)), float_exact=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("m,K,chunks,probs", [(1, 4, 1, False), (4, 4, 1, False), (1, 4, 3, False),
                                              (2, 5, 2, True)])
def test_every_unfilled_output_is_written(monkeypatch, logit_rows, device, m, K, chunks, probs):
    """The outputs and scratch allocated without a fill (``_written``: z, the child slots,
    the candidates, the chunk statistics) come back the same when they start as poison
    (NaN, an id past any vocabulary): the kernels write every entry, with and without Y
    (m < K, m = K), the vocabulary split, and the planner's law as input."""
    from rheoplan.kernels.slot_expansion import triton as tk

    V, S = 48, 16
    logits = logit_rows(5, V, seed=3)
    if probs:
        logits = torch.softmax(logits, -1)
    parent = -torch.rand(5, generator=torch.Generator().manual_seed(0))
    args = (logits.to(device), parent.to(device), _noise(5, S, m).to(device))
    kw = dict(temperature=1.0, support=S, rheostat=m, slots=K, block=16, chunks=chunks, probs=probs)
    want = tk.slot_expansion(*args, **kw)

    def poison(*shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else 2 ** 40, dtype=dtype, device=device)

    monkeypatch.setattr(tk, "_written", poison)
    got = tk.slot_expansion(*args, **kw)
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.interpreter
def test_triton_first_block_all_minus_inf(device):
    """A row whose first BLOCK logits are all -inf (readiness item 7): exp(-inf - -inf) must
    not turn the softmax sum into NaN (the whole support came back as token -1)."""
    from rheoplan.kernels.slot_expansion import triton as tk

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    logits[0, :16] = float("-inf")
    logits[1, :32] = float("-inf")
    parent = torch.zeros(3)
    noise = _noise(3, 8, 1)
    kw = dict(temperature=1.0, support=8, rheostat=1, slots=4)
    ref = reference.slot_expansion(logits, parent, noise, **kw)
    got = tk.slot_expansion(logits.to(device), parent.to(device), noise.to(device), block=16, **kw)
    assert (got.sup_token.cpu() >= 0).all()
    _assert_same(ref, type(ref)(*(x.cpu() for x in got)), float_exact=False)


@pytest.mark.interpreter
def test_triton_temperature_is_a_runtime_argument(logit_rows, device):
    """Two temperatures, one compiled kernel (readiness item 9: INV_T was a constexpr)."""
    from rheoplan.kernels.slot_expansion import triton as tk

    logits = logit_rows(4, 24, seed=3)
    parent, noise = -torch.rand(4), _noise(4, 8, 1)
    for T in (0.6, 1.4):
        kw = dict(temperature=T, support=8, rheostat=1, slots=3)
        ref = reference.slot_expansion(logits, parent, noise, **kw)
        got = tk.slot_expansion(logits.to(device), parent.to(device), noise.to(device), block=16, **kw)
        _assert_same(ref, type(ref)(*(x.cpu() for x in got)), float_exact=False)
    import inspect

    params = inspect.signature(tk.slot_expansion_kernel.fn).parameters  # .fn: the Python function
    constexprs = [name for name, p in params.items() if "constexpr" in str(p.annotation)]
    assert "INV_T" not in constexprs and "S" in constexprs


# Vocabulary split across programs (readiness item 8): every chunk's top-S, then a merge.
# Cases: short last chunk (V not a multiple of the chunk), support larger than a chunk
# (chunks pad their candidates), one chunk per block; the logit rows include exact ties
# and flat rows, whose lowest ids must win across chunk borders.
SPLIT_CASES = [  # (V, support, m, K, proxy, T, chunks) at block 16
    (70, 16, 1, 4, "default", 1.0, 5),
    (40, 32, 2, 5, "true_q", 0.7, 3),
    (48, 8, 0, 3, "next_rank", 1.0, 2),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("V,S,m,K,proxy,T,chunks", SPLIT_CASES)
def test_triton_vocab_split_matches_reference(logit_rows, device, V, S, m, K, proxy, T, chunks):
    from rheoplan.kernels.slot_expansion import triton as tk

    logits, parent, noise, kw, ref = _case(logit_rows, V, S, m, K, proxy, T, seed=V + chunks)
    d = lambda x: x.to(device)  # noqa: E731
    got = tk.slot_expansion(d(logits), d(parent), d(noise), block=16, chunks=chunks, **kw)
    _assert_same(ref, type(ref)(*(x.cpu() for x in got)), float_exact=False)
    # from a given law (the planner's call): every output equals the unsplit kernel's, bit for bit
    q = torch.softmax(logits / T, dim=-1)
    whole = tk.slot_expansion(d(q), d(parent), d(noise), block=16, chunks=1, probs=True, **kw)
    split = tk.slot_expansion(d(q), d(parent), d(noise), block=16, chunks=chunks, probs=True, **kw)
    _assert_same(whole, split)
    assert torch.equal(split.sup_token.cpu(), ref.sup_token)


@pytest.mark.interpreter
def test_triton_bad_chunks_rejected(logit_rows, device):
    from rheoplan.kernels.slot_expansion import triton as tk

    x = logit_rows(2, 40, 0).to(device)
    kw = dict(temperature=1.0, support=8, rheostat=1, slots=4, block=16)
    for bad in (0, 4, 1.5):  # 40 entries = 3 blocks of 16
        with pytest.raises(ValueError, match=r"chunks=.*allowed an int in \[1, 3\]"):
            tk.slot_expansion(x, torch.zeros(2, device=device), torch.zeros(2, 8, device=device), chunks=bad, **kw)


@pytest.mark.interpreter
def test_vocab_chunks_rule():
    from rheoplan.kernels.slot_expansion.triton import default_chunks, vocab_chunks

    V = 128256
    assert vocab_chunks(10, V, 128, 1024, 264) == 26  # batch 1 on 132 SMs: 26 chunks of 5 blocks
    assert vocab_chunks(640, V, 128, 1024, 264) == 1  # batch 64 fills the GPU with rows
    assert vocab_chunks(1, V, 128, 1024, 264) == 26  # capped at sqrt(V / support) = 31, whole blocks: 26
    assert vocab_chunks(1, 40, 8, 16, 264) == 2  # sqrt(40 / 8) = 2 (3 blocks)
    assert vocab_chunks(10, V, 128, 1024, 1) == 1
    assert default_chunks(1, V, 128, "cpu") == 1  # the interpreter: no split by default


@pytest.mark.parametrize("S,m", [(128, 1), (16, 0), (9, 3)])
def test_tail_draws_are_the_samplers_draws(S, m):
    """``cpu.tail_draws`` (the numba ``assign``'s sampled slots, read straight from their
    streams) gives the tail index and ``q~`` the default sampler gives row by row
    (``GumbelSampler.__call__`` on ``distributions.tail_law``): peaked, flat, tied and
    massless tails, rows at different steps and stream ids."""
    from rheoplan.distributions import tail_law
    from rheoplan.kernels.noise import counter_rows
    from rheoplan.planner.assign import gumbel_sampler

    R = 48
    g = torch.Generator().manual_seed(S)
    sup_q = torch.sort(torch.softmax(torch.randn(R, S, generator=g) * 3, -1), -1, descending=True).values
    sup_q[1::6] = 1.0 / S  # flat
    sup_q[2::6, m:] = 0.0  # no tail mass: q~ uniform
    sup_q[3::6, m:] = sup_q[3::6, m:m + 1]  # ties
    steps = tuple(r % 4 for r in range(R))
    sampler = gumbel_sampler(Streams(2**41 + 3), steps, keys=[5 * b for b in range(R)])
    trees, nodes = torch.arange(R), torch.tensor([7 * (r % 5) for r in range(R)])
    seed, st, ids, purpose = sampler.stream_rows(trees, nodes)
    i, qt = cpu.tail_draws(sup_q, m, S - m, seed, counter_rows(st.numpy(), ids.numpy(), nodes.numpy(), purpose))
    want_i, want_qt = [], []
    for r in range(R):
        law = tail_law(sup_q[r], m, S)
        want_i.append(sampler(r, int(nodes[r]), law))
        want_qt.append(float(law[want_i[-1]]))
    assert i.tolist() == want_i
    assert qt.tolist() == want_qt  # the same bits: the same divisions
    assert len(set(want_i)) > 3  # the draws are not all the top of the tail


@njit(cache=False)
def _proxy_rows(code, sup_q, z, m, out):
    for r in range(sup_q.shape[0]):
        out[r] = cpu.proxy_weight(code, sup_q[r], z[r], m)


@pytest.mark.parametrize("policy", PROXIES)
@pytest.mark.parametrize("m", [0, 1, 2, 5])
def test_proxy_weight_port_matches_proxy_weights(policy, m):
    """The numba expand's proxy (``cpu.proxy_weight``) gives ``proxy_weights``'s float64
    values bit for bit: z above and below q(r_m), equal to it, zero, and NaN."""
    g = torch.Generator().manual_seed(m)
    sup_q = torch.sort(torch.rand(64, 8, generator=g), dim=1, descending=True).values
    z = tail_mass(sup_q, m, 8)
    z[::4] = sup_q[::4, max(m - 1, 0)].to(torch.float64)  # ties
    z[1::4] = torch.rand(16, generator=g, dtype=torch.float64)
    z[2::8] = 0.0
    z[3::8] = float("nan")
    sup_q[5, :] = float("nan")
    want = proxy_weights(policy, sup_q, z, m)
    got = np.empty(64, dtype=np.float64)
    _proxy_rows(PROXY_CODES[policy], sup_q.numpy(), z.numpy(), m, got)
    assert torch.equal(want.isnan(), torch.from_numpy(np.isnan(got)))
    assert np.array_equal(want.numpy(), got, equal_nan=True)


def test_rank_support_rows_counts_the_broken_rows():
    """A NaN law (``q[r, 0]`` NaN, the test of ``draft_probs``) is counted, not ranked; the
    other rows rank as without it."""
    q = torch.softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(1)), dim=-1)
    tok, val = np.empty((4, 5), dtype=np.int64), np.empty((4, 5), dtype=np.float32)
    assert cpu.rank_support_rows(q.numpy(), 5, tok, val) == 0
    bad = q.clone()
    bad[1] = float("nan")
    bad[3, 0] = float("nan")
    tok2, val2 = np.full((4, 5), -7, dtype=np.int64), np.empty((4, 5), dtype=np.float32)
    assert cpu.rank_support_rows(bad.numpy(), 5, tok2, val2) == 2
    assert np.array_equal(tok[[0, 2]], tok2[[0, 2]]) and np.array_equal(val[[0, 2]], val2[[0, 2]])
    assert (tok2[[1, 3]] == -7).all()
