"""Per-phase timings of plan_and_decode on SmolLM2-135M-Instruct, side by side.

Runs, in one process and on one prompt: autoregressive decoding (no draft), a standalone
draft (the early-exit draft: the target's first layers as a separate causal LM with its
own cache), and an EAGLE-3-style head (random weights unless --head DIR is given; a
random head is accepted rarely, so it measures cost, not speed-up). Prints ms per step
for each phase (draft forwards, planner bookkeeping, verify forward, verification walk,
commit) and tokens/s.

    python examples/smollm_phases.py [--tokens 48] [--temperature 1.0] [--threads 2] [--head DIR]
"""

from __future__ import annotations

import argparse
import time

import torch

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.decode import plan_and_decode


def random_eagle3(model, draft_vocab: int = 8192, seed: int = 0):
    """An EAGLE-3 head with random weights for ``model``; the draft vocabulary is the first
    ``draft_vocab`` target ids."""
    from rheoplan.models.eagle3 import Eagle3Config, Eagle3Draft, Eagle3Head

    c = model.config
    torch.manual_seed(seed)
    cfg = Eagle3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                       intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, draft_vocab_size=draft_vocab,
                       target_hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps,
                       rope_theta=getattr(c, "rope_theta", 10000.0) or 10000.0)
    head = Eagle3Head(cfg).eval()
    head.set_vocab_map(torch.arange(draft_vocab))  # draft id i proposes target id i
    return Eagle3Draft(head, model.get_input_embeddings(), features_from=model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--early-exit", type=int, default=6, help="layers of the early-exit draft")
    ap.add_argument("--head", default=None, help="EAGLE-3 checkpoint directory (default: random head)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from rheoplan.models.early_exit import early_exit_draft
    from rheoplan.models.smollm import load_smollm2

    model, tok = load_smollm2()
    ids = tok.apply_chat_template([{"role": "user", "content": "Explain how a rainbow forms."}],
                                  add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = list(ids["input_ids"])
    if args.head:
        from rheoplan.models.eagle3 import load_eagle3_checkpoint

        head_draft, head_name = load_eagle3_checkpoint(args.head, model), f"eagle3 head {args.head}"
    else:
        head_draft, head_name = random_eagle3(model), "eagle3 head (random weights)"
    sampling = SamplingConfig(temperature=args.temperature)
    tree = TreeConfig(depth=5, frontier=4, slots=4, budget=16, rheostat=1)
    runs = [("autoregressive", None, tree),
            (f"early-exit:{args.early_exit} draft, rheo", early_exit_draft(model, args.early_exit), tree),
            (f"{head_name}, rheo", head_draft, tree)]
    print(f"SmolLM2-135M, prompt {len(ids)} tokens, {args.tokens} new tokens, T={args.temperature}, "
          f"torch threads {torch.get_num_threads()}, tree {tree}\n")
    hdr = f"{'run':<44s}{'tok/s':>7s}{'tau':>6s}{'steps':>6s}  ms/step: {'draft':>7s}{'plan':>7s}{'verify':>8s}{'walk':>7s}{'commit':>8s}"
    print(hdr)
    for name, draft, cfg in runs:
        plan_and_decode(model, draft, ids, max_new_tokens=4, sampling=sampling, tree=cfg, seed=1)  # warm-up
        t0 = time.perf_counter()
        r = plan_and_decode(model, draft, ids, max_new_tokens=args.tokens, sampling=sampling, tree=cfg, seed=0)
        wall = time.perf_counter() - t0
        n = max(1, len(r.steps))
        ph = {k: 1e3 * v / n for k, v in r.phase_totals().items()}
        print(f"{name:<44s}{len(r.tokens) / wall:7.2f}{r.mean_accepted_length:6.2f}{len(r.steps):6d}  "
              f"         {ph['draft']:7.1f}{ph['plan']:7.1f}{ph['verify_forward']:8.1f}{ph['walk']:7.1f}{ph['commit']:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
