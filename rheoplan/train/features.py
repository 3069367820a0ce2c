"""Features and soft targets at training time: batched teacher-forced target forwards.

A token shard (``rheoplan.train.tokens``) stores only token ids. For a chunk of rows the
trainer needs, per position ``t`` of each row:

* ``feats[t]``: the inputs of the EAGLE-3 layers (``hf_target.eagle3_layers``: ``2, L//2,
  L-3``) concatenated, ``3H`` floats — what an EAGLE-3 head pairs with token ``t + 1``;
* ``topk_ids[t]``, ``topk_logp[t]``: the top-``k`` of the target's next-token
  log-distribution (at T = 1) — the soft training target.

``teacher_forced`` computes them with one forward per batch of rows: rows are right
padded, and since attention is causal a real position never sees a pad, so no attention
mask and no position shift are needed (``tests/rheoplan/train`` checks a padded batch
against one forward per row). The forward runs in the target's dtype (the training
dtype); features touch the disk only when ``RowExamples`` is given a ``cache_dir``.

``RowExamples`` turns rows into training ``Example`` objects on demand, one chunk at a
time, which is what ``train.train_head`` and ``train.evaluate`` consume.

Example (a tiny random model):
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=50)).eval()
    >>> rows = teacher_forced(m, [{"tokens": torch.tensor([1, 2, 3]), "prompt_len": 2}], topk=8)
    >>> rows[0]["feats"].shape, rows[0]["topk_ids"].shape
    (torch.Size([3, 96]), torch.Size([3, 8]))
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import replace
from typing import Sequence

import torch

from rheoplan.models.hf_target import eagle3_layers
from rheoplan.train import train as tr


def capture_indices(model: torch.nn.Module) -> list[int]:
    """``hidden_states`` indices of the EAGLE-3 layers' inputs (input of layer i = index i)."""
    return eagle3_layers(int(model.config.num_hidden_layers))


#: positions per block in ``top_log_probs``
SOFT_BLOCK = 16


