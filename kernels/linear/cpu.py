"""numba CPU path of the few-row linear product (same signature as ``reference.linear``).

Why: at decode time a target forward multiplies 1 to 32 rows by each weight matrix. On a
2-core AVX2-only AMD EPYC (no AVX-512), torch's float32 products (MKL's, and oneDNN's
packed ones alike) cost twice as much for 2 rows as for 1: the 1536 x 576 MLP matrix took
93 / 228 / 256 us at 1 / 2 / 4 rows, and a SmolLM2-135M forward of 2 tokens 88 ms against
57 for one, so every drafted node was dear. This kernel reads each weight row once for
all input rows (two input rows per pass over it) and splits the output columns over the
threads: the decoder stack's 210 matrices, one product each, took 29 / 37 / 58 ms at 8 /
16 / 32 rows against torch's 49 / 59 / 76 (docs/results.md, "Few-row products" and its
second round). Whether it pays is measured on the model
(``rheoplan.models.packed_linear.few_rows_pays``), not read from CPU flags.

Rounding: each output is one dot product summed in a fixed order (the vectorised
reduction ``reassoc`` allows), the same order whatever the other rows and whatever the
number of threads, so a token's product does not depend on the rows beside it (a 9-token
tree forward and a 1-token step agree bit for bit in these products, which torch's do
not promise). Against torch's product it differs by float32 rounding (about 1e-6
relative). Only ``reassoc`` and ``contract`` (FMA) are allowed: NaN and infinities
propagate as in torch's product."""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import njit, prange

#: rows up to which ``linear`` runs the kernel; more rows (a prompt's prefill) go to torch,
#: whose blocked products win there (on the AVX2-only AMD EPYC, a forward's matrices took
#: 58 ms through the kernel against torch's 76 at 32 rows, 88 against 107 at 48, tied at 64)
MAX_ROWS = 32

#: this kernel's blocking, part of the keys of the caches that hold timings made with it
#: (``rheoplan.loading.speed_tag``, the dtype probes): a record timed with another version
#: of the kernel is measured again
VERSION = f"rows in pairs, at most {MAX_ROWS}"

_FAST = {"reassoc", "contract"}

# numba's ``workqueue`` threading layer (where neither OpenMP nor TBB is found) aborts the
# process when two Python threads launch parallel kernels at once (a server decoding in
# threads would): there the calls take turns. Which layer numba uses is known only after
# its first parallel launch, so the first call takes the lock too.
_LOCK = threading.Lock()
_one_at_a_time = [True]


@njit(parallel=True, fastmath=_FAST, cache=True)
def _rows_times_weight(x, w, out):
    """``out[i, j] = sum_k x[i, k] * w[j, k]`` for float32 ``x [r, K]``, ``w [N, K]`` (both
    C-contiguous). Blocks of four weight rows (each read once for all ``r`` rows), input rows
    two at a time: eight accumulators, so each weight element loaded serves two rows (at 8
    and 16 rows a forward's matrices and its output projection took 36 / 47 ms against 42 /
    63 one row at a time). An odd last row is paired with itself: every row goes through the same loop,
    so its sums are the same bits whatever rows are beside it (tests/kernels/linear)."""
    r, k_len = x.shape
    n = w.shape[0]
    blocks = (n + 3) // 4
    for jb in prange(blocks):
        j = jb * 4
        if j + 4 <= n:
            for i in range(0, r, 2):
                i1 = i + 1 if i + 1 < r else i
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                b0 = np.float32(0.0)
                b1 = np.float32(0.0)
                b2 = np.float32(0.0)
                b3 = np.float32(0.0)
                for k in range(k_len):
                    u = x[i, k]
                    v = x[i1, k]
                    w0 = w[j, k]
                    w1 = w[j + 1, k]
                    w2 = w[j + 2, k]
                    w3 = w[j + 3, k]
                    a0 += u * w0
                    a1 += u * w1
                    a2 += u * w2
                    a3 += u * w3
                    b0 += v * w0
                    b1 += v * w1
                    b2 += v * w2
                    b3 += v * w3
                out[i, j] = a0
                out[i, j + 1] = a1
                out[i, j + 2] = a2
                out[i, j + 3] = a3
                out[i1, j] = b0
                out[i1, j + 1] = b1
                out[i1, j + 2] = b2
                out[i1, j + 3] = b3
        else:  # the last 1-3 weight rows
            for jj in range(j, n):
                for i in range(r):
                    a = np.float32(0.0)
                    for k in range(k_len):
                        a += x[i, k] * w[jj, k]
                    out[i, jj] = a


def rows_served(x: torch.Tensor, weight: torch.Tensor) -> int:
    """How many rows of ``x`` the kernel multiplies by ``weight [N, K]``: all of them when
    ``x`` is float32 on the CPU with ``K`` features, 1 to ``MAX_ROWS`` rows, and autograd
    does not need the product; else 0 (torch's product). The weight's own dtype and device
    are ``supported``'s to check (``PackedLinear`` fixes them when it is built, and calls
    this on every product)."""
    k = weight.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != k or k == 0 or x.device.type != "cpu":
        return 0
    rows = x.numel() // k
    if not 0 < rows <= MAX_ROWS or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return 0
    return rows


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs the kernel for these operands (float32 on the CPU, at most
    ``MAX_ROWS`` rows, no autograd: ``rows_served``); otherwise it runs torch's product."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and rows_served(x, weight) > 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[..., N]``: the kernel
    where ``supported``, torch's product elsewhere."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if not supported(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    w = weight.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    out = rows_times(x.detach().reshape(-1, x.shape[-1]), w.numpy())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], w.shape[0])


# the thread count numba was last set to, per Python thread (numba's setting is per thread)
_threads = threading.local()


def rows_times(x2: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """``x2 [r, K] @ w.T`` for float32 ``x2`` on the CPU (1 <= r <= ``MAX_ROWS``, no
    autograd: ``rows_served``) and ``w`` a C-contiguous float32 ``[N, K]`` array, without
    ``linear``'s checks and conversions: the hot path of ``PackedLinear``, which holds ``w``
    and checks ``rows_served`` once per call (the path through ``linear`` cost 26 us per
    call around a 2-4 us launch, this one 17-20; docs/results.md)."""
    out = np.empty((x2.shape[0], w.shape[0]), np.float32)
    threads = torch.get_num_threads()
    if getattr(_threads, "n", 0) != threads:  # the same share of the cores as torch's products
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        _threads.n = threads
    xn = x2.contiguous().numpy()
    if _one_at_a_time[0]:
        with _LOCK:
            _rows_times_weight(xn, w, out)
            _one_at_a_time[0] = numba.threading_layer() == "workqueue"
    else:
        _rows_times_weight(xn, w, out)
    return torch.from_numpy(out)
