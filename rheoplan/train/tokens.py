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
  ``wall_s`` (sampler time spent on this shard's rows); shards of the refill sampler also
  ``rng: "row"``, ``row_seeds`` (each row's own stream) and ``live_rows``.

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
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from rheoplan.models.growing_cache import grow_in_place


# --------------------------------------------------------------------------------------
# Batched sampling (tokens only)
# --------------------------------------------------------------------------------------

def _forward_kwargs(model: torch.nn.Module) -> tuple[str, bool]:
    """The cache argument's name (transformers 5.x ``cache``, 4.x ``past_key_values``) and
    whether the model accepts ``logits_to_keep`` (then only the last position's logits are
    computed: a batch-64 prefill's full logits would be ~1 GB for a 49k vocabulary)."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


@dataclass
class Request:
    """One row to sample: its prompt, its own random stream and its limits.

    ``generator`` is this row's private stream (one multinomial draw per sampled token), so
    what a row samples does not depend on which rows share its batch (up to float
    rounding); ``key`` is the caller's handle, returned with the row."""

    key: object
    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float
    generator: torch.Generator | None = None

    def __post_init__(self):
        if len(self.prompt) == 0:
            raise ValueError(f"request {self.key!r}: prompt is empty (expected at least one token id)")
        if not self.temperature >= 0:
            raise ValueError(f"request {self.key!r}: temperature={self.temperature}: allowed >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.key!r}: max_new_tokens={self.max_new_tokens}: allowed >= 1")


def row_generator(seed: int) -> torch.Generator:
    """A CPU generator for one row's draws."""
    return torch.Generator().manual_seed(int(seed))


def _cache_layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None or any(getattr(l, "is_sliding", False) or not hasattr(l, "keys") for l in layers):
        raise ValueError("refill sampling needs a transformers DynamicCache of full-attention layers "
                         "(keys/values of shape [batch, heads, length, head_dim]); this model's cache is not one")
    return layers


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` ([..., length, d] or [batch, length]) with ``n`` zero columns prepended."""
    if n == 0:
        return x
    return torch.nn.functional.pad(x, (0, 0, n, 0) if x.dim() == 4 else (n, 0))


class _Batch:
    """The live rows: a KV cache, the 2-D attention mask over its columns (0 = padding),
    per row the position of its last fed token and the token to feed next.

    Every row's valid columns are contiguous and end at the last column (rows are left
    padded), so the columns that are padding in every row form a prefix; ``trim`` drops it,
    which keeps the cache as long as the oldest live row needs, not as long as the run."""

    def __init__(self):
        self.cache = None
        self.attn = torch.zeros(0, 0, dtype=torch.int64)
        self.last_pos = torch.zeros(0, dtype=torch.int64)
        #: per slot: request, sampled tokens, wall-time share; None: finished, not yet dropped
        self.rows: list[dict | None] = []

    def __len__(self):
        return len(self.rows)

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.int64)
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.attn, self.last_pos = None, self.attn[:0], self.last_pos[:0]
            return
        dev = self.attn.device
        self.cache.batch_select_indices(idx.to(dev))
        self.attn, self.last_pos = self.attn[idx.to(dev)], self.last_pos[idx.to(dev)]
        self.trim()

    def join(self, cache, attn: torch.Tensor, last_pos: torch.Tensor, rows: list[dict]) -> None:
        """Append rows prefilled into their own ``cache``; the shorter side is left padded."""
        if self.cache is None:
            self.cache, self.attn, self.last_pos, self.rows = cache, attn, last_pos, rows
            return
        L, P = self.attn.shape[1], attn.shape[1]
        n = max(L, P)
        for a, b in zip(_cache_layers(self.cache), _cache_layers(cache)):
            a.keys = torch.cat([_left_pad(a.keys, n - L), _left_pad(b.keys, n - P)], 0)
            a.values = torch.cat([_left_pad(a.values, n - L), _left_pad(b.values, n - P)], 0)
        self.attn = torch.cat([_left_pad(self.attn, n - L), _left_pad(attn, n - P)], 0)
        self.last_pos = torch.cat([self.last_pos, last_pos])
        self.rows += rows
        self.trim()

    def trim(self) -> None:
        lead = int((self.attn.cumsum(1) == 0).sum(1).min())
        if lead:
            for layer in _cache_layers(self.cache):
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
            self.attn = self.attn[:, lead:]


def _draw(logits: torch.Tensor, rows: list[dict]) -> list[int]:
    """One token per row: plain multinomial at the row's temperature (argmax at 0) by
    inverse CDF, with one uniform from the row's own stream per token. Softmax and cumsum
    run along each row, so a row's law ignores its batch-mates; the cumsum is in float64
    (float32 over a 49k vocabulary would shift the tail's boundaries by ~1e-4)."""
    logits = logits.to(torch.float32).cpu()
    temp = torch.tensor([r["req"].temperature for r in rows], dtype=torch.float32)
    hot = temp > 0
    out = logits.argmax(-1)
    if bool(hot.any()):
        probs = torch.softmax(logits[hot] / temp[hot, None], dim=-1)
        cdf = probs.to(torch.float64).cumsum(-1)
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=r["req"].generator)
                       for r, h in zip(rows, hot.tolist()) if h])
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        out[hot] = pick.clamp(max=logits.shape[-1] - 1)
    return out.tolist()


@torch.no_grad()
def sample_refill(model: torch.nn.Module, feed, *, live_rows: int, eos_id: int, pad_id: int | None = None,
                  refill_min: int | None = None, prefill_tokens: int = 8192, stats: dict | None = None):
    """Sample rows from a transformers causal LM with continuous refill; yields
    ``(request, row)`` as rows finish (in finishing order).

    ``feed(n)`` returns up to ``n`` new :class:`Request` s (fewer or none when nothing is
    ready; the sampler stops when no row is live and ``feed`` returns none). Up to
    ``live_rows`` rows decode together; a row that finishes (EOS or its ``max_new_tokens``)
    stays in the batch, fed a pad token and its logits unread, until ``refill_min``
    (default ``live_rows // 8``) rows have finished; then they leave together (one gather
    of the cache, where one row at a time gathered it after most steps; between gathers
    the KV cache appends in place, ``growing_cache.GrowingLayer``), and waiting rows are
    prefilled (left padded among themselves, in
    groups of at most ``prefill_tokens`` padded tokens) and join: the joiners' KV or the
    running cache is left padded to the longer of the two, the padding masked, each row
    with its own position ids, so a row's logits are those of a forward over the row alone
    up to float rounding. Columns that are padding in every row are dropped.

    Each row draws from its own ``request.generator``, one multinomial per token, so its
    tokens do not depend on the schedule (which rows run together, refill timing) beyond
    float rounding. ``row``: ``tokens`` (prompt then sampled tokens, EOS excluded),
    ``prompt_len``, ``stopped`` (sampled EOS), ``wall_s`` (this row's share of the
    forwards it took part in: each forward's time split evenly over its rows).

    ``stats`` (optional dict) is kept up to date for progress lines: ``drawn`` (tokens
    sampled so far, rows still running included), ``live`` (rows), ``width`` (cache columns).
    """
    if live_rows < 1:
        raise ValueError(f"live_rows={live_rows}: allowed >= 1")
    refill_min = max(1, live_rows // 8) if refill_min is None else refill_min
    if not 1 <= refill_min <= live_rows:
        raise ValueError(f"refill_min={refill_min}: allowed 1..live_rows ({live_rows})")
    if prefill_tokens < 1:
        raise ValueError(f"prefill_tokens={prefill_tokens}: allowed >= 1")
    from transformers import DynamicCache

    ckw, has_keep = _forward_kwargs(model)
    keep_kw = {"logits_to_keep": 1} if has_keep else {}
    dev = next(model.parameters()).device
    pad = eos_id if pad_id is None else pad_id
    batch = _Batch()
    nxt: list[int] = []  # per slot: the token sampled last, fed by the next forward
    stats = {} if stats is None else stats
    stats.update(drawn=0, live=0, width=0)

    def finished(r: dict, t: int) -> bool:
        if t == eos_id:
            r["stopped"] = True
            return True
        r["gen"].append(t)
        stats["drawn"] += 1
        return len(r["gen"]) >= r["req"].max_new_tokens

    def emit(r: dict):
        req = r["req"]
        return req, {"tokens": [int(t) for t in req.prompt] + r["gen"], "prompt_len": len(req.prompt),
                     "stopped": r["stopped"], "wall_s": r["wall_s"]}

    while True:
        # Finished rows stay in the batch (fed a pad token, their logits unread) until
        # refill_min of them have finished: dropping rows gathers the whole cache, and
        # between two gathers the cache's appends stay in place.
        done: list[dict] = []
        alive = [i for i, r in enumerate(batch.rows) if r is not None]
        if len(alive) < len(batch) and (len(batch) - len(alive) >= refill_min or not alive):
            batch.select(alive)
            nxt = [nxt[i] for i in alive]
        # Refill: prefill waiting rows in groups and let them join the running batch.
        free = live_rows - len(batch)
        if free >= refill_min or len(batch) == 0:
            reqs = list(feed(free))
            if len(reqs) > free:
                raise ValueError(f"feed({free}) returned {len(reqs)} requests")
            g0 = 0
            while g0 < len(reqs):
                g1, P = g0, 0
                while g1 < len(reqs) and (g1 == g0 or max(P, len(reqs[g1].prompt)) * (g1 + 1 - g0) <= prefill_tokens):
                    P = max(P, len(reqs[g1].prompt))
                    g1 += 1
                group = reqs[g0:g1]
                g0 = g1
                ids = torch.full((len(group), P), pad, dtype=torch.int64)
                attn = torch.zeros(len(group), P, dtype=torch.int64)
                for r, q in enumerate(group):
                    ids[r, P - len(q.prompt):] = torch.tensor(list(q.prompt), dtype=torch.int64)
                    attn[r, P - len(q.prompt):] = 1
                ids, attn = ids.to(dev), attn.to(dev)
                pos = (attn.cumsum(-1) - 1).clamp(min=0)
                cache = DynamicCache(config=model.config)
                grow_in_place(cache)  # decode steps append in place, not by copying the cache
                t0 = time.perf_counter()
                out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **keep_kw,
                            **{ckw: cache})
                rows = [{"req": q, "gen": [], "stopped": False, "wall_s": 0.0} for q in group]
                toks = _draw(out.logits[:, -1], rows)
                dt = (time.perf_counter() - t0) / len(group)
                keep = []
                for i, (r, t) in enumerate(zip(rows, toks)):
                    r["wall_s"] += dt
                    (done.append(r) if finished(r, t) else keep.append(i))
                if keep:
                    idx = torch.tensor(keep, dtype=torch.int64, device=dev)
                    cache.batch_select_indices(idx)
                    batch.join(cache, attn[idx], pos[idx, -1], [rows[i] for i in keep])
                    nxt += [toks[i] for i in keep]
        alive = [i for i, r in enumerate(batch.rows) if r is not None]
        stats.update(live=len(alive), width=int(batch.attn.shape[1]))
        for r in done:
            yield emit(r)
        if not alive:
            if done:
                continue  # every joiner finished at once: ask the feed again
            return
        # One decode step for every row of the batch (finished ones included, see above).
        t0 = time.perf_counter()
        batch.attn = torch.cat([batch.attn, torch.ones(len(batch), 1, dtype=batch.attn.dtype, device=dev)], 1)
        batch.last_pos = batch.last_pos + 1
        out = model(input_ids=torch.tensor(nxt, dtype=torch.int64, device=dev)[:, None], attention_mask=batch.attn,
                    position_ids=batch.last_pos[:, None], use_cache=True, **keep_kw, **{ckw: batch.cache})
        logits = out.logits[:, -1] if len(alive) == len(batch) else out.logits[alive, -1]
        toks = _draw(logits, [batch.rows[i] for i in alive])
        dt = (time.perf_counter() - t0) / len(alive)
        done = []
        for i, t in zip(alive, toks):
            r = batch.rows[i]
            r["wall_s"] += dt
            if finished(r, t):
                done.append(r)
                batch.rows[i] = None
                nxt[i] = pad
            else:
                nxt[i] = t
        for r in done:
            yield emit(r)


def sample_tokens(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                  temperature: float, eos_id: int, generator: torch.Generator | None = None,
                  pad_id: int | None = None, live_rows: int | None = None) -> list[dict]:
    """Sample continuations of a list of prompts (:func:`sample_refill` with every row at
    once, or ``live_rows`` at a time); rows returned in prompt order.

    Row ``r`` draws from its own stream, seeded by the ``r``-th of ``len(prompts)`` seeds
    drawn from ``generator`` (the global generator when None). Sampling is plain
    multinomial at ``temperature`` (no top-k or top-p); ``temperature == 0`` is greedy.

    Returns:
        one dict per row: ``tokens`` (list of ints: prompt then sampled tokens, EOS
        excluded), ``prompt_len``, ``stopped`` (sampled EOS).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty token id lists")
    seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
    queue = [Request(r, list(p), max_new_tokens, temperature, row_generator(s))
             for r, (p, s) in enumerate(zip(prompts, seeds))]

    def feed(n):
        out = queue[:n]
        del queue[:n]
        return out

    out: list[dict | None] = [None] * len(prompts)
    for req, row in sample_refill(model, feed, live_rows=live_rows or len(prompts), eos_id=eos_id,
                                  pad_id=pad_id, refill_min=1):
        row.pop("wall_s")
        out[req.key] = row
    return out


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


def check_dataset(directory: str, info: dict, grows: Callable[[dict | None], str | None] | None = None) -> None:
    """Record ``info`` in ``directory/dataset.json``, or check it equals the recorded one
    (shards of another target or other settings must not be mixed).

    ``info["more"]`` (the prompts appended to the plan, ``--more-prompts``) may differ from
    the record where ``grows(recorded_more)`` returns None: the extension grew and the
    recorded one is its prefix, so every shard present stays valid and the record is
    replaced. Otherwise ``grows`` returns why not, and that is the error.
    """
    path = os.path.join(directory, "dataset.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), info.get(k)) for k in set(old) | set(info) if old.get(k) != info.get(k)}
        if "more" in diff and grows is not None:
            why = grows(old.get("more"))
            if why is not None:
                raise SystemExit(f"{directory}: {why}")
            del diff["more"]
        if diff:
            raise SystemExit(f"{directory} holds shards made with other settings {diff} (recorded, now); "
                             "use another --tokens-dir or the recorded settings")
        if old.get("more") == info.get("more"):
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