def top_log_probs(logits: torch.Tensor, k: int, block: int = SOFT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of ``log_softmax(logits.float())`` over the last dimension,
    and their indices (``topk``'s pair), computed ``block`` positions at a time.

    Why in blocks: over a whole forward's logits (hundreds of positions x 49,152 entries)
    the float copy, the log-softmax and the top-k each stream hundreds of MB through memory;
    a block of 16 positions (3 MB in float32) stays in cache. On the 2-core AVX2-only AMD
    EPYC, 620 positions of SmolLM2 logits took 173-178 ms whole and 59-64 ms in blocks of
    8-16; the whole-tensor way was 9% of a teacher-forced forward's time (torch.profiler).

    Example:
        >>> x = torch.tensor([[[0.0, 1.0, 2.0]], [[3.0, 0.0, 0.0]]])
        >>> lp, ids = top_log_probs(x, 2, block=1)
        >>> ids.tolist(), torch.allclose(lp, torch.log_softmax(x, -1).topk(2, -1).values)
        ([[[2, 1]], [[0, 1]]], True)
    """
    if block < 1:
        raise ValueError(f"block={block}: allowed >= 1")
    flat = logits.reshape(-1, logits.shape[-1])
    lp = torch.empty(flat.shape[0], k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(flat.shape[0], k, dtype=torch.int64, device=logits.device)
    for s in range(0, flat.shape[0], block):
        torch.topk(torch.log_softmax(flat[s:s + block].float(), dim=-1), k, dim=-1, out=(lp[s:s + block], ids[s:s + block]))
    return lp.reshape(*logits.shape[:-1], k), ids.reshape(*logits.shape[:-1], k)


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, rows: Sequence[dict], *, topk: int) -> list[dict]:
    """Each row (``tokens`` int tensor, ``prompt_len``) with ``feats`` float32 ``[m, 3H]``,
    ``topk_ids`` int64 ``[m, k]`` and ``topk_logp`` float32 ``[m, k]`` added (a new dict)."""
    if not rows:
        return []
    if topk < 1:
        raise ValueError(f"topk={topk}: allowed >= 1")
    idx = capture_indices(model)
    dev = next(model.parameters()).device
    lens = [int(r["tokens"].numel()) for r in rows]
    if min(lens) < 1:
        raise ValueError("rows: every row needs at least one token")
    ids = torch.zeros(len(rows), max(lens), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, :lens[i]] = r["tokens"].long()
    out = model(input_ids=ids.to(dev), output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[i] for i in idx], dim=-1).float().cpu()
    lp, tk = top_log_probs(out.logits, min(topk, out.logits.shape[-1]))
    lp, tk = lp.cpu(), tk.cpu()
    return [{**r, "feats": feats[i, :n], "topk_ids": tk[i, :n], "topk_logp": lp[i, :n]}
            for i, (r, n) in enumerate(zip(rows, lens))]


def model_digest(model: torch.nn.Module) -> str:
    """A short digest of ``model``'s config, dtype and weights (every parameter's sum and
    the first values of each): what names ``RowExamples``' files on disk, so features of
    another model or another precision are never read for this one."""
    h = hashlib.sha1()
    cfg = getattr(model, "config", None)
    h.update((cfg.to_json_string() if hasattr(cfg, "to_json_string") else repr(cfg)).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().flatten()
            h.update(f"{name}|{p.dtype}|{tuple(p.shape)}|{float(flat.float().sum()):.9g}|".encode())
            h.update(flat[:8].float().numpy().tobytes())
    return h.hexdigest()[:16]


#: most padding a teacher-forced forward may carry, as a share of its positions
PAD_SHARE = 1 / 16


def forward_groups(lengths: Sequence[int], batch_tokens: int, pad_share: float = PAD_SHARE) -> list[list[int]]:
    """Indices of rows of ``lengths`` grouped into teacher-forced forwards: longest first, a
    row joining the forward before it while the forward stays within ``batch_tokens``
    positions, padding included, and its padding within ``pad_share`` of them; otherwise it
    starts a forward of its own (a row longer than ``batch_tokens`` runs alone).

    Why not fill each forward up to ``batch_tokens``: the rows of a training chunk differ in
    length, and padded to the longest, 32% of the positions such forwards computed were
    padding (6,268 rows of the first 200 training shards, 1,024-pair chunks, 2,048-token
    forwards), while a forward of one row multiplies as fast per position (the few-row
    kernel's products ran at 42-65 GMAC/s from 32 to 2,048 rows here). On the 2-core
    AVX2-only AMD EPYC (bfloat16, 12 training chunks, two rounds alternating) features came
    at 302-325 pairs/s with these groups against 187-194 filling each forward (docs/train.md,
    "Time on a 2-core machine").

    Example:
        >>> forward_groups([300, 120, 300, 290, 118, 40], batch_tokens=1024)
        [[0, 2, 3], [1, 4], [5]]
    """
    if batch_tokens < 1 or not 0 <= pad_share < 1:
        raise ValueError(f"batch_tokens={batch_tokens}, pad_share={pad_share}: allowed >= 1 and 0 <= share < 1")
    groups: list[list[int]] = []
    longest = real = 0
    for i in sorted(range(len(lengths)), key=lambda k: -int(lengths[k])):
        n = int(lengths[i])
        if groups and longest * (len(groups[-1]) + 1) <= batch_tokens and \
                longest * (len(groups[-1]) + 1) - (real + n) <= pad_share * longest * (len(groups[-1]) + 1):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            longest = real = n
    return groups


class RowExamples:
    """Training examples over token-only rows, made on demand by ``teacher_forced``.

    ``lengths()`` (pairs per row) is all that packing needs; ``get(indices)`` runs the
    target over those rows (rows of nearly equal length together, at most ``batch_tokens``
    padded tokens a forward: ``forward_groups``) and returns their ``Example`` objects.
    ``cache=True`` keeps what was made (small sets, e.g. the held-out rows evaluated after
    every epoch).

    ``cache_gb`` keeps made examples in memory until they take that many GB (rows made
    after that are made again when asked for): a training run's later epochs then skip
    the target forwards of the cached rows, which are most of a step's time. Cached
    features are stored in the target's dtype, which loses nothing (they are its hidden
    states); ``collate`` turns them back to float32.

    ``cache_dir`` also keeps every made row on disk (one file per row, about 3.8 KB per
    position for SmolLM2 in bfloat16, top-32): a later epoch, a resumed sitting or a new run
    over the same rows reads the file instead of running the target. A file is named by a
    digest of the row's tokens, ``topk`` and the target (``model_digest``: its config, dtype
    and weights), so a changed model or row never reads a stale file. Files are written
    whole or not at all (a temporary file renamed), so an interrupted run leaves none half
    written.
    """

    def __init__(self, model: torch.nn.Module, rows: Sequence[dict], *, topk: int, shared_prefix: int,
                 prompt_weight: float, batch_tokens: int = 2048, cache: bool = False,
                 cache_gb: float | None = None, cache_dir: str | os.PathLike | None = None) -> None:
        if cache_gb is not None and not cache_gb >= 0:
            raise ValueError(f"cache_gb={cache_gb}: allowed >= 0 (GB of memory for cached examples)")
        self.model, self.rows, self.topk = model, list(rows), topk
        self.shared_prefix, self.prompt_weight = shared_prefix, prompt_weight
        self.batch_tokens = batch_tokens
        self._cache = {} if (cache or cache_gb) else None
        self._cache_left = None if cache_gb is None else int(cache_gb * 2**30)
        self._cache_budget = self._cache_left
        self._store_dtype = next(model.parameters()).dtype
        self._dir = None if cache_dir is None else os.fspath(cache_dir)
        self._digest = None
        if self._dir is not None:
            os.makedirs(self._dir, exist_ok=True)
            self._digest = model_digest(model)
        self.disk_hits = 0  #: rows read from ``cache_dir`` instead of made

    def pair_bytes(self) -> int:
        """Memory of one cached pair (features in the target's dtype, top-k ids and log-probs,
        token, weight, flag): what ``cache_gb`` is spent on."""
        feat = 3 * int(self.model.config.hidden_size) * torch.finfo(self._store_dtype).bits // 8
        return feat + self.topk * (8 + 4) + 8 + 4 + 1

    def features_bytes(self) -> int:
        """Memory the features of all rows take once made (``pair_bytes`` a pair): what a
        ``cache_gb`` budget is weighed against."""
        return sum(self.lengths()) * self.pair_bytes()

    def made_again_share(self) -> float:
        """The share of a later epoch's pairs whose features it makes again, by target
        forwards: 0 with a ``cache_dir`` (every row is read back) or an unbounded cache, 1
        with neither cache, and with ``cache_gb`` the share of the features that budget
        does not hold. What a training run's ETA prices its later epochs with
        (``train.run_eta_s``)."""
        if self._dir is not None or (self._cache is not None and self._cache_budget is None):
            return 0.0
        if self._cache is None:
            return 1.0
        return 1.0 - min(1.0, self._cache_budget / max(self.features_bytes(), 1))

    def cached_rows(self) -> int:
        return 0 if self._cache is None else len(self._cache)

    def _keep(self, made: dict) -> None:
        """Add what ``get`` made to the cache (features in the target's dtype) while the
        budget lasts."""
        for i, ex in made.items():
            if ex is not None:
                # own copies: the made tensors are views of the whole batch's outputs, padding
                # included, which a cached view would keep alive
                ex = replace(ex, feats=ex.feats.to(self._store_dtype, copy=True), topk_ids=ex.topk_ids.clone(),
                             topk_logp=ex.topk_logp.clone(), tokens=ex.tokens.clone())
            if self._cache_left is not None:
                size = 0 if ex is None else sum(t.numel() * t.element_size() for t in
                                               (ex.tokens, ex.feats, ex.topk_ids, ex.topk_logp, ex.weight, ex.response))
                if size > self._cache_left:
                    continue
                self._cache_left -= size
            self._cache[i] = ex

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        return [max(int(r["tokens"].numel()) - 1, 0) for r in self.rows]

    def _path(self, i: int) -> str:
        r = self.rows[i]
        h = hashlib.sha1(f"{self._digest}|topk={self.topk}|".encode())
        h.update(r["tokens"].to(torch.int64).numpy().tobytes())
        return os.path.join(self._dir, h.hexdigest()[:2], h.hexdigest() + ".pt")

    def _load(self, i: int) -> dict | None:
        path = self._path(i)
        if not os.path.exists(path):
            return None
        d = torch.load(path, weights_only=True)
        return {**self.rows[i], "feats": d["feats"], "topk_ids": d["topk_ids"].long(), "topk_logp": d["topk_logp"]}

    def _save(self, i: int, row: dict) -> None:
        path = self._path(i)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        # own copies in the stored dtypes: the made tensors are views of the whole batch
        torch.save({"feats": row["feats"].to(self._store_dtype, copy=True),
                    "topk_ids": row["topk_ids"].to(torch.int32, copy=True),
                    "topk_logp": row["topk_logp"].clone()}, tmp)
        os.replace(tmp, path)

    def _example(self, row: dict) -> tr.Example | None:
        return tr.make_example(row, shared_prefix=self.shared_prefix, prompt_weight=self.prompt_weight)

    def get(self, indices: Sequence[int]) -> list[tr.Example]:
        want = [i for i in indices if self._cache is None or i not in self._cache]
        made: dict[int, tr.Example | None] = {}
        if self._dir is not None:
            for i in want:
                row = self._load(i)
                if row is not None:
                    made[i] = self._example(row)
                    self.disk_hits += 1
            want = [i for i in want if i not in made]
        for b in forward_groups([int(self.rows[i]["tokens"].numel()) for i in want], self.batch_tokens):
            b = [want[k] for k in b]
            for j, row in zip(b, teacher_forced(self.model, [self.rows[k] for k in b], topk=self.topk)):
                if self._dir is not None:
                    self._save(j, row)
                made[j] = self._example(row)
        if self._cache is not None:
            self._keep(made)
            made = {**made, **{i: self._cache[i] for i in indices if i in self._cache}}
        return [made[i] for i in indices if made[i] is not None]


def calibration_scale(model: torch.nn.Module, rows: Sequence[dict], *, n_rows: int, seed: int,
                      batch_tokens: int) -> torch.Tensor:
    """``train.feature_scale`` of ``n_rows`` of ``rows`` drawn with ``seed`` (all of them
    when fewer), their features made by teacher-forced forwards of ``model`` in batches of
    ``batch_tokens`` (64 rows at once would not fit): the per-channel preconditioner a
    training run feeds its head with."""
    calib = random.Random(seed).sample(list(rows), min(n_rows, len(rows)))
    src = RowExamples(model, calib, topk=1, shared_prefix=0, prompt_weight=1.0, batch_tokens=batch_tokens)
    return tr.feature_scale({"feats": e.feats} for e in src.get(range(len(calib))))
