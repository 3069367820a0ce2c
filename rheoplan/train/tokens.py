"""Token shards: the target's own samples, stored as compact token ids (no features).

Why tokens only: features and soft targets are a deterministic function of the tokens and
the target, so they are recomputed at training time by batched teacher-forced forwards
(``rheoplan.train.features``), in the training dtype. On disk a sample costs 2 bytes per
token instead of ~3.5 kB of fp16 features, so a 1.5M-token data set is a few MB and can
be committed as it grows.

Shard format (one pair of files per shard, in a tokens directory):

* ``NAME.npy``: every row's tokens concatenated, ``uint16`` when the vocabulary fits
  (``vocab_size <= 65536``), else ``uint32``;
* ``NAME.json``: the index: ``offsets`` (``rows + 1`` ints, row ``r`` is
  ``tokens[offsets[r]:offsets[r+1]]``), ``prompt_len`` per row (the prompt is the prefix
  the target did not sample: chat template, user turns, earlier assistant turns),
  ``prompt_ids`` per row (ids in the prompt plan, ``rheoplan.train.prompts``),
  ``stopped`` per row (True: the row ended with EOS, which is *not* stored), ``temperature``,
  ``seed`` (of this shard's sampler), ``max_new_tokens``, ``dtype`` (of the sampling target),
  ``wall_s``.

Writes are atomic (temporary file + ``os.replace``; the ``.json`` is written last, so a
shard exists exactly when its ``.json`` does) and a job skips shards already present, so
a killed job resumes where it stopped. ``dataset.json`` in the directory records what the
shards were sampled from (target, vocabulary size, EOS, settings); ``check_dataset``
refuses to mix shards of different targets or settings in one directory.

Example (a tiny random model):
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=50)).eval()
    >>> rows = sample_tokens(m, [[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=1.0, eos_id=0,
    ...                      generator=torch.Generator().manual_seed(0))
    >>> [len(r["tokens"]) <= len(p) + 4 for r, p in zip(rows, [[1, 2, 3], [4, 5]])]
    [True, True]
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Sequence

import numpy as np
import torch


# --------------------------------------------------------------------------------------
# Batched sampling (tokens only)
# --------------------------------------------------------------------------------------

def _forward_kwargs(model: torch.nn.Module) -> tuple[str, bool]:
    """The cache argument's name (transformers 5.x ``cache``, 4.x ``past_key_values``) and
    whether the model accepts ``logits_to_keep`` (then only the last position's logits are
    computed: a batch-64 prefill's full logits would be ~1 GB for a 49k vocabulary)."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


@torch.no_grad()
def sample_tokens(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                  temperature: float, eos_id: int, generator: torch.Generator | None = None,
                  pad_id: int | None = None) -> list[dict]:
    """Sample continuations of a batch of prompts from a transformers causal LM.

    Left padding with an attention mask and explicit position ids (a row's distribution
    equals that of a forward over the row alone up to float rounding); a KV cache; rows
    that sampled EOS leave the batch (the cache keeps only live rows), so a batch costs
    what its live rows cost. Sampling is plain multinomial at ``temperature`` (no top-k or
    top-p); ``temperature == 0`` is greedy.

    Args:
        model: a causal LM in eval mode (any dtype).
        prompts: token ids per row, each non-empty.
        max_new_tokens: sampled tokens per row at most (>= 1).
        temperature: >= 0.
        eos_id: a row stops at its first sampled ``eos_id`` (not included in its tokens).
        generator: CPU generator for the multinomial draws (reproducible batches).
    Returns:
        one dict per row: ``tokens`` (list of ints: prompt then sampled tokens, EOS
        excluded), ``prompt_len``, ``stopped`` (sampled EOS).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty token id lists")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature}: allowed >= 0")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: allowed >= 1")
    from transformers import DynamicCache

    ckw, has_keep = _forward_kwargs(model)
    keep_kw = {"logits_to_keep": 1} if has_keep else {}
    dev = next(model.parameters()).device
    pad = eos_id if pad_id is None else pad_id
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad, dtype=torch.int64)
    attn = torch.zeros(B, P, dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(list(p), dtype=torch.int64)
        attn[r, P - len(p):] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **keep_kw,
                **{ckw: cache})
    live = torch.arange(B)  # batch slot -> row
    last_pos = pos[:, -1]
    gen: list[list[int]] = [[] for _ in range(B)]
    stopped = [False] * B
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].to(torch.float32).cpu()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]
        alive = []
        for slot, (row, t) in enumerate(zip(live.tolist(), nxt.tolist())):
            if t == eos_id:
                stopped[row] = True
            else:
                gen[row].append(t)
                alive.append(slot)
        if step == max_new_tokens - 1 or not alive:
            break
        if len(alive) < len(live):  # drop finished rows from the batch and the cache
            keep = torch.tensor(alive, dtype=torch.int64)
            cache.batch_select_indices(keep.to(dev))
            live, nxt, attn, last_pos = live[keep], nxt[keep], attn[keep.to(dev)], last_pos[keep.to(dev)]
        attn = torch.cat([attn, torch.ones(len(live), 1, dtype=attn.dtype, device=dev)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None].to(dev), attention_mask=attn, position_ids=last_pos[:, None],
                    use_cache=True, **keep_kw, **{ckw: cache})
    return [{"tokens": [int(t) for t in p] + gen[r], "prompt_len": len(p), "stopped": stopped[r]}
            for r, p in enumerate(prompts)]


# --------------------------------------------------------------------------------------
# Shard files
# --------------------------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: allowed >= 1")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _atomic_write_bytes(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(directory: str, name: str, rows: Sequence[dict], *, vocab_size: int, **meta) -> str:
    """Write ``rows`` (``tokens``, ``prompt_len``, ``prompt_id``, ``stopped``) as shard ``name``;
    ``meta`` (temperature, seed, ...) goes into the index. Returns the ``.json`` path."""
    if not rows:
        raise ValueError(f"shard {name}: no rows")
    dt = token_dtype(vocab_size)
    flat = [t for r in rows for t in r["tokens"]]
    if flat and (min(flat) < 0 or max(flat) >= vocab_size):
        raise ValueError(f"shard {name}: token ids outside 0..{vocab_size - 1}")
    arr = np.asarray(flat, dtype=dt)
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r["tokens"]))
    index = {"name": name, "rows": len(rows), "token_dtype": dt.name, "offsets": offsets,
             "prompt_len": [int(r["prompt_len"]) for r in rows],
             "prompt_ids": [int(r["prompt_id"]) for r in rows],
             "stopped": [bool(r["stopped"]) for r in rows], **meta}
    os.makedirs(directory, exist_ok=True)
    _atomic_write_bytes(os.path.join(directory, name + ".npy"), lambda f: np.save(f, arr))
    path = os.path.join(directory, name + ".json")
    _atomic_write_bytes(path, lambda f: f.write(json.dumps(index, indent=None).encode()))
    return path


def shard_done(directory: str, name: str) -> bool:
    """A shard exists when its index does (the index is written after the tokens)."""
    return os.path.exists(os.path.join(directory, name + ".json"))


def read_shard(directory: str, name: str) -> tuple[dict, list[dict]]:
    """``(index, rows)``; each row: ``tokens`` (int64 tensor), ``prompt_len``, ``prompt_id``,
    ``stopped``, ``temperature``, ``shard``."""
    with open(os.path.join(directory, name + ".json")) as f:
        index = json.load(f)
    arr = np.load(os.path.join(directory, name + ".npy"))
    off = index["offsets"]
    if arr.shape != (off[-1],) or len(off) != index["rows"] + 1:
        raise ValueError(f"shard {name} in {directory} is inconsistent: {arr.shape[0]} tokens, "
                         f"index says {off[-1]} in {index['rows']} rows")
    rows = [{"tokens": torch.from_numpy(arr[off[r]:off[r + 1]].astype(np.int64)),
             "prompt_len": int(index["prompt_len"][r]), "prompt_id": int(index["prompt_ids"][r]),
             "stopped": bool(index["stopped"][r]), "temperature": float(index["temperature"]),
             "shard": name} for r in range(index["rows"])]
    return index, rows


def list_shards(directory: str, split: str) -> list[str]:
    """Names of the finished shards of ``split`` in ``directory``, sorted."""
    if not os.path.isdir(directory):
        return []
    return sorted(f[:-5] for f in os.listdir(directory)
                  if f.startswith(split + "_") and f.endswith(".json"))


def load_rows(directory: str, names: Sequence[str]) -> list[dict]:
    """Rows of the named shards, in order."""
    rows = []
    for n in names:
        rows += read_shard(directory, n)[1]
    return rows


def check_dataset(directory: str, info: dict) -> None:
    """Record ``info`` in ``directory/dataset.json``, or check it equals the recorded one
    (shards of another target or other settings must not be mixed)."""
    path = os.path.join(directory, "dataset.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), info.get(k)) for k in set(old) | set(info) if old.get(k) != info.get(k)}
        if diff:
            raise SystemExit(f"{directory} holds shards made with other settings {diff} (recorded, now); "
                             "use another --tokens-dir or the recorded settings")
        return
    os.makedirs(directory, exist_ok=True)
    _atomic_write_bytes(path, lambda f: f.write(json.dumps(info, indent=2, sort_keys=True).encode()))


def dataset_stats(directory: str) -> dict:
    """Rows, tokens and sampled (response) tokens per split, from the shard indexes only."""
    out: dict[str, dict] = {}
    if not os.path.isdir(directory):
        return out
    for f in sorted(os.listdir(directory)):
        if not f.endswith(".json") or f == "dataset.json":
            continue
        with open(os.path.join(directory, f)) as fh:
            ix = json.load(fh)
        split = f.rsplit("_", 1)[0]
        s = out.setdefault(split, {"shards": 0, "rows": 0, "tokens": 0, "sampled_tokens": 0, "wall_s": 0.0})
        s["shards"] += 1
        s["rows"] += ix["rows"]
        s["tokens"] += ix["offsets"][-1]
        s["sampled_tokens"] += ix["offsets"][-1] - sum(ix["prompt_len"])
        s["wall_s"] += float(ix.get("wall_s", 0.0))
    return out

