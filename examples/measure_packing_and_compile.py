"""Measure three ways to run SmolLM2-135M's verify forward in bfloat16 (or float32) here.

1. eager, as transformers loads the model;
2. eager with the linear weights packed for oneDNN once (``rheoplan.models.packed_linear``,
   what ``rheoplan`` loaders do where it pays), compared with 1: whether the logits are
   identical is printed, with their largest difference (bfloat16: identical on the AMD
   EPYC, a last-bit rounding apart on the Intel Xeon at 64 and 150 rows; float32: oneDNN's product
   against the BLAS's);
3. ``torch.compile`` (inductor, weight freezing) over a static KV cache with the tree
   padded to a fixed size: the static-shape compiled forward the issue on speed asked to
   measure. Its first call per shape (the compile) is timed too.

Each forward runs a 1-token step and a chain of ``--tree`` tokens after a 150-token
prompt; the median of ``--reps`` calls is printed. ``generate`` tokens/s (greedy, 48
tokens) is printed for 1 and 2.

Usage:
    python examples/measure_packing_and_compile.py [--reps 30] [--tree 10] [--no-compile]
        [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from rheoplan.bench.kernels import _time_cpu
from rheoplan.models._hf_common import _cache_kwarg, additive_mask, crop_cache
from rheoplan.models.packed_linear import pack_linears, packing_available, unpack_linears
from rheoplan.models.smollm import load_smollm2

CTX = 150  # prompt tokens in the cache
STATIC_LEN = 512  # static cache columns


def median_ms(fn, reps: int) -> float:
    fn()  # a first call warms the allocator and the caches
    return _time_cpu(fn, reps) * 1e3


def dynamic_forward(model, n: int):
    """A forward of ``n`` chain tokens after a CTX-token prefix (dynamic cache, cropped back
    after each call): the eager verify forward."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.arange(CTX)[None] + 100, use_cache=True, **{_cache_kwarg(model.model): cache})
    tok = torch.arange(n)[None] + 500
    pos = torch.arange(CTX, CTX + n)[None]
    allowed = torch.ones(n, CTX + n, dtype=torch.bool)
    allowed[:, CTX:] = torch.ones(n, n, dtype=torch.bool).tril()
    mask = None if n == 1 else additive_mask(allowed, next(model.parameters()).dtype)

    def run():
        with torch.no_grad():
            h = model.model(input_ids=tok, position_ids=pos, attention_mask=mask, use_cache=True,
                            **{_cache_kwarg(model.model): cache}).last_hidden_state
            crop_cache(cache, CTX)
            return model.lm_head(h)
    return run


def static_compiled_forward(model, n: int):
    """The same forward compiled over a static cache of STATIC_LEN columns (the query block
    padded to ``n``, a full additive mask); returns (run, compile seconds)."""
    import torch._inductor.config as ic
    from transformers import StaticCache

    ic.freezing = True
    cache = StaticCache(config=model.config, max_cache_len=STATIC_LEN)
    with torch.no_grad():
        model.model(input_ids=torch.arange(CTX)[None] + 100, use_cache=True, **{_cache_kwarg(model.model): cache})
    tok = torch.arange(n)[None] + 500
    pos = torch.arange(CTX, CTX + n)[None]
    allowed = torch.zeros(n, STATIC_LEN, dtype=torch.bool)
    allowed[:, :CTX] = True
    allowed[:, CTX:CTX + n] = torch.ones(n, n, dtype=torch.bool).tril()
    mask = additive_mask(allowed, next(model.parameters()).dtype)
    base = torch.compile(model.model, dynamic=False)

    def run():
        for layer in cache.layers:  # write the block at column CTX again (nothing committed)
            layer.cumulative_length.fill_(CTX)
        with torch.no_grad():
            h = base(input_ids=tok, position_ids=pos, attention_mask=mask, use_cache=True,
                     **{_cache_kwarg(model.model): cache}).last_hidden_state
            return model.lm_head(h)
    t0 = time.perf_counter()
    run()
    return run, time.perf_counter() - t0


def generate_tok_s(model, tokens: int = 48) -> float:
    ids = torch.arange(CTX)[None] + 100
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, temperature=None,
                       top_k=None, top_p=None)
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tree", type=int, default=10, help="tokens of the multi-token forward")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled forward (about 70 s)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args()
    if a.reps < 1 or a.tree < 2:
        raise SystemExit(f"--reps={a.reps} (allowed >= 1), --tree={a.tree} (allowed >= 2)")
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    if not packing_available(dtype, "cpu"):
        raise SystemExit(f"this torch build cannot pack {a.dtype} linear weights (no oneDNN linear ops)")
    model, _ = load_smollm2(dtype)
    outs = {}
    for label in ("eager", "eager, packed weights"):
        if "packed" in label:
            pack_linears(model)
        else:
            unpack_linears(model)
        one, tree = dynamic_forward(model, 1), dynamic_forward(model, a.tree)
        outs[label] = (one(), tree())
        print(f"{label:28s} 1 token {median_ms(one, a.reps):6.2f} ms | {a.tree} tokens "
              f"{median_ms(tree, a.reps):6.2f} ms | generate {generate_tok_s(model):5.1f} tok/s", flush=True)
    pairs = list(zip(outs["eager"], outs["eager, packed weights"]))
    same = all(torch.equal(x, y) for x, y in pairs)
    diff = max((x.float() - y.float()).abs().max().item() for x, y in pairs)
    print(f"packed logits identical to eager: {same} (largest difference {diff:.2g})")
    if not a.no_compile:
        unpack_linears(model)  # inductor's freezing packs the weights itself
        for n in (1, a.tree):
            run, compile_s = static_compiled_forward(model, n)
            print(f"compiled, static {n:2d} tokens: {median_ms(run, a.reps):6.2f} ms (first call, the compile: "
                  f"{compile_s:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
