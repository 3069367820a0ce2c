"""The few-row numba product (``kernels/linear/cpu.py``) against torch's (``reference``):
equal up to float32 rounding for every shape SmolLM2-135M and its head use, a row's
result the same bits whatever the rows beside it and the thread count, torch's product
where the kernel does not apply."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rheoplan.kernels.linear import cpu, reference

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (8192, 576), (576, 1728), (7, 5), (1, 3), (6, 9)]


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_torchs_product_up_to_rounding(out_f, in_f, rows, bias):
    g = torch.Generator().manual_seed(out_f * 31 + in_f + rows)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    x = torch.randn(rows, in_f, generator=g)
    assert cpu.supported(x, w)
    got, want = cpu.linear(x, w, b), reference.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    # float32 sums of in_f products in another order: relative to the sum of |terms|
    scale = (x.abs() @ w.abs().T) + (0 if b is None else b.abs())
    assert ((got - want).abs() <= 1e-5 * scale + 1e-6).all()


def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_threads():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1539, 576, generator=g)
    x = torch.randn(16, 576, generator=g)
    every = cpu.linear(x, w)
    for i in (0, 5, 15):
        assert torch.equal(cpu.linear(x[i:i + 1], w), every[i:i + 1])
    assert torch.equal(cpu.linear(x[3:12], w), every[3:12])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.linear(x, w), every)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_is_the_float32_kernel_on_the_widened_operands_rounded_once(out_f, in_f, rows, bias):
    """bfloat16: the float32 kernel's sums on the exactly widened operands, rounded to
    bfloat16 once, bit for bit (each of the two bfloat16 paths, up to two rows straight from
    the 16-bit weight and beyond that through a widened buffer); and so torch's bfloat16
    product up to that one rounding."""
    g = torch.Generator().manual_seed(out_f * 37 + in_f + rows)
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    assert cpu.supported(x, w)
    got = cpu.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
    want32 = cpu.linear(x.float(), w.float(), None if b is None else b.float())
    assert torch.equal(got, want32.bfloat16())
    want = reference.linear(x, w, b)
    scale = (x.float().abs() @ w.float().abs().T) + (0 if b is None else b.float().abs())
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-5 * scale + 1e-6).all()


def test_the_kernels_conversions_are_torchs():
    """The kernels' widening and rounding, Python's versions (the compiled ones share the
    rounding formula, ``_rounded_bfloat16_bits``): widening is torch's ``.float()``, rounding
    torch's ``.bfloat16()`` bit for bit, ties to even, infinities and overflow too (a NaN
    stays a NaN)."""
    import numpy as np

    g = torch.Generator().manual_seed(4)
    one = 1.0
    values = torch.cat([torch.tensor([one + 2 ** -8, one + 2 ** -7 + 2 ** -8, -(one + 2 ** -8), 0.0, -0.0,
                                      float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-40,
                                      2 ** -133]),
                        torch.randn(2000, generator=g) * 10.0 ** torch.randint(-30, 30, (2000,), generator=g)])
    out = np.empty(1, np.uint16)
    got = torch.tensor([int(cpu._narrow(out, np.float32(v))) for v in values.tolist()], dtype=torch.int32)
    want = values.bfloat16()
    # a NaN's pattern differs (torch's vectorised conversion writes 0xFFFF, its scalar one and
    # the kernel 0x7FC0): NaN either way; every other value the same bits
    nan = want.isnan()
    assert (got.to(torch.int16).view(torch.bfloat16).isnan() == nan).all()
    assert torch.equal(got[~nan], want.view(torch.int16)[~nan].to(torch.int32) & 0xFFFF)
    bits = torch.randint(0, 2 ** 16, (2000,), generator=g).to(torch.int16)
    widened = [float(cpu._widen(np.uint16(b))) for b in bits.numpy().view(np.uint16).tolist()]
    torch.testing.assert_close(torch.tensor(widened), bits.view(torch.bfloat16).float(), rtol=0, atol=0,
                               equal_nan=True)
    assert cpu._narrow(np.empty(1, np.float32), np.float32(0.3)) == np.float32(0.3)


def test_a_bfloat16_rows_bits_do_not_depend_on_the_other_rows():
    """As in float32, and across the kernel's two bfloat16 paths (a lone row or a pair is
    read from the 16-bit weight, more rows from a widened buffer)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1539, 576, generator=g).bfloat16()
    x = torch.randn(16, 576, generator=g).bfloat16()
    every = cpu.linear(x, w)
    for i in (0, 5, 15):
        assert torch.equal(cpu.linear(x[i:i + 1], w), every[i:i + 1])
    assert torch.equal(cpu.linear(x[4:6], w), every[4:6])
    assert torch.equal(cpu.linear(x[3:12], w), every[3:12])


