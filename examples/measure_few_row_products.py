"""Measure SmolLM2-135M's forwards of 1-32 tokens with each kind of linear product.

Kinds: ``torch`` (the model as transformers loads it: MKL's products), ``packed``
(oneDNN's, weights packed once), ``few-rows`` (products of at most 32 rows through the
numba kernel ``rheoplan.kernels.linear.cpu``, the rest torch's) and ``packed few-rows``;
the packed kinds only where this CPU can pack float32 weights. Each forward runs ``n``
chain tokens after a ``--ctx``-token prompt and projects every row through the output
matrix (as the walk projects a tree's nodes); the kinds take turns round by round, and
the median of ``--rounds`` is printed per kind and ``n``, with the largest logit
difference from ``torch``. ``--dtype`` float32 (default) or bfloat16 (the kernel's
bfloat16 path; packed kinds only where this CPU can pack bfloat16 weights).
docs/results.md, "Few-row products" and "bfloat16 few-row products", quote it.

``--products`` times instead the model's matrices alone, one product through each in turn
(as a forward reads them, the output projection left out) at 1-128 rows: the kernel (past
its ``MAX_ROWS`` too), torch's product and oneDNN's packed one; where torch overtakes the
kernel is where ``MAX_ROWS`` belongs on this machine (``PackedLinear(prefill=True)`` where
it never does).

``--hot-cold`` (bfloat16) times the kernel's launch alone (``bfloat16_rows_into``) over the
same matrices at 1-16 rows, each product twice in a row: the first call reads its weight
from memory, as a forward does ("cold": the other matrices streamed through the caches
since), the second from the caches ("hot"). Cold minus hot is the memory time the kernel
does not hide behind its arithmetic; hot gives the arithmetic rate (GMAC/s), cold the
rate at which a pass streams the weights (GB/s). docs/results.md, "Thirty-ninth round",
quotes it.

Usage:
    python examples/measure_few_row_products.py [--rounds 7] [--ctx 150] [--threads 2] [--products]
        [--dtype float32|bfloat16]
    python examples/measure_few_row_products.py --hot-cold --dtype bfloat16 [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from rheoplan.models._hf_common import _cache_kwarg, additive_mask, crop_cache
from rheoplan.models.packed_linear import few_row_kernel, pack_linears, packing_available, unpack_linears
from rheoplan.models.smollm import load_smollm2

TOKENS = (1, 2, 4, 8, 16, 32)
KINDS = {"torch": None, "packed": (True, False), "few-rows": (False, True), "packed few-rows": (True, True)}


def forward(model, cache, ctx: int, n: int) -> torch.Tensor:
    """Logits ``[n, V]`` of ``n`` chain tokens after the ``ctx`` cached ones; the cache is
    cropped back after."""
    tok = torch.arange(n)[None] + 500
    pos = torch.arange(ctx, ctx + n)[None]
    allowed = torch.ones(n, ctx + n, dtype=torch.bool)
    allowed[:, ctx:] = torch.ones(n, n, dtype=torch.bool).tril()
    mask = None if n == 1 else additive_mask(allowed, model.dtype)
    with torch.no_grad():
        h = model.model(input_ids=tok, position_ids=pos, attention_mask=mask, use_cache=True,
                        **{_cache_kwarg(model.model): cache}).last_hidden_state
        crop_cache(cache, ctx)
        return model.lm_head(h[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ctx", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--products", action="store_true", help="time the matrices alone (see the module doc)")
    ap.add_argument("--hot-cold", action="store_true",
                    help="time the bfloat16 kernel with its weights from memory and from the caches (module doc)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.ctx < 1 or a.threads < 1:
        raise SystemExit(f"--rounds={a.rounds}, --ctx={a.ctx}, --threads={a.threads}: allowed >= 1 each")
    if a.hot_cold and a.products:
        raise SystemExit("--hot-cold and --products are two measurements: pass one of them")
    if a.hot_cold and a.dtype != "bfloat16":
        raise SystemExit("--hot-cold times the kernel's bfloat16 launch: pass --dtype bfloat16")
    torch.set_num_threads(a.threads)
    from transformers import DynamicCache

    dtype = getattr(torch, a.dtype)
    model, _ = load_smollm2(dtype)
    if a.products:
        return time_products(model, a.rounds)
    if a.hot_cold:
        return time_hot_cold(model, a.rounds)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.arange(a.ctx)[None] + 100, use_cache=True, **{_cache_kwarg(model.model): cache})
    kinds = {k: v for k, v in KINDS.items() if v is None or not v[0] or packing_available(dtype, "cpu")}
    ms = {(k, n): [] for k in kinds for n in TOKENS}
    logits: dict[str, dict[int, torch.Tensor]] = {}
    for r in range(a.rounds):
        for k in list(kinds)[r % len(kinds):] + list(kinds)[:r % len(kinds)]:
            unpack_linears(model)
            if kinds[k] is not None:
                pack_linears(model, onednn=kinds[k][0], few_rows=kinds[k][1])
            for n in TOKENS:
                forward(model, cache, a.ctx, n)  # warm
                t0 = time.perf_counter()
                out = forward(model, cache, a.ctx, n)
                ms[(k, n)].append(1e3 * (time.perf_counter() - t0))
                logits.setdefault(k, {})[n] = out
    unpack_linears(model)
    print(f"{a.dtype} forward + output projection, ms (median of {a.rounds}), {a.ctx} cached tokens, "
          f"{a.threads} threads")
    print("| kind | " + " | ".join(f"{n} tok" for n in TOKENS) + " | largest logit difference from torch |")
    print("|---|" + "---|" * (len(TOKENS) + 1))
    for k in kinds:
        diff = max((logits[k][n] - logits["torch"][n]).abs().max().item() for n in TOKENS)
        print(f"| {k} | " + " | ".join(f"{statistics.median(ms[(k, n)]):.1f}" for n in TOKENS) + f" | {diff:.2g} |")
    return 0


PRODUCT_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 128)


def time_products(model, rounds: int) -> int:
    """``--products``: ms per pass over the body's matrices, each kind at each row count."""
    body = [m for m in model.model.modules() if type(m) is torch.nn.Linear]
    weights = [m.weight.detach() for m in body]
    arrays = [few_row_kernel.weight_array(w) for w in weights]
    dtype = weights[0].dtype
    kinds = {"few-row kernel": lambda x, i: few_row_kernel.rows_times(x, arrays[i]),
             "torch": lambda x, i: torch.nn.functional.linear(x, weights[i])}
    if packing_available(dtype, "cpu"):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        kinds["packed"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
    ms = {(k, n): [] for k in kinds for n in PRODUCT_ROWS}
    with torch.no_grad():
        for r in range(rounds):
            for n in PRODUCT_ROWS:
                xs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=dtype) for w in weights}
                for k in list(kinds)[r % len(kinds):] + list(kinds)[:r % len(kinds)]:
                    t0 = time.perf_counter()
                    for i, w in enumerate(weights):
                        kinds[k](xs[w.shape[1]], i)
                    ms[(k, n)].append(1e3 * (time.perf_counter() - t0))
    print(f"{len(body)} {dtype} matrices of the decoder stack, one product each in turn, ms (median of {rounds}); "
          f"the kernel serves up to MAX_ROWS = {few_row_kernel.MAX_ROWS} rows in a decode")
    print("| kind | " + " | ".join(f"{n} rows" for n in PRODUCT_ROWS) + " |")
    print("|---|" + "---|" * len(PRODUCT_ROWS))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{statistics.median(ms[(k, n)]):.1f}" for n in PRODUCT_ROWS) + " |")
    return 0


