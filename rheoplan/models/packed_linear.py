"""Linear layers with their weights packed once for oneDNN (CPU, bfloat16 and float32).

An eager ``torch.nn.functional.linear`` in bfloat16 on a CPU hands the weight to oneDNN,
which reorders it into its blocked layout on every call. For the small matrices of a
small model at decode time (1 to 64 rows) that reorder costs as much as the product:
SmolLM2-135M's MLP projections take 107-140 us per call eagerly and 33-57 us with the
weight packed once (the 2-core AMD EPYC, one row). ``pack_linears`` packs every
``nn.Linear`` of a model once (``torch.ops.mkldnn._reorder_linear_weight``) and runs it
through ``torch.ops.mkldnn._linear_pointwise``. In bfloat16 the eager product is oneDNN's
too, on the same numbers, but oneDNN may block the packed and the eager product
differently: on the 2-core AMD EPYC where this was written the outputs were bit-identical
at 1-150 rows; on the 2-core Intel Xeon and the CI machine of 2026-12-03 they are at 1-17
rows, and products of 64 or 150 rows differ in the last bit of some outputs, one bfloat16
rounding (``tests/rheoplan/models/test_packed_linear.py`` checks agreement up to that
rounding for every shape the models use). Only the time changes, up to that rounding: the law a step
samples is the packed model's, as in bfloat16 a 9-token forward's law is its own and may
round a near-tie differently from a 1-token one.

In float32 the eager product is not oneDNN's but the BLAS's (MKL's ``sgemm``), and on the
same machine its few-row products are slow: 2 to 16 rows through the 1536 x 576 MLP matrix
took 95-223 us against 35-76 us packed, and a SmolLM2-135M forward of 2 tokens 65 ms
against 32 (docs/results.md, "Lean steps, fourteenth round"). Packed, a float32 product is
oneDNN's float32 product: as exact as the BLAS's, but summed in another order, so the
outputs differ from the eager ones in the last bits (about 1e-6 relative, as much as the
eager product differs from itself between one row and several).

It is what inductor's weight freezing does inside a compiled graph
(``torch._inductor.config.freezing``), without compiling anything. Whether it pays is
measured on the model itself (``packing_pays``), not read from CPU flags.

The module keeps the original ``weight`` and ``bias`` parameters (tied weights stay tied,
``state_dict`` is unchanged); the packed copy is an extra buffer of the same size, made
again by ``repack`` if the weights change. Inference only: the packed path has no
gradient, so a module in training mode with grad enabled uses the plain product.
"""

from __future__ import annotations

import functools
import sys
import time
from contextlib import contextmanager

import torch


#: the dtypes whose linear weights ``pack_linears`` packs
PACKED_DTYPES = (torch.bfloat16, torch.float32)


def packing_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether this torch build, on this CPU, can pack linear weights for ``dtype`` on
    ``device``: the build has the ops and a tiny weight packs and multiplies (``_packs``)."""
    return (torch.device(device).type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and _packs(dtype))


@functools.lru_cache(maxsize=None)
def _packs(dtype: torch.dtype) -> bool:
    """Pack and multiply a tiny ``dtype`` weight once per process. The ops exist in every
    CPU build, but oneDNN refuses the bfloat16 reorder on a CPU without AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT ("bf16 path needs the cpu support ..."): an AVX2-only AMD EPYC
    (Zen 3) raised it at load before this probe existed. Asking the library, not reading
    CPU flags, follows whatever oneDNN supports in the installed build."""
    try:
        with torch.no_grad():
            w = torch.ones(4, 8, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
        return bool((y == 8).all())
    except RuntimeError:
        return False


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` whose weight is packed for oneDNN once (see the module doc)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.repack()

    def repack(self) -> None:
        """Pack the current weight again (after the weights were changed in place)."""
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.training and torch.is_grad_enabled()) or x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` in a ``PACKED_DTYPES`` dtype (in place) by a ``PackedLinear``;
    returns how many were replaced (0 where packing is not available)."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and packing_available(child.weight.dtype, child.weight.device):
                setattr(parent, name, PackedLinear(child))
                n += 1
    return n


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo ``pack_linears``: plain ``nn.Linear`` modules on the same parameters."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                      device="meta")
                lin.weight = child.weight
                lin.bias = child.bias
                setattr(parent, name, lin)
                n += 1
    return n


@contextmanager
def unpacked(model: torch.nn.Module):
    """Run a block on ``model``'s weights as transformers loaded them: unpack its packed
    linears (if any) for the block and pack them again after, even if it raises (the
    benchmarks time ``generate`` so, as a user without rheoplan has it)."""
    repack = unpack_linears(model) > 0
    try:
        yield model
    finally:
        if repack:
            pack_linears(model)


#: ``packing_pays``: packed may be this much slower than plain at a row count where the two
#: are close (one row in float32 measured a tie, at 16 rows packed was three times faster)
PACKING_SLACK = 1.05


def packing_pays(model: torch.nn.Module, rows: tuple[int, ...] = (1, 16), reps: int = 30) -> bool | None:
    """Time the largest ``nn.Linear`` of ``model`` plain and packed at each of ``rows``
    (a few tens of milliseconds); True when packed is faster summed over ``rows`` and at
    no row count more than ``PACKING_SLACK`` times slower, None when packing is not
    available for this model."""
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not lins or not packing_available(lins[0].weight.dtype, lins[0].weight.device):
        return None
    # the largest matrix that is not the output projection decides (most of a forward's time)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 1 << 62
    body = [m for m in lins if m.out_features < vocab] or lins
    lin = max(body, key=lambda m: m.weight.numel())
    packed = PackedLinear(lin)

    def best(f, x) -> float:
        f(x)
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f(x)
            t.append(time.perf_counter() - t0)
        return min(t)

    times = []
    with torch.no_grad():
        for r in rows:
            x = torch.randn(r, lin.in_features, dtype=lin.weight.dtype, device=lin.weight.device)
            times.append((best(packed, x), best(lambda v: torch.nn.functional.linear(v, lin.weight, lin.bias), x)))
    return packing_decision(times)


def packing_decision(times: list[tuple[float, float]]) -> bool:
    """``packing_pays``' rule on ``(packed, plain)`` seconds per row count: packed is faster
    summed over the row counts and at none more than ``PACKING_SLACK`` times slower."""
    return (sum(p for p, _ in times) < sum(e for _, e in times)
            and all(p <= PACKING_SLACK * e for p, e in times))


def pack_if_it_pays(model, what: str, log=None) -> bool:
    """Pack ``model``'s linear weights for oneDNN once (less time, the same outputs up to
    rounding: see the module doc) when a quick measurement on
    its largest matrix says it pays here; prints the decision."""
    log = sys.stderr if log is None else log
    pays = packing_pays(model)
    if pays:
        n = pack_linears(model)
        print(f"{what}: {n} linear weights packed for oneDNN (measured faster here; same outputs up to rounding)",
              file=log)
    elif pays is False:
        print(f"{what}: linear weights not packed (packing measured no faster here)", file=log)
    return bool(pays)