def test_a_bfloat16_rows_float32_sums_do_not_depend_on_the_other_rows():
    """The bfloat16 kernel's float32 sums before its one rounding (a float32 ``out``): a
    lone row (blocks of eight weight rows), a pair (the 16-bit weight) and rows among 16
    (the widened buffer) get the same bits, the float32 kernel's on the widened operands.
    Compared before rounding because the rounding to bfloat16 hides most differences in
    summation order (a lone row summed backwards passed the test above)."""
    import numpy as np

    g = torch.Generator().manual_seed(5)
    w = torch.randn(1543, 576, generator=g).bfloat16()  # 1543 = 8 * 192 + 4 + 3: every tail
    x = torch.randn(16, 576, generator=g).bfloat16()
    wn, xn = cpu.weight_array(w), x.view(torch.int16).numpy().view(np.uint16)

    def sums(rows):
        out = np.empty((len(rows), wn.shape[0]), np.float32)
        cpu._rows_times_bfloat16_weight(np.ascontiguousarray(xn[rows]), wn, out, 2)
        return torch.from_numpy(out)

    every = sums(list(range(16)))
    assert torch.equal(every, cpu.linear(x.float(), w.float()))
    for i in (0, 7, 15):
        assert torch.equal(sums([i]), every[i:i + 1])
    assert torch.equal(sums([4, 5]), every[4:6])


def test_rows_into_writes_the_kernels_bits_into_the_given_output():
    """``bfloat16_rows_into`` writes every row into the caller's array: the float32
    kernel's sums on the widened operands rounded once (every path: a lone row, a pair,
    the widened buffer), as ``rows_times`` returns them."""
    import numpy as np

    g = torch.Generator().manual_seed(6)
    w = torch.randn(1543, 576, generator=g).bfloat16()
    wn = cpu.weight_array(w)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        out = np.full((rows, wn.shape[0]), 7, np.uint16)
        cpu.bfloat16_rows_into(x.view(torch.int16).numpy().view(np.uint16), wn, out)
        got = torch.from_numpy(out).view(torch.bfloat16)
        assert torch.equal(got, cpu.linear(x.float(), w.float()).bfloat16())
        assert torch.equal(got, cpu.rows_times(x, wn))


def test_leading_dims_and_strided_inputs():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 40, generator=g)
    x = torch.randn(2, 3, 80, generator=g)[..., ::2]  # not contiguous
    got = cpu.linear(x, w)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, reference.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu.linear(x, w.T.contiguous().T), got, rtol=0, atol=0)  # a transposed weight


def test_nan_and_infinity_propagate_as_in_torch():
    w = torch.ones(8, 4)
    x = torch.tensor([[1.0, float("nan"), 0.0, 0.0], [float("inf"), 1.0, 0.0, 0.0]])
    got = cpu.linear(x, w)
    assert got[0].isnan().all() and (got[1] == float("inf")).all()


def test_where_the_kernel_does_not_apply_torch_computes():
    w = torch.randn(8, 4)
    many = torch.randn(cpu.MAX_ROWS + 1, 4)
    assert not cpu.supported(many, w)
    assert torch.equal(cpu.linear(many, w), reference.linear(many, w))
    assert not cpu.supported(many[:2].double(), w.double())
    assert not cpu.supported(many[:2].half(), w.half())
    assert not cpu.supported(many[:2].bfloat16(), w)  # mixed dtypes: torch's rules
    wg = w.clone().requires_grad_(True)
    assert not cpu.supported(many[:2], wg)  # autograd keeps torch's product
    y = cpu.linear(many[:2], wg)
    y.sum().backward()
    assert wg.grad is not None
    with pytest.raises(ValueError, match="features"):
        cpu.linear(torch.randn(2, 5), w)


_COMPILE_BOTH_KERNELS = """
import torch
from rheoplan.kernels.linear import cpu
for dt in (torch.float32, torch.bfloat16):
    w = cpu.weight_array(torch.randn(13, 8).to(dt))
    for rows in (1, 3):
        for bias in (None, torch.zeros(13)):
            cpu.rows_times(torch.randn(rows, 8).to(dt), w, bias)
"""


def test_a_first_compile_prints_no_numba_warnings(tmp_path):
    """Compiled afresh (an empty ``NUMBA_CACHE_DIR``, as on a new install), the kernels of
    every dtype, row count and output kind print nothing to stderr: numba's IR inlining of
    the bfloat16 rounding once printed 66 NumbaIRAssumptionWarnings there, under the first
    ``rheoplan generate``'s output."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONWARNINGS="default")
    r = subprocess.run([sys.executable, "-c", _COMPILE_BOTH_KERNELS], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Warning" not in r.stderr, r.stderr[-2000:]