HOT_COLD_ROWS = (1, 2, 3, 4, 6, 8, 16)


def time_hot_cold(model, rounds: int) -> int:
    """``--hot-cold``: ms per pass over the body's bfloat16 matrices, each product launched
    twice in a row (the first call's weight from memory, the second's from the caches)."""
    body = [m for m in model.model.modules() if type(m) is torch.nn.Linear]
    arrays = [few_row_kernel.weight_array(m.weight) for m in body]
    macs = sum(w.shape[0] * w.shape[1] for w in arrays)  # per row
    nbytes = sum(w.nbytes for w in arrays)
    cold = {n: [] for n in HOT_COLD_ROWS}
    hot = {n: [] for n in HOT_COLD_ROWS}
    for _ in range(rounds):
        for n in HOT_COLD_ROWS:
            xs = {k: torch.randn(n, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
                  .view(torch.int16).numpy().view(np.uint16) for k in {w.shape[1] for w in arrays}}
            outs = {m: np.empty((n, m), np.uint16) for m in {w.shape[0] for w in arrays}}
            first = second = 0.0
            for w in arrays:  # in a forward's order: each weight streamed in after the others
                x, out = xs[w.shape[1]], outs[w.shape[0]]
                t0 = time.perf_counter()
                few_row_kernel.bfloat16_rows_into(x, w, out)
                t1 = time.perf_counter()
                few_row_kernel.bfloat16_rows_into(x, w, out)
                second += time.perf_counter() - t1
                first += t1 - t0
            cold[n].append(1e3 * first)
            hot[n].append(1e3 * second)
    print(f"{len(body)} bfloat16 matrices of the decoder stack ({nbytes / 2**20:.0f} MiB), the kernel's launch "
          f"alone, ms per pass (median of {rounds}); each product twice in a row: cold (weight from memory), "
          f"hot (from the caches)")
    print("| rows | cold | hot | cold - hot | hot GMAC/s | cold GB/s |")
    print("|---|---|---|---|---|---|")
    for n in HOT_COLD_ROWS:
        c, h = statistics.median(cold[n]), statistics.median(hot[n])
        print(f"| {n} | {c:.1f} | {h:.1f} | {c - h:.1f} | {n * macs / h / 1e6:.1f} | {nbytes / c / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
