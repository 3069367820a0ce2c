"""Does a second decoder layer make the EAGLE-3 head draft better? A held-out comparison.

Both arms start from the shipped head (``rheoplan/assets/smollm2-eagle3``) and train the
same epochs on the same rows with the trainer's own loop (``rheoplan.train.train``:
packed rows, EAGLE-3 training-time test, soft targets from the target's top-32):

- ``one``: the shipped head as it is (one layer, the control);
- ``two``: the shipped head with a plain Llama-style decoder layer stacked on its midlayer
  (attention and SwiGLU MLP over the hidden, RoPE at the same positions, the same
  training-time-test mask). Its ``o_proj`` and ``down_proj`` start at zero, so the arm
  starts as the shipped head (``stacked``'s test checks that) and only training moves it.

The rows are training rows the shipped head never saw (shards outside its
``train_shards.txt``), shuffled with a fixed seed. After each epoch and at the end each
arm is evaluated like the trainer's model card: top-1, top-3 and the T = 1 acceptance
proxy per draft depth on the held-out shard, and on 60 of the training rows (is the arm
short of capacity, or of data?). docs/train.md, "A second decoder layer", quotes it.
It is a measurement of the head alone: the decode path runs one-layer heads.

    python examples/measure_head_layers.py [--rows 1500] [--epochs 2] [--lr 3e-4] [--arms one two]
        [--feature-dir DIR] [--out result.json] [--threads 2]

~25 minutes on a 2-core machine at the defaults (the target's teacher-forced forwards
for the first epoch, then the features from memory). ``--feature-dir`` keeps the made
features on disk (~3.8 KB per pair), so a second run over the same rows skips them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from torch import nn


def stacked(head):
    """A copy of ``head`` (an ``Eagle3Head``) with a plain decoder layer after its
    midlayer whose output projections are zero: the same outputs until trained. Its
    ``past`` is a pair of the two layers' k/v."""
    from rheoplan.models.eagle3.head import Eagle3Attention, Eagle3Head, Eagle3MLP, RMSNorm

    cfg = head.config

    class PlainLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.self_attn = Eagle3Attention(cfg, in_width=cfg.hidden_size)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp = Eagle3MLP(cfg)

        def forward(self, h, cos, sin, past, allowed):
            a, kv = self.self_attn(self.input_layernorm(h), cos, sin, past, allowed)
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h)), kv

    class TwoLayerHead(Eagle3Head):
        def forward(self, embeds, hidden, positions, past, allowed):
            h = self.fuse(hidden)
            cos, sin = self.rotary(h[None], positions[None])
            p1, p2 = past if past is not None else (None, None)
            h1, kv1 = self.midlayer(embeds, h, cos[0], sin[0], p1, allowed)
            h2, kv2 = self.layer2(h1, cos[0], sin[0], p2, allowed)
            return h2, (kv1, kv2)

    two = TwoLayerHead(cfg, vocab_map=head.d2t is not None)
    two.load_state_dict(head.state_dict())
    two.layer2 = PlainLayer().to(next(head.parameters()).dtype)
    for m in two.layer2.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    nn.init.zeros_(two.layer2.self_attn.o_proj.weight)
    nn.init.zeros_(two.layer2.mlp.down_proj.weight)
    return two


