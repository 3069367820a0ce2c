"""The lean Llama forward against transformers' own, alternating in one process.

``rheoplan.models.lean_llama`` runs SmolLM2's decoder without transformers' per-layer
module dispatch. This script measures what that saves, with ``lean_llama.ENABLED``
switched between runs (bfloat16, the shipped head, 2 threads by default). With
``--against separate-qkv`` it switches ``lean_llama.QKV_APPEND`` instead: each layer's
queries, keys and values in one call that appends to the cache ("lean") against separate
rotary calls and ``cache.update``; with ``--against module-products`` it switches
``lean_llama.DIRECT_PRODUCTS``: each layer's four products straight through the kernel
into reused outputs ("lean") against the modules' ``forward``:

* ``--what forward``: the decoder alone over a held-out prompt's cache, a tree of each
  ``--sizes`` tokens, the two alternating call by call; prints medians and whether the
  hidden states were bit-identical. ``--profile`` then prints ``torch.profiler``'s operator
  table for five forwards of the largest size (lean unless ``--hf``).
* ``--what decode``: one-row decodes of held-out prompts as ``rheoplan generate`` runs
  them, the two alternating prompt by prompt; prints ms per step (verify forward and whole
  step) and how many prompts got the same tokens.
* ``--what batch``: static batches of ``--rows`` prompts, alternating batch by batch;
  prints tokens/s and how many batches got the same tokens.
* ``--what parts``: the lean forward alone, a timer around each of its parts (the norms,
  the products straight through the kernel, the rotary-and-append call with its q | k | v
  product, the attention, the kernel weights' lookup) over ``--calls`` forwards of each
  ``--sizes``: ms a forward and us a call, as the parts run inside forwards (a part's cost
  in a tight loop of its own is lower: its code and data come warm there).

docs/results.md, "Twenty-eighth round", quotes it:

    python examples/measure_lean_forward.py --what forward [--sizes 1 3 9] [--calls 60] [--profile]
    python examples/measure_lean_forward.py --what decode [--prompts 10] [--temperature 1]
    python examples/measure_lean_forward.py --what batch [--rows 4] [--batches 6] [--temperature 1]
    python examples/measure_lean_forward.py --against separate-qkv --what decode [--prompts 10]
    python examples/measure_lean_forward.py --against module-products --what forward [--sizes 1 3 4 8]
    python examples/measure_lean_forward.py --what parts [--sizes 1 4 8] [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def tree(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor-or-self mask, depth) of the tree with these parents."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        k = j
        while k >= 0:
            anc[j, k] = True
            k = parents[k]
    return anc, anc.sum(1) - 1


def parents_of(n: int) -> list[int]:
    """A bushy tree of ``n`` nodes: node j's parent is (j - 1) // 2."""
    return [-1] + [(j - 1) // 2 for j in range(1, n)]


def switch(args):
    """``(set(on), name of the other side)``: what ``--against`` alternates."""
    import rheoplan.models.lean_llama as lean

    if args.against == "separate-qkv":
        return (lambda on: setattr(lean, "QKV_APPEND", on)), "separate-qkv"
    if args.against == "module-products":
        return (lambda on: setattr(lean, "DIRECT_PRODUCTS", on)), "module-products"
    return (lambda on: setattr(lean, "ENABLED", on)), "transformers"


def prompt_cache(model, tok) -> tuple[list[int], object]:
    """A held-out prompt's ids and a cache holding its prefill."""
    from rheoplan.bench.decode import load_prompts
    from rheoplan.loading import encode_prompt
    from rheoplan.models._hf_common import new_cache, run_base

    ids = encode_prompt(tok, load_prompts(1)[0][1], chat=True)
    n0 = len(ids)
    cache = new_cache(model)
    with torch.no_grad():
        run_base(model.model, cache, torch.tensor(ids), torch.arange(n0), torch.ones(n0, n0, dtype=torch.bool).tril())
    return ids, cache


def tree_inputs(n: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, positions, allowed mask) of an ``n``-token bushy tree after ``ids``."""
    from rheoplan.models._hf_common import prefix_and_block_mask

    anc, depth = tree(parents_of(n))
    tok_ids = torch.tensor([ids[-1]] + [100 + j for j in range(n - 1)])
    return tok_ids, len(ids) + depth, prefix_and_block_mask(len(ids), anc)


def forward(args, model, tok) -> None:
    import rheoplan.models.lean_llama as lean
    from rheoplan.models._hf_common import crop_cache, run_base

    base = model.model
    set_on, other = switch(args)
    ids, cache = prompt_cache(model, tok)
    n0 = len(ids)
    with torch.no_grad():
        for n in args.sizes:
            tok_ids, positions, allowed = tree_inputs(n, ids)
            times = {True: [], False: []}
            outs = {}
            for _ in range(args.calls):
                for enabled in (True, False):
                    set_on(enabled)
                    t = time.perf_counter()
                    outs[enabled] = run_base(base, cache, tok_ids, positions, allowed, all_allowed=n == 1)
                    times[enabled].append(time.perf_counter() - t)
                    crop_cache(cache, n0)
            set_on(True)
            med = {k: 1e3 * statistics.median(v[5:]) for k, v in times.items()}
            print(f"{n} tokens: lean {med[True]:.2f} ms, {other} {med[False]:.2f} ms "
                  f"({med[False] - med[True]:+.2f}); bit-identical: {torch.equal(outs[True], outs[False])}")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            n = max(args.sizes)
            tok_ids, positions, allowed = tree_inputs(n, ids)
            lean.ENABLED = not args.hf
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    run_base(base, cache, tok_ids, positions, allowed, all_allowed=n == 1)
                    crop_cache(cache, n0)
            lean.ENABLED = True
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def parts(args, model, tok) -> None:
    """``--what parts``: the lean forward's parts timed where they run (see the docstring)."""
    import collections

    import rheoplan.models.lean_llama as lean
    from rheoplan.models._hf_common import crop_cache, run_base

    spent, calls = collections.Counter(), collections.Counter()

    def timed(fn, part):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[part] += time.perf_counter() - t
                calls[part] += 1
        return run

    ml = lean._llama_classes()
    attention = ml.ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, ml.eager_attention_forward)
    wrapped = [(lean.glue, "add_rms_norm", "residual sum and norm"),
               (lean, "_product_into", "products through the kernel (q | k | v too)"),
               (lean, "_rope_into_cache", "q | k | v product, rotary, cache append"),
               (lean, "_kernel_weights", "kernel weights' lookup")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in wrapped]
    saved_interface = ml.ALL_ATTENTION_FUNCTIONS.get_interface
    for obj, name, part in wrapped:
        setattr(obj, name, timed(getattr(obj, name), part))
    ml.ALL_ATTENTION_FUNCTIONS.get_interface = lambda *a, **k: timed(attention, "attention")
    try:
        ids, cache = prompt_cache(model, tok)
        with torch.no_grad():
            for n in args.sizes:
                tok_ids, positions, allowed = tree_inputs(n, ids)
                for i in range(args.calls + 5):
                    if i == 5:  # the first five warm up
                        spent.clear()
                        calls.clear()
                        t0 = time.perf_counter()
                    run_base(model.model, cache, tok_ids, positions, allowed, all_allowed=n == 1)
                    crop_cache(cache, len(ids))
                whole = (time.perf_counter() - t0) / args.calls
                print(f"{n} tokens: {1e3 * whole:.2f} ms a forward")
                for part, s in spent.most_common():
                    print(f"  {part:44s} {1e3 * s / args.calls:6.2f} ms a forward, {calls[part] / args.calls:5.1f} calls, "
                          f"{1e6 * s / calls[part]:6.1f} us a call")
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        ml.ALL_ATTENTION_FUNCTIONS.get_interface = saved_interface


