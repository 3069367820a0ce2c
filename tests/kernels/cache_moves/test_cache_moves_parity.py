"""The commit's column moves: the numba kernel equals torch's reference bit for bit, in
place, over views of larger buffers, for every dtype; the dispatcher falls back to the
reference where the kernel's precondition fails, with the same result."""

from __future__ import annotations

import pytest
import torch

from rheoplan.kernels.cache_moves import cpu, move_columns, reference


def _layers(seed: int, rows: int, dtype, width: int = 12, spare: int = 5, n: int = 3):
    """``n`` (keys, values) pairs ``[rows, 2, width, 4]``, each a prefix view of a buffer
    with ``spare`` more columns (as ``GrowingLayer`` hands them out), values of another
    head dimension than keys."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        kb = torch.randn(rows, 2, width + spare, 4, generator=g).to(dtype)
        vb = torch.randn(rows, 2, width + spare, 6, generator=g).to(dtype)
        out.append((kb[:, :, :width], vb[:, :, :width]))
    return out


def _paths(seed: int, rows: int, q: int):
    """Root-to-node-like paths: start at 0, strictly increasing, within ``q`` tree columns."""
    g = torch.Generator().manual_seed(seed)
    paths = []
    for _ in range(rows):
        p, j = [0], 0
        while torch.rand((), generator=g) < 0.7 and j < q - 1:
            j += int(torch.randint(1, q - j, (), generator=g))
            p.append(j)
        paths.append(p)
    return paths


def _clone(layers):
    return [(k.clone(), v.clone()) for k, v in layers]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_equals_reference(dtype, rows, seed):
    start, q = 5, 7
    layers = _layers(seed, rows, dtype)
    paths = _paths(seed, rows, q)
    assert cpu.paths_apply(paths) and all(cpu.tensor_applies(x, rows) for kv in layers for x in kv)
    want, got = _clone(layers), layers
    reference.move_columns(want, start, paths)
    cpu.move_columns(got, start, paths)
    for (wk, wv), (gk, gv) in zip(want, got):
        assert torch.equal(wk.view(torch.uint8), gk.view(torch.uint8))
        assert torch.equal(wv.view(torch.uint8), gv.view(torch.uint8))


def test_reference_moves_what_the_docstring_says():
    (k, v), = _layers(0, 1, torch.float32, width=10, n=1)
    before = k.clone()
    reference.move_columns([(k, v)], 3, [[0, 2, 5]])
    assert torch.equal(k[:, :, :4], before[:, :, :4])  # prefix and the root stay
    assert torch.equal(k[:, :, 4], before[:, :, 5]) and torch.equal(k[:, :, 5], before[:, :, 8])
    assert torch.equal(k[:, :, 6:], before[:, :, 6:])  # the rest is left as it was


def test_moves_write_only_inside_the_view():
    """The kernel reads the view's strides: the buffer's spare columns are not touched."""
    layers = _layers(1, 2, torch.bfloat16, width=9, spare=4, n=1)
    (k, v), = layers
    buf = k._base if k._base is not None else k
    spare = buf[:, :, 9:].clone()
    cpu.move_columns(layers, 4, [[0, 3, 4], [0, 1]])
    assert torch.equal(buf[:, :, 9:], spare)


@pytest.mark.parametrize("case", ["backward_path", "grad", "noncontiguous_last_axis"])
def test_dispatcher_falls_back_to_the_reference(case):
    """A path that reads before the column it writes, a tensor that needs its gradient, or
    one whose last axis is strided: ``move_columns`` runs the reference (same result)."""
    start = 2
    layers = _layers(4, 2, torch.float32, width=8)
    paths = [[0, 3, 5], [0, 1]]
    if case == "backward_path":
        paths = [[0, 3, 1], [0, 1]]  # column start+1 is read after it was written
        assert not cpu.paths_apply(paths)
    elif case == "grad":
        layers = [(k.clone().requires_grad_(), v) for k, v in layers]
        assert not cpu.tensor_applies(layers[0][0], 2)
    else:
        layers = [(k.transpose(1, 3).contiguous().transpose(1, 3), v) for k, v in layers]
        assert not cpu.tensor_applies(layers[0][0], 2)
    want = [(k.detach().clone(), v.clone()) for k, v in layers]
    reference.move_columns(want, start, paths)
    with torch.no_grad():
        move_columns(layers, start, paths)
    for (wk, wv), (gk, gv) in zip(want, layers):
        assert torch.equal(wk, gk.detach()) and torch.equal(wv, gv)


def test_a_backward_path_would_break_the_kernel():
    """Why ``paths_apply`` exists: run in place on a path that goes back, the kernel reads
    an entry it already overwrote, and differs from the reference."""
    layers = _layers(2, 1, torch.float32, width=8, n=1)
    want = _clone(layers)
    reference.move_columns(want, 1, [[0, 3, 1]])
    cpu.move_columns(layers, 1, [[0, 3, 1]])
    assert not torch.equal(want[0][0], layers[0][0])