def _depths(ev: dict) -> str:
    return " / ".join(f"{100 * ev[f'top1_step{k}']:.1f}% ({100 * ev[f'accept_lo_step{k}']:.1f}%)" for k in (1, 2, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1500, help="training rows the shipped head never saw")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--arms", nargs="+", default=["one", "two"], choices=["one", "two"])
    ap.add_argument("--feature-dir", default=None, help="keep the made features here (reused by a later run)")
    ap.add_argument("--out", default=None, help="write every evaluation here (JSON)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for name in ("rows", "epochs", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)}: allowed >= 1")
    if not a.lr > 0:
        ap.error(f"--lr={a.lr}: allowed > 0")

    from rheoplan.loading import SHIPPED_HEAD
    from rheoplan.models.eagle3 import read_eagle3
    from rheoplan.models.packed_linear import pack_if_it_pays
    from rheoplan.models.smollm import DTYPES
    from rheoplan.train import cli as train_cli, features as ft, selfdistill as sd, tokens as tk, train as tr

    # the trainer's own defaults (top-k of the soft targets, prompt weight, scale rows, ...)
    d = train_cli.build_parser().parse_args(["--work-dir", "unused"])
    torch.set_num_threads(a.threads)
    torch.manual_seed(d.seed)
    data = sd.data_file("selfdistill_tokens")
    shipped = str(SHIPPED_HEAD)
    t0 = time.time()
    model, _, _ = sd.load_target(None, DTYPES["bfloat16"])  # the trainer's target dtype
    pack_if_it_pays(model, "target")
    with open(os.path.join(shipped, "train_shards.txt")) as f:
        seen = set(f.read().split())
    names = [n for n in tk.list_shards(data, "train") if n not in seen]
    rows = tk.load_rows(data, names)
    random.Random(d.seed).shuffle(rows)
    rows = rows[:a.rows]
    held = tk.load_rows(data, tk.list_shards(data, "heldout"))
    shared = tr.common_prefix_len(rows + held)
    print(f"{len(rows)} rows of {len(names)} shards the shipped head never saw: "
          f"{sum(int(r['tokens'].numel()) - 1 for r in rows)} pairs", flush=True)
    batch = 2 * d.chunk_tokens  # as the trainer makes features
    scale = ft.calibration_scale(model, rows, n_rows=d.calib_rows, seed=d.seed, batch_tokens=batch)
    train_src = ft.RowExamples(model, rows, topk=d.topk, shared_prefix=shared, prompt_weight=d.prompt_weight,
                               batch_tokens=batch, cache_gb=10, cache_dir=a.feature_dir)
    held_src = ft.RowExamples(model, held, topk=d.heldout_topk, shared_prefix=shared, prompt_weight=d.prompt_weight,
                              cache=True)
    sub_src = ft.RowExamples(model, random.Random(1).sample(rows, min(60, len(rows))), topk=d.heldout_topk,
                             shared_prefix=shared, prompt_weight=d.prompt_weight, cache=True)
    embed = model.get_input_embeddings().weight.detach().float()
    results = {}
    for arm in a.arms:
        head = read_eagle3(shipped, dtype=torch.float32)
        if arm == "two":
            head = stacked(head)
        tr.unfold_feature_scale(head, scale)  # as the trainer does: it feeds feats * scale
        ids = head.target_ids().cpu()
        t2d = tr.target_to_draft_index(ids, head.config.vocab_size)

        def ev(s):
            return tr.evaluate(head, embed, s, steps=3, chunk_tokens=d.chunk_tokens, draft_ids=ids, t2d_index=t2d,
                               scale=scale)

        r = {"params": sum(p.numel() for p in head.parameters()), "heldout_before": ev(held_src)}
        cfg = tr.TrainConfig(epochs=a.epochs, lr=a.lr, chunk_tokens=d.chunk_tokens, ttt_steps=d.ttt_steps,
                             step_decay=d.step_decay, prompt_weight=d.prompt_weight, seed=d.seed, ckpt_every=10**9)
        t = time.time()
        summary = tr.train_head(head, embed, train_src, cfg, progress=False, on_epoch_end=lambda e: ev(held_src),
                                scale=scale)
        r.update(train_s=time.time() - t, epochs=summary["epoch_evals"], heldout=ev(held_src), train_rows=ev(sub_src))
        results[arm] = r
        print(f"== {arm}: {r['params']} parameters, trained in {r['train_s']:.0f} s. Top-1 (acceptance proxy) "
              f"at depths 1 / 2 / 3: held-out before {_depths(r['heldout_before'])}, after {_depths(r['heldout'])}; "
              f"training rows after {_depths(r['train_rows'])}", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1, default=str)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