def decodes(args, model, tok, draft) -> None:
    from rheoplan.bench.batch import held_out_groups

    B = 1 if args.what == "decode" else args.rows
    groups = args.prompts if args.what == "decode" else args.batches
    run = held_out_groups(model, tok, draft, B, groups, args.tokens, args.temperature)

    set_on, other = switch(args)
    run(0)  # warm-up: first-call work of the process
    wall = {True: 0.0, False: 0.0}
    verify = {True: 0.0, False: 0.0}
    steps = {True: 0, False: 0}
    tokens = {True: 0, False: 0}
    same = 0
    for k in range(groups):
        got = {}
        for enabled in ((True, False) if k % 2 == 0 else (False, True)):
            set_on(enabled)
            t = time.perf_counter()
            res = run(k)
            wall[enabled] += time.perf_counter() - t
            got[enabled] = [r.tokens for r in res]
            tokens[enabled] += sum(len(r.tokens) for r in res)
            if B == 1:
                steps[enabled] += len(res[0].steps)
                verify[enabled] += sum(st.t_verify_forward for st in res[0].steps)
        same += got[True] == got[False]
    set_on(True)
    for enabled, name in ((True, "lean"), (False, other)):
        line = f"{name:>12}: {tokens[enabled] / wall[enabled]:.1f} tokens/s"
        if B == 1:
            line += (f", {1e3 * wall[enabled] / steps[enabled]:.2f} ms a step (prefill included), verify forward "
                     f"{1e3 * verify[enabled] / steps[enabled]:.2f} ms, {steps[enabled]} steps")
        print(line)
    print(f"lean / {other}: {wall[False] / wall[True]:.3f}x; the same tokens in {same} of {groups} "
          f"{'prompts' if B == 1 else 'batches'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("forward", "decode", "batch", "parts"), default="forward")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 3, 9], help="tree tokens per forward (forward, parts)")
    ap.add_argument("--calls", type=int, default=60, help="calls per size and side (forward, parts)")
    ap.add_argument("--profile", action="store_true", help="also profile five forwards (forward)")
    ap.add_argument("--against", choices=("transformers", "separate-qkv", "module-products"), default="transformers",
                    help="what the lean forward alternates with (see the docstring)")
    ap.add_argument("--hf", action="store_true", help="profile transformers' forward instead of the lean one")
    ap.add_argument("--prompts", type=int, default=10, help="held-out prompts (decode)")
    ap.add_argument("--rows", type=int, default=4, help="prompts per batch (batch)")
    ap.add_argument("--batches", type=int, default=6, help="batches (batch)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (decode, batch)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for name in ("calls", "prompts", "rows", "batches", "tokens", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)}: allowed >= 1")
    if args.calls < 6:
        ap.error(f"--calls={args.calls}: allowed >= 6 (the first 5 are warm-up)")
    if any(n < 1 for n in args.sizes):
        ap.error(f"--sizes={args.sizes}: allowed >= 1 each")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature}: allowed >= 0")
    torch.set_num_threads(args.threads)
    from rheoplan.loading import load_default

    model, tok, draft = load_default(dtype="bfloat16", draft_dtype="bfloat16")
    if args.what == "forward":
        forward(args, model, tok)
    elif args.what == "parts":
        parts(args, model, tok)
    else:
        decodes(args, model, tok, draft)


if __name__ == "__main__":
    main()
