"""Self-distillation data: the target's own samples, with EAGLE-3 features and soft targets.

No data leaves or enters the machine: prompts come from ``rheoplan/data/prompts_*.txt``,
responses are sampled from the target itself (chat template, several temperatures), and
the training targets are the target's own next-token distributions.

Why features are captured *while* sampling rather than in a second pass: every token of a
sample is forwarded once by the sampler anyway (prefill for the prompt, one decode step per
new token), and that forward is exactly the one a separate features pass would repeat. So
each forward records, per position ``t``:

* ``feats[t]``: the inputs of layers ``2, L//2, L-3`` concatenated (``3*H``, fp16) — the
  feature an EAGLE-3 head pairs with token ``t + 1``;
* ``topk_ids[t]``, ``topk_logp[t]``: the top-``k`` tokens of the target's T=1 next-token
  log-distribution (int32, fp16) — the soft training target.

Left padding is handled with an attention mask and explicit position ids, so a row's
features equal those of a forward over that row alone (``tests/rheoplan/train`` checks it).

Shard format (one ``torch.save`` dict per batch, written atomically, skipped when present):
``tokens`` int32 ``[N]`` (all rows concatenated), ``offsets`` int64 ``[rows + 1]``,
``prompt_len`` int64 ``[rows]``, ``feats`` fp16 ``[N, 3H]``, ``topk_ids`` int32 ``[N, k]``,
``topk_logp`` fp16 ``[N, k]``, ``temperature`` float, ``prompt_index`` int64 ``[rows]``.
Row ``r`` is ``tokens[offsets[r]:offsets[r+1]]``; position ``t`` of it was forwarded and
``topk_*[t]`` is the target's distribution of the token after it.

Example (a tiny random model):
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=50)).eval()
    >>> rows = sample_with_features(m, [[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=1.0,
    ...                             eos_id=0, topk=8, generator=torch.Generator().manual_seed(0))
    >>> rows[0]["feats"].shape[1], rows[0]["topk_ids"].shape[1]
    (96, 8)
"""

from __future__ import annotations

import inspect
import os
import time
import zlib
from typing import Sequence

import torch
from tqdm import tqdm

from rheoplan.models.hf_target import eagle3_layers
from rheoplan.models.smollm import load_smollm2


