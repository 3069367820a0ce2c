"""numba CPU path of the few-row linear product (same signature as ``reference.linear``).

Why: at decode time a target forward multiplies 1 to 16 rows by each weight matrix. On a
2-core AVX2-only AMD EPYC (no AVX-512), torch's float32 products (MKL's, and oneDNN's
packed ones alike) cost twice as much for 2 rows as for 1: the 1536 x 576 MLP matrix took
93 / 228 / 256 us at 1 / 2 / 4 rows, and a SmolLM2-135M forward of 2 tokens 88 ms against
57 for one, so every drafted node was dear. This kernel reads each weight row once for
all input rows, splits the output columns over the threads, and took 53 / 54 / 83 us
(forwards of 1 / 2 / 4 / 8 tokens 45 / 49 / 56 / 69 ms against 57 / 88 / 91 / 107;
docs/results.md, "Few-row products"). Whether it pays is measured on the model
(``rheoplan.models.packed_linear.few_rows_pays``), not read from CPU flags.

Rounding: each output is one dot product summed in a fixed order (the vectorised
reduction ``reassoc`` allows), the same order whatever the other rows and whatever the
number of threads, so a token's product does not depend on the rows beside it (a 9-token
tree forward and a 1-token step agree bit for bit in these products, which torch's do
not promise). Against torch's product it differs by float32 rounding (about 1e-6
relative). Only ``reassoc`` and ``contract`` (FMA) are allowed: NaN and infinities
propagate as in torch's product.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import njit, prange

#: rows up to which ``linear`` runs the kernel; more rows (a prompt's prefill) go to torch,
#: whose blocked products win there
MAX_ROWS = 16

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
    C-contiguous); four weight rows per block so each weight row is read once for all ``r``."""
    r, k_len = x.shape
    n = w.shape[0]
    blocks = (n + 3) // 4
    for jb in prange(blocks):
        j = jb * 4
        if j + 4 <= n:
            for i in range(r):
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for k in range(k_len):
                    v = x[i, k]
                    a0 += v * w[j, k]
                    a1 += v * w[j + 1, k]
                    a2 += v * w[j + 2, k]
                    a3 += v * w[j + 3, k]
                out[i, j] = a0
                out[i, j + 1] = a1
                out[i, j + 2] = a2
                out[i, j + 3] = a3
        else:  # the last 1-3 weight rows
            for jj in range(j, n):
                for i in range(r):
                    a = np.float32(0.0)
                    for k in range(k_len):
                        a += x[i, k] * w[jj, k]
                    out[i, jj] = a


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs the kernel for these operands (float32 on the CPU, at most
    ``MAX_ROWS`` rows, no autograd); otherwise it runs torch's product."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and 0 < rows <= MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[..., N]``: the kernel
    where ``supported``, torch's product elsewhere."""
    if not supported(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    w = weight.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    out = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)  # the same share of the cores as torch's products
    args = (x2.detach().numpy(), w.numpy(), out.numpy())
    if _one_at_a_time[0]:
        with _LOCK:
            _rows_times_weight(*args)
            _one_at_a_time[0] = numba.threading_layer() == "workqueue"
    else:
        _rows_times_weight(*args)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], w.shape[0])
