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

Few-row products (float32 and bfloat16): where torch's products of a few rows are slow, as
on a 2-core AVX2-only AMD EPYC (in float32 2 rows cost twice 1, with MKL and with oneDNN
alike; in bfloat16, which oneDNN cannot pack there, 8 rows cost seven times 1),
``PackedLinear(few_rows=True)`` sends products of at most ``MAX_ROWS`` (32) rows to the
numba kernel ``rheoplan.kernels.linear.cpu`` (each weight row read once for all rows; a
row's result the same bits whatever the rows beside it) and the rest to the packed or the
plain product. ``few_rows_span`` decides by timing every matrix of the model in turn at
``FEW_ROWS_TIMED`` rows, as a forward reads them, and names the fewest rows from which the
kernel pays (``PackedLinear(few_rows=N)``; in bfloat16 on that EPYC, 2: a lone row there
takes torch's product, so a 1-token step and a tree forward round differently, as with
torch's products alone, which bfloat16 never promised otherwise) and, timing a
prefill-sized product too, whether the kernel serves prompts as well (``prefill=True``;
bfloat16 on that EPYC); ``pack_if_it_pays`` runs both measurements.

Sibling products as one: a Llama layer's q, k and v projections read the same input, as
do its gate and up projections (``SIBLINGS``). ``pack_linears(fuse=True)`` runs each set as
one product of the concatenated weights (``FusedPart`` over a ``_SharedProduct``): one
call and one read of the input instead of three or two; through the few-row kernel each
part gets the bits of its own product. ``fusing_decision`` times it on the model and
``pack_where_it_pays`` fuses where it pays.

The module keeps the original ``weight`` and ``bias`` parameters (tied weights stay tied,
``state_dict`` is unchanged); the packed copy is an extra buffer of the same size, made
again by ``repack`` if the weights change. Inference only: the packed path has no
gradient, so a module in training mode with grad enabled uses the plain product.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import torch

from rheoplan.costmodel import cache_key, cache_read, cache_write, remeasure_requested
from rheoplan.kernels.linear import cpu as few_row_kernel

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


#: how many times a ``PackedLinear`` (re)packed its weight in this process (``pack_count``)
_PACKS = [0]


def pack_count() -> int:
    """How many times a ``PackedLinear`` was packed or repacked in this process so far: a
    caller that keeps weight arrays across calls (``rheoplan.models.lean_llama``) reads
    them again when this moved (a repack may replace an array, a shared product too)."""
    return _PACKS[0]


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` whose product runs faster than the eager one (see the module doc):
    its weight packed for oneDNN once (``onednn``) and/or few-row products through the
    numba kernel ``rheoplan.kernels.linear.cpu`` (``few_rows``: float32 or bfloat16,
    products of ``few_rows`` to ``MAX_ROWS`` rows, ``True`` meaning from one row, and of
    any more rows too with ``prefill``; the rest take the packed or the plain product)."""

    def __init__(self, linear: torch.nn.Linear, onednn: bool = True, few_rows: int = 0,
                 prefill: bool = False) -> None:
        super().__init__()
        if not (isinstance(few_rows, int) and 0 <= few_rows <= few_row_kernel.MAX_ROWS):
            raise ValueError(f"few_rows={few_rows!r} is out of range: allowed an int (or bool) from 0 (off) to "
                             f"{few_row_kernel.MAX_ROWS}, the fewest rows the kernel multiplies")
        if not (onednn or few_rows):
            raise ValueError("PackedLinear needs onednn=True or few_rows >= 1 (else keep the nn.Linear)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if prefill and not few_rows:
            raise ValueError("prefill=True needs few_rows >= 1: it widens the few-row kernel's span")
        self.onednn, self.few_rows, self.prefill = onednn, int(few_rows), bool(prefill)
        self._most = sys.maxsize if prefill else few_row_kernel.MAX_ROWS
        self._packed = None
        self._rows_w = None  # the weight as the few-row kernel reads it (a numpy view, no copy)
        self.repack()

    def repack(self) -> None:
        """Pack the current weight again (after the weights were changed in place or
        replaced)."""
        _PACKS[0] += 1
        with torch.no_grad():
            if self.onednn:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            if self.few_rows:
                # a view of the parameter, so in-place changes reach the kernel; a copy only
                # where the weight is not contiguous (then ``repack`` after changing it)
                self._rows_w = few_row_kernel.weight_array(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.training and torch.is_grad_enabled()) or x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        # ``rows_served`` is 0 where the kernel does not serve ``x``; 211 calls per forward
        if self._rows_w is not None and few_row_kernel.rows_served(x, self.weight, self._most) >= self.few_rows:
            return few_row_kernel.rows_times(x, self._rows_w, self.bias)
        if self._packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    @property
    def kind(self) -> str:
        """``'packed'``, ``'few-rows'`` or ``'packed few-rows'`` (``'few-rows from N'`` where
        the kernel starts at ``N`` > 1 rows; ``'... and prefill'`` where it serves any more
        rows too)."""
        few = ("few-rows" if self.few_rows == 1 else f"few-rows from {self.few_rows}") + (
            " and prefill" if self.prefill else "")
        return " ".join(k for k, on in (("packed", self.onednn), (few, self.few_rows)) if on)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.kind}")


class _SharedProduct:
    """One product for sibling linears that multiply the same input (``FusedPart``): their
    weights (and biases) concatenated into one matrix, run as one ``PackedLinear``, and the
    last input's result kept per Python thread until every part has taken its columns.

    Why: a Llama layer's q, k and v projections read the same normed hidden states, its
    gate and up projections too; as one product each input row is read once per set and
    the per-call costs (14 / 19 us through the few-row kernel in float32 / bfloat16, 210
    calls per SmolLM2 forward) are paid once: on the AVX2-only AMD EPYC in bfloat16, one row through q, k and
    v took 54.9 us apart and 33.7 us as one product, gate and up 93.6 against 78.7
    (docs/results.md, "Sibling products as one")."""

    def __init__(self, linears: list[torch.nn.Linear], onednn: bool, few_rows: int, prefill: bool) -> None:
        self.weights = [m.weight for m in linears]  # the parts' parameters, for ``repack``
        self.biases = [m.bias for m in linears]
        self.settings = (onednn, few_rows, prefill)
        ends = torch.tensor([m.out_features for m in linears]).cumsum(0).tolist()
        self.spans = list(zip([0] + ends[:-1], ends))  # each part's columns of the product
        self.product: PackedLinear | None = None
        self.repack()  # sets ``product`` and ``_last``

    def repack(self) -> None:
        """Concatenate the parts' current weights again (a copy: the parts' parameters stay
        as they are, so ``state_dict`` does not change)."""
        with torch.no_grad():
            w = torch.cat([t.detach() for t in self.weights])
            whole = torch.nn.Linear(w.shape[1], w.shape[0], bias=self.biases[0] is not None,
                                    device="meta", dtype=w.dtype)
            whole.weight = torch.nn.Parameter(w, requires_grad=False)
            if self.biases[0] is not None:
                whole.bias = torch.nn.Parameter(torch.cat([t.detach() for t in self.biases]), requires_grad=False)
            self.product = PackedLinear(whole, *self.settings)
        self._last = threading.local()  # results of the old weights are stale

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Part ``i``'s columns of the product of ``x``: computed for every part on the first
        call with this ``x`` (the same tensor, unchanged since: its version counter), then
        taken from the kept result. A caller that changes ``x`` in place between two parts,
        or gives the parts different inputs, gets a fresh product: right, only slower. An
        inference tensor (``torch.inference_mode``) has no version counter: each part then
        runs the whole product."""
        a, b = self.spans[i]
        if x.is_inference():  # no version counter to tell a changed input: no result kept
            return self.product.forward(x)[..., a:b]
        last = self._last
        version = x._version
        if getattr(last, "x", None) is not x or last.version != version:
            # ``forward`` directly: the product is no submodule, so no hooks to run (60 calls a forward)
            last.out, last.x, last.version, last.left = self.product.forward(x), x, version, len(self.spans)
        out = last.out[..., a:b]
        last.left -= 1
        if last.left <= 0:  # every part had its turn: let the input and the result go
            last.out = last.x = None
        return out


class FusedPart(PackedLinear):
    """One of ``SIBLINGS`` run as part of a ``_SharedProduct``: its own ``weight`` and
    ``bias`` parameters stay (``state_dict`` unchanged, ``unpack_linears`` restores an
    ``nn.Linear`` on them), its product is its columns of the shared one. Outputs: the
    product's columns are views (their rows strided by the shared width), the same numbers
    up to rounding as the part's own product (bit for bit through the few-row kernel,
    whose sums do not depend on the rows beside them)."""

    def __init__(self, linear: torch.nn.Linear, shared: _SharedProduct, index: int) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.onednn, self.few_rows, self.prefill = shared.settings
        self._shared, self._index = shared, index

    def repack(self) -> None:
        """Concatenate the siblings' current weights again (all parts of the set)."""
        self._shared.repack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the shared product's weights are copies without gradients: where autograd records
        # and anything asks for one (or in training), the part's own product keeps it right
        if x.dtype != self.weight.dtype or (torch.is_grad_enabled() and (
                self.training or x.requires_grad or self.weight.requires_grad)):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self._shared.part(x, self._index)

    @property
    def kind(self) -> str:
        return f"{super().kind} fused"


def shared_product(*parts: torch.nn.Module) -> PackedLinear | None:
    """The one product behind ``parts`` where they are every ``FusedPart`` of one shared
    product in its order (their outputs are its columns, part after part), else None. A
    caller that needs all the parts' outputs (``rheoplan.models.lean_llama``) then calls it
    once and reads the columns itself, instead of a ``FusedPart.forward`` per part."""
    first = parts[0]
    if type(first) is not FusedPart:
        return None
    shared = first._shared
    if len(shared.spans) != len(parts):
        return None
    for i, p in enumerate(parts):  # a plain loop, no generator: asked for every layer of every forward
        if type(p) is not FusedPart or p._shared is not shared or p._index != i:
            return None
    return shared.product


def bfloat16_kernel_span(module: torch.nn.Module) -> tuple[np.ndarray, int, int] | None:
    """``(weight array, fewest rows, most rows)``: the array (``few_row_kernel.weight_array``)
    through which ``module.forward`` multiplies bfloat16 activations by the few-row kernel's
    bfloat16 product with nothing after it, and the rows it does so for (gradients aside:
    see ``bfloat16_kernel_weight``); ``module`` a ``PackedLinear`` (not a part of a shared
    one: ``shared_product`` gives that) of a bfloat16 weight and no bias, the kernel on;
    else None."""
    if type(module) is not PackedLinear or module.bias is not None:
        return None
    w = module._rows_w
    if w is None or w.dtype != np.uint16:
        return None
    return w, module.few_rows, module._most


def bfloat16_kernel_weight(module: torch.nn.Module, rows: int) -> np.ndarray | None:
    """The weight array (``few_row_kernel.weight_array``) through which ``module.forward``
    multiplies ``rows`` rows of bfloat16 activations where that is the few-row kernel's
    bfloat16 product with nothing after it: ``bfloat16_kernel_span`` gives one, ``rows`` in
    its span, no gradient recorded; else None. A caller holding its operands as arrays
    then gets ``forward``'s bits from ``few_row_kernel.bfloat16_rows_into``
    (``rheoplan.models.lean_llama``)."""
    if torch.is_grad_enabled():
        return None
    span = bfloat16_kernel_span(module)
    if span is None or not span[1] <= rows <= span[2]:
        return None
    return span[0]


def pack_linears(model: torch.nn.Module, onednn: bool = True, few_rows: int = 0, prefill: bool = False,
                 fuse: bool = False) -> int:
    """Replace every ``nn.Linear`` of ``model`` in a ``PACKED_DTYPES`` dtype (in place) by a
    ``PackedLinear(onednn=..., few_rows=..., prefill=...)`` (``few_rows``: the fewest rows
    the kernel multiplies, 0 = never; ``prefill``: beyond ``MAX_ROWS`` rows too); with
    ``fuse``, siblings that read one input (``SIBLINGS``: a layer's q / k / v, its gate / up)
    become ``FusedPart``s of one product instead. Returns how many linears were replaced (0
    where neither is available: oneDNN packing for the dtype, the few-row kernel for float32
    and bfloat16)."""
    n = 0
    for parent in list(model.modules()):
        if fuse:
            n += _fuse_children(parent, onednn, few_rows, prefill)
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            settings = _settings(child, onednn, few_rows, prefill)
            if settings is not None:
                setattr(parent, name, PackedLinear(child, *settings))
                n += 1
    return n


def _settings(lin: torch.nn.Linear, onednn: bool, few_rows: int, prefill: bool) -> tuple[bool, int, bool] | None:
    """``PackedLinear``'s ``(onednn, few_rows, prefill)`` for ``lin`` as ``pack_linears`` asks
    them, narrowed to what its dtype and device allow; None where nothing is available."""
    dt, dev = lin.weight.dtype, lin.weight.device
    use_onednn = onednn and packing_available(dt, dev)
    use_few = few_rows if few_rows_available(dt, dev) else 0
    if not (use_onednn or use_few):
        return None
    return use_onednn, use_few, prefill and bool(use_few)


#: sibling linears of one module that multiply the same input, as transformers' Llama-family
#: layers (and the EAGLE-3 head) call them: ``pack_linears(fuse=True)`` runs each set as one
#: product of the concatenated weights
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fuse_children(parent: torch.nn.Module, onednn: bool, few_rows: int, prefill: bool) -> int:
    """Replace each ``SIBLINGS`` set among ``parent``'s children that can share one product
    (``_shareable``) by ``FusedPart``s; returns how many linears were replaced."""
    n = 0
    for names in SIBLINGS:
        lins = _shareable(parent, names)
        settings = None if lins is None else _settings(lins[0], onednn, few_rows, prefill)
        if settings is None:
            continue
        shared = _SharedProduct(lins, *settings)
        for i, (name, lin) in enumerate(zip(names, lins)):
            setattr(parent, name, FusedPart(lin, shared, i))
        n += len(lins)
    return n


def _shareable(parent: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    """``parent``'s children ``names`` when they can run as one product: all plain
    ``nn.Linear`` with one input width, dtype and device, all with or all without a bias."""
    lins = [parent._modules.get(name) for name in names]
    if not all(type(m) is torch.nn.Linear for m in lins):
        return None
    first = lins[0]
    if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
           or m.weight.device != first.weight.device or (m.bias is None) != (first.bias is None) for m in lins):
        return None
    return lins


def few_rows_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the few-row kernel serves ``dtype`` on ``device`` (float32 and bfloat16 on
    the CPU: ``few_row_kernel.DTYPES``)."""
    return dtype in few_row_kernel.DTYPES and torch.device(device).type == "cpu"


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
    kinds = {(m.onednn, m.few_rows, m.prefill) for m in model.modules() if isinstance(m, PackedLinear)}
    fuse = any(isinstance(m, FusedPart) for m in model.modules())
    unpack_linears(model)
    try:
        yield model
    finally:
        for onednn, few_rows, prefill in kinds:  # one kind per model as the loader packs it
            pack_linears(model, onednn=onednn, few_rows=few_rows, prefill=prefill, fuse=fuse)


#: ``packing_pays``: packed may be this much slower than plain at a row count where the two
#: are close (one row in float32 measured a tie, at 16 rows packed was three times faster)
PACKING_SLACK = 1.05


def _largest_body_linear(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The largest ``nn.Linear`` of ``model`` that is not its output projection (most of a
    forward's time), None when it has none."""
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not lins:
        return None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 1 << 62
    body = [m for m in lins if m.out_features < vocab] or lins
    return max(body, key=lambda m: m.weight.numel())


def _time_pairs(lins: list[torch.nn.Linear], new, old, rows: tuple[int, ...], reps: int
                ) -> list[tuple[float, float]]:
    """``(new, old)`` best-of-``reps`` seconds per ``r`` of ``rows``: each of ``new`` and
    ``old`` is called with one random ``[r, in_features]`` input per linear of ``lins``,
    the two alternating call by call."""
    times = []
    with torch.no_grad():
        for r in rows:
            xs = [torch.randn(r, m.in_features, dtype=m.weight.dtype, device=m.weight.device) for m in lins]
            best = [float("inf"), float("inf")]
            new(xs), old(xs)
            for _ in range(reps):
                for i, f in enumerate((new, old)):
                    t0 = time.perf_counter()
                    f(xs)
                    best[i] = min(best[i], time.perf_counter() - t0)
            times.append((best[0], best[1]))
    return times


def packing_pays(model: torch.nn.Module, rows: tuple[int, ...] = (1, 16), reps: int = 30) -> bool | None:
    """Time the largest ``nn.Linear`` of ``model`` plain and packed at each of ``rows``
    (a few tens of milliseconds); True when packed is faster summed over ``rows`` and at
    no row count more than ``PACKING_SLACK`` times slower, None when packing is not
    available for this model."""
    lin = _largest_body_linear(model)
    if lin is None or not packing_available(lin.weight.dtype, lin.weight.device):
        return None
    return packing_decision(_time_pairs([lin], _in_turn([PackedLinear(lin)]), _in_turn([lin]), rows, reps))


#: ``few_rows_span``'s row counts: a one-token step, small and large tree forwards, and the
#: most rows the kernel serves (``MAX_ROWS``)
FEW_ROWS_TIMED = (1, 2, 4, 8, few_row_kernel.MAX_ROWS)
#: ``few_rows_span``'s prefill-sized product (a 128-token prompt), timed twice
PREFILL_TIMED = 128


def few_rows_span(model: torch.nn.Module, packed: bool, rows: tuple[int, ...] = FEW_ROWS_TIMED,
                  reps: int = 5) -> tuple[int, bool] | None:
    """Time one product through every ``nn.Linear`` of ``model`` in turn, through the
    few-row kernel and through the product each would run otherwise (oneDNN's packed one
    when ``packed``, else the plain one), at each of ``rows`` and at ``PREFILL_TIMED`` rows;
    return ``(first, prefill)``: ``first`` the fewest of ``rows`` from which the kernel pays
    (``packing_decision``'s rule over that row count and every larger one; 0 when it pays
    from none), ``prefill`` whether it is also faster at ``PREFILL_TIMED`` rows (then it
    serves any number of rows from ``first``); None when the kernel does not serve this
    model's dtype.

    From a row count, not all or nothing: in bfloat16 on the AVX2-only AMD EPYC torch's
    one-row products (17.6-18.0 ms for SmolLM2-135M's matrices and output projection) beat
    the kernel's (20.2-21.4, with its per-call costs) while from 2 rows the kernel wins by
    1.5x to 6x; and the prompts' prefill through torch's bfloat16 products took 3.7 times
    as long as in float32 (docs/results.md, "bfloat16 few-row products").

    Every matrix in turn, as a forward reads them, not the largest one again and again:
    timed on the largest matrix alone, hot in the caches, the rule once decided against
    the kernel on the AVX2-only AMD EPYC (one-row timings there are close: 111 against
    129 us for 1536 x 576 in a later check) while a forward's products, whose weights come
    from memory, ran faster through it (a 1-token forward 45 against 57 ms)."""
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not lins or not few_rows_available(lins[0].weight.dtype, lins[0].weight.device):
        return None
    kernel = _in_turn([PackedLinear(m, onednn=False, few_rows=True, prefill=True) for m in lins])
    other = _in_turn([PackedLinear(m) for m in lins] if packed else lins)
    times = _time_pairs(lins, kernel, other, rows, reps)
    first = next((r for i, r in enumerate(rows) if packing_decision(times[i:])), 0)
    if not first:
        return 0, False
    (new, old), = _time_pairs(lins, kernel, other, (PREFILL_TIMED,), 2)
    return first, new < old


def _in_turn(mods: list[torch.nn.Module]):
    """One call of every module of ``mods`` on its slice of ``xs`` (one input per module)."""
    def run(xs: list[torch.Tensor]) -> None:
        for m, x in zip(mods, xs):
            m(x)
    return run


def packing_decision(times: list[tuple[float, float]]) -> bool:
    """``packing_pays``' rule on ``(packed, plain)`` seconds per row count: packed is faster
    summed over the row counts and at none more than ``PACKING_SLACK`` times slower."""
    return (sum(p for p, _ in times) < sum(e for _, e in times)
            and all(p <= PACKING_SLACK * e for p, e in times))


#: how the loaders run a model's products, named in the keys of the caches that hold
#: timings made so (``rheoplan.probe``'s dtype probes): records timed with another rule or
#: another version of the kernel are measured again
PACKING_RULE = f"packed and few-row products ({few_row_kernel.VERSION}) when they pay"

#: ``few_rows_decision``'s cache file (under ``rheoplan.costmodel.cache_dir()``)
FEW_ROWS_CACHE = "few_rows.json"


def few_rows_decision(model: torch.nn.Module, packed: bool) -> tuple[int, bool] | None:
    """``few_rows_span``, cached per machine, torch version, thread count and the model's
    matrices (their count, shapes and dtype): timing every matrix took 3-6 s for
    SmolLM2-135M on the AVX2-only AMD EPYC, at every load. ``RHEOPLAN_REMEASURE=1``
    measures again."""
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not lins or not few_rows_available(lins[0].weight.dtype, lins[0].weight.device):
        return None
    shapes = sorted({tuple(m.weight.shape) for m in lins})
    key = cache_key("few_rows", f"{len(lins)} matrices {shapes}", lins[0].weight.device, packed=packed,
                    kernel=few_row_kernel.VERSION, dtype=str(lins[0].weight.dtype).removeprefix("torch."))
    rec = None if remeasure_requested() else cache_read(FEW_ROWS_CACHE, key)
    if (rec is not None and type(rec.get("from_rows")) is int and 0 <= rec["from_rows"] <= few_row_kernel.MAX_ROWS
            and type(rec.get("prefill")) is bool):
        return rec["from_rows"], rec["prefill"]
    span = few_rows_span(model, packed=packed)
    if span is not None:
        cache_write(FEW_ROWS_CACHE, key, {"from_rows": span[0], "prefill": span[1]})
    return span


#: ``fusing_pays``' row counts: a one-token step and tree forwards
FUSING_TIMED = (1, 2, 4, 8)
#: ``fusing_decision``'s cache file (under ``rheoplan.costmodel.cache_dir()``)
FUSING_CACHE = "fusing.json"


def _sibling_sets(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Every ``SIBLINGS`` set of ``model`` that can run as one product (``_shareable``), as a
    forward reads them (a layer's q, k, v, then its gate, up)."""
    sets = (_shareable(parent, names) for parent in model.modules() for names in SIBLINGS)
    return [lins for lins in sets if lins is not None]


def fusing_pays(model: torch.nn.Module, onednn: bool, few_rows: int, prefill: bool,
                rows: tuple[int, ...] = FUSING_TIMED, reps: int = 5) -> bool | None:
    """Time every ``SIBLINGS`` set of ``model`` in turn, as ``pack_linears`` would run it
    with these settings, its parts apart and as one product (``pack_linears(fuse=True)``),
    at each of ``rows``; True when one product is faster by ``packing_decision``'s rule,
    None when the model has no such set or nothing is packed for its dtype."""
    sets = _sibling_sets(model)
    settings = _settings(sets[0][0], onednn, few_rows, prefill) if sets else None
    if settings is None:
        return None
    apart = [[PackedLinear(m, *settings) for m in lins] for lins in sets]
    shared = [_SharedProduct(lins, *settings) for lins in sets]

    def run_apart(xs):
        for parts, x in zip(apart, xs):
            for m in parts:
                m(x)

    def run_fused(xs):
        for sh, x in zip(shared, xs):
            for i in range(len(sh.spans)):
                sh.part(x, i)

    # one input per set, shared by its parts
    return packing_decision(_time_pairs([lins[0] for lins in sets], run_fused, run_apart, rows, reps))


def fusing_decision(model: torch.nn.Module, onednn: bool, few_rows: int, prefill: bool) -> bool | None:
    """``fusing_pays``, cached per machine, torch version, thread count, the settings and the
    sibling sets' shapes (a second or two for SmolLM2-135M). ``RHEOPLAN_REMEASURE=1``
    measures again."""
    sets = _sibling_sets(model)
    if not sets or _settings(sets[0][0], onednn, few_rows, prefill) is None:
        return None
    shapes = sorted({tuple(tuple(m.weight.shape) for m in lins) for lins in sets})
    w = sets[0][0].weight
    key = cache_key("fusing", f"{len(sets)} sets {shapes}", w.device, onednn=onednn, few_rows=few_rows,
                    prefill=prefill, kernel=few_row_kernel.VERSION, dtype=str(w.dtype).removeprefix("torch."))
    rec = None if remeasure_requested() else cache_read(FUSING_CACHE, key)
    if rec is not None and type(rec.get("fuse")) is bool:
        return rec["fuse"]
    fuse = fusing_pays(model, onednn, few_rows, prefill)
    if fuse is not None:
        cache_write(FUSING_CACHE, key, {"fuse": fuse})
    return fuse


def pack_where_it_pays(model: torch.nn.Module) -> tuple[int, bool | None, tuple[int, bool] | None]:
    """Measure (``packing_pays``, then ``few_rows_decision``, then ``fusing_decision``) and
    pack ``model``'s linears so; returns ``(linears replaced, packing pays,
    few_rows_decision's (first, prefill))`` (None: not available; first 0: the kernel pays
    from no row count). Whether sibling products run as one shows in the model
    (``FusedPart`` modules)."""
    onednn = packing_pays(model)
    span = few_rows_decision(model, packed=bool(onednn))
    first, prefill = span or (0, False)
    if not (onednn or first):
        return 0, onednn, span
    fuse = bool(fusing_decision(model, bool(onednn), first, prefill))
    return pack_linears(model, onednn=bool(onednn), few_rows=first, prefill=prefill, fuse=fuse), onednn, span


def pack_if_it_pays(model, what: str, log=None) -> bool:
    """Pack ``model``'s linear weights for oneDNN once and/or route its few-row products
    through the numba kernel (less time, the same outputs up to rounding: see the module
    doc) where each pays here (``packing_pays`` times its largest matrix, ``few_rows_decision``
    every matrix, cached); prints the decisions. Returns whether any linear was replaced."""
    log = sys.stderr if log is None else log
    n, onednn, span = pack_where_it_pays(model)
    few, prefill = span or (None, False)
    if onednn:
        print(f"{what}: {n} linear weights packed for oneDNN (measured faster here; same outputs up to rounding)",
              file=log)
    elif onednn is False:
        print(f"{what}: linear weights not packed (packing measured no faster here)", file=log)
    if few:
        timed = [r for r in FEW_ROWS_TIMED if r >= few] + ([PREFILL_TIMED] if prefill else [])
        fewer = "" if few == 1 else "; fewer rows keep torch's product, measured faster there"
        upto = "or more" if prefill else f"to {few_row_kernel.MAX_ROWS}"
        print(f"{what}: products of {few} {upto} rows run the few-row numba kernel "
              f"(measured faster here at {', '.join(map(str, timed))} rows{fewer}; same outputs up to rounding)",
              file=log)
    elif few == 0:
        print(f"{what}: few-row products keep torch's kernels (the numba kernel measured no faster here)", file=log)
    fused = sum(isinstance(m, FusedPart) for m in model.modules())
    if fused:
        print(f"{what}: {fused} sibling projections (q / k / v, gate / up) run as one product per set "
              "(measured faster here; same outputs up to rounding)", file=log)
    elif any(isinstance(m, PackedLinear) and name.rpartition(".")[2] == names[0]
             for name, m in model.named_modules() for names in SIBLINGS):
        print(f"{what}: sibling projections run apart (one product per set measured no faster here)", file=log)
    return n > 0