def read_prompts(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(category, prompt)`` pairs from a ``category<TAB>prompt`` file ('#' lines skipped).

    Literal ``\\n`` in a prompt stands for a newline.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            if "\t" not in line:
                raise ValueError(f"{path}:{lineno}: expected 'category<TAB>prompt', got {line[:60]!r}")
            cat, prompt = line.split("\t", 1)
            out.append((cat.strip(), prompt.replace("\\n", "\n")))
    return out


def data_file(name: str) -> str:
    """Path of a file shipped in ``rheoplan/data``."""
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", name)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of one user turn under the chat template, ending at the assistant header."""
    msgs = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def capture_indices(model: torch.nn.Module) -> list[int]:
    """``hidden_states`` indices of the EAGLE-3 layers' inputs (input of layer i = index i)."""
    return eagle3_layers(int(model.config.num_hidden_layers))


def _record(out, idx: Sequence[int], topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Some residual-stream channels of small LMs reach ~1e4; clamp to fp16's range, never inf.
    fp16_max = torch.finfo(torch.float16).max
    feats = torch.cat([out.hidden_states[i] for i in idx], dim=-1).clamp(-fp16_max, fp16_max)
    feats = feats.to(torch.float16)
    logp = torch.log_softmax(out.logits.to(torch.float32), dim=-1)
    lp, ids = logp.topk(topk, dim=-1)
    return feats, ids.to(torch.int32), lp.to(torch.float16)


@torch.no_grad()
def sample_with_features(model: torch.nn.Module, prompts: list[list[int]], *, max_new_tokens: int,
                         temperature: float, eos_id: int, topk: int = 32,
                         generator: torch.Generator | None = None, pad_id: int | None = None,
                         ) -> list[dict[str, torch.Tensor | int]]:
    """Sample continuations of a batch of prompts and record features and soft targets.

    Args:
        model: a transformers causal LM (eval mode).
        prompts: token ids per row (left padded internally).
        max_new_tokens: sampled tokens per row at most (the last one is not forwarded).
        temperature: 0 = greedy, else multinomial at this temperature (no top-k/top-p).
        eos_id: a row stops at its first sampled ``eos_id``.
        topk: how many of the target's top tokens to keep per position.
    Returns:
        one dict per row: ``tokens`` int32 ``[m]`` (forwarded tokens: prompt, then samples up
        to but excluding EOS), ``prompt_len``, ``feats [m, 3H]`` fp16, ``topk_ids [m, k]``
        int32, ``topk_logp [m, k]`` fp16. The last row position's target predicts the EOS
        (or the first unforwarded sample).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: allowed >= 0")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: allowed >= 1")
    from transformers import DynamicCache

    idx = capture_indices(model)
    dev = next(model.parameters()).device
    pad = eos_id if pad_id is None else pad_id
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad, dtype=torch.int64)
    attn = torch.zeros(B, P, dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
        attn[r, P - len(p):] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    # transformers 5.x names the argument ``cache``; 4.x called it ``past_key_values``.
    ckw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                output_hidden_states=True, **{ckw: cache})
    rec = [_record(out, idx, topk)]
    gen: list[torch.Tensor] = []
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    last_pos = pos[:, -1]
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].to(torch.float32)
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(dev)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        gen.append(nxt)
        done |= nxt == eos_id
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=dev)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos[:, None],
                    use_cache=True, output_hidden_states=True, **{ckw: cache})
        rec.append(_record(out, idx, topk))
    feats = torch.cat([r[0] for r in rec], dim=1).cpu()
    tk_ids = torch.cat([r[1] for r in rec], dim=1).cpu()
    tk_lp = torch.cat([r[2] for r in rec], dim=1).cpu()
    gen_t = torch.stack(gen, dim=1).cpu()  # [B, steps]
    n_fwd_gen = len(rec) - 1  # samples that were fed back
    rows = []
    for r, p in enumerate(prompts):
        g = gen_t[r].tolist()
        e = g.index(eos_id) if eos_id in g else len(g)
        keep = min(e, n_fwd_gen)
        sl = slice(P - len(p), P + keep)
        rows.append({
            "tokens": torch.tensor(list(p) + g[:keep], dtype=torch.int32),
            "prompt_len": len(p),
            "feats": feats[r, sl].clone(),
            "topk_ids": tk_ids[r, sl].clone(),
            "topk_logp": tk_lp[r, sl].clone(),
        })
    return rows


def pack_rows(rows: list[dict], **meta) -> dict:
    """Concatenate rows into the shard format described in the module docstring."""
    lens = [int(r["tokens"].numel()) for r in rows]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    shard = {
        "tokens": torch.cat([r["tokens"] for r in rows]),
        "offsets": offsets,
        "prompt_len": torch.tensor([int(r["prompt_len"]) for r in rows], dtype=torch.int64),
        "feats": torch.cat([r["feats"] for r in rows]),
        "topk_ids": torch.cat([r["topk_ids"] for r in rows]),
        "topk_logp": torch.cat([r["topk_logp"] for r in rows]),
    }
    shard.update(meta)
    return shard


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def shard_name(split: str, temperature: float, i: int) -> str:
    return f"{split}_T{temperature:g}_{i:04d}.pt"


def generate_shards(model: torch.nn.Module, tokenizer, prompts: list[str], out_dir: str, *,
                    split: str, temperatures: Sequence[float], max_new_tokens: int,
                    batch_size: int, topk: int, seed: int = 0, every_temperature: bool = False,
                    progress: bool = True) -> list[str]:
    """Sample the prompts in batches; one shard per batch.

    Temperatures: prompt ``i`` is sampled at ``temperatures[i % len(temperatures)]``, or at
    every temperature with ``every_temperature=True`` (more data, proportionally slower).
    Resumable: a shard whose file exists is skipped (files are written atomically, so a
    killed run leaves no half shard). Prompts are batched by length to limit padding.
    Each shard's sampler is seeded from ``(seed, split, temperature, batch)``, so a resumed
    run produces the same data as an uninterrupted one.
    Returns the shard paths in order.
    """
    if not prompts:
        raise ValueError("no prompts to sample")
    os.makedirs(out_dir, exist_ok=True)
    enc = [chat_ids(tokenizer, p) for p in prompts]
    eos = int(tokenizer.eos_token_id)
    jobs = []
    for k, t in enumerate(temperatures):
        mine = [i for i in range(len(enc)) if every_temperature or i % len(temperatures) == k]
        mine.sort(key=lambda i: len(enc[i]))
        jobs += [(float(t), b, mine[j:j + batch_size]) for b, j in enumerate(range(0, len(mine), batch_size))]
    paths = []
    bar = tqdm(jobs, desc=f"sample {split}", unit="batch", disable=not progress, dynamic_ncols=True)
    for t, b, members in bar:
        path = os.path.join(out_dir, shard_name(split, t, b))
        paths.append(path)
        if os.path.exists(path):
            continue
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{split}/{t}/{b}".encode()))
        t0 = time.time()
        rows = sample_with_features(model, [enc[i] for i in members], max_new_tokens=max_new_tokens,
                                    temperature=t, eos_id=eos, topk=topk, generator=g)
        n_new = sum(int(r["tokens"].numel()) - int(r["prompt_len"]) for r in rows)
        _atomic_save(pack_rows(rows, temperature=t,
                               prompt_index=torch.tensor(members, dtype=torch.int64)), path)
        bar.set_postfix(T=t, new_tok=n_new, s=f"{time.time() - t0:.1f}")
    return paths


def load_shards(paths: Sequence[str]) -> list[dict]:
    """Rows of all shards as dicts of tensors (features stay fp16)."""
    rows = []
    for p in paths:
        s = torch.load(p, weights_only=True)
        off = s["offsets"].tolist()
        for r in range(len(off) - 1):
            a, b = off[r], off[r + 1]
            rows.append({"tokens": s["tokens"][a:b], "prompt_len": int(s["prompt_len"][r]),
                         "feats": s["feats"][a:b], "topk_ids": s["topk_ids"][a:b],
                         "topk_logp": s["topk_logp"][a:b], "temperature": float(s["temperature"])})
    return rows


def load_target():
    """SmolLM2-135M-Instruct and its tokenizer, as ``(model, tokenizer)``.

    ``load_smollm2``'s return order has changed once; accept either order.
    """
    a, b = load_smollm2()
    return (a, b) if isinstance(a, torch.nn.Module) else (b, a)
