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
dtype), so features never touch the disk.

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

from dataclasses import replace
from typing import Sequence

import torch

from rheoplan.models.hf_target import eagle3_layers
from rheoplan.train import train as tr


def capture_indices(model: torch.nn.Module) -> list[int]:
    """``hidden_states`` indices of the EAGLE-3 layers' inputs (input of layer i = index i)."""
    return eagle3_layers(int(model.config.num_hidden_layers))


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
    lp, tk = torch.log_softmax(out.logits.float(), dim=-1).topk(min(topk, out.logits.shape[-1]), dim=-1)
    lp, tk = lp.cpu(), tk.cpu()
    return [{**r, "feats": feats[i, :n], "topk_ids": tk[i, :n], "topk_logp": lp[i, :n]}
            for i, (r, n) in enumerate(zip(rows, lens))]


class RowExamples:
    """Training examples over token-only rows, made on demand by ``teacher_forced``.

    ``lengths()`` (pairs per row) is all that packing needs; ``get(indices)`` runs the
    target over those rows (in batches of at most ``batch_tokens`` padded tokens) and
    returns their ``Example`` objects. ``cache=True`` keeps what was made (small sets,
    e.g. the held-out rows evaluated after every epoch).

    ``cache_gb`` keeps made examples in memory until they take that many GB (rows made
    after that are made again when asked for): a training run's later epochs then skip
    the target forwards of the cached rows, which are most of a step's time. Cached
    features are stored in the target's dtype, which loses nothing (they are its hidden
    states); ``collate`` turns them back to float32.
    """

    def __init__(self, model: torch.nn.Module, rows: Sequence[dict], *, topk: int, shared_prefix: int,
                 prompt_weight: float, batch_tokens: int = 2048, cache: bool = False,
                 cache_gb: float | None = None) -> None:
        if cache_gb is not None and not cache_gb >= 0:
            raise ValueError(f"cache_gb={cache_gb}: allowed >= 0 (GB of memory for cached examples)")
        self.model, self.rows, self.topk = model, list(rows), topk
        self.shared_prefix, self.prompt_weight = shared_prefix, prompt_weight
        self.batch_tokens = batch_tokens
        self._cache = {} if (cache or cache_gb) else None
        self._cache_left = None if cache_gb is None else int(cache_gb * 2**30)
        self._store_dtype = next(model.parameters()).dtype

    def pair_bytes(self) -> int:
        """Memory of one cached pair (features in the target's dtype, top-k ids and log-probs,
        token, weight, flag): what ``cache_gb`` is spent on."""
        feat = 3 * int(self.model.config.hidden_size) * torch.finfo(self._store_dtype).bits // 8
        return feat + self.topk * (8 + 4) + 8 + 4 + 1

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

    def get(self, indices: Sequence[int]) -> list[tr.Example]:
        want = [i for i in indices if self._cache is None or i not in self._cache]
        made: dict[int, tr.Example | None] = {}
        # Longest first, so a batch's padding stays small.
        order = sorted(want, key=lambda i: -int(self.rows[i]["tokens"].numel()))
        b: list[int] = []
        for i in order + [None]:
            n = 0 if i is None else int(self.rows[i]["tokens"].numel())
            if b and (i is None or n * (len(b) + 1) > self.batch_tokens):
                for j, row in zip(b, teacher_forced(self.model, [self.rows[k] for k in b], topk=self.topk)):
                    made[j] = tr.make_example(row, shared_prefix=self.shared_prefix, prompt_weight=self.prompt_weight)
                b = []
            if i is not None:
                b.append(i)
        if self._cache is not None:
            self._keep(made)
            made = {**made, **{i: self._cache[i] for i in indices if i in self._cache}}
        return [made[i] for i in indices if made[i] is not None]
