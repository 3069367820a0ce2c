"""Train an EAGLE-3 head on self-distillation data (token shards, ``tokens``; features and
soft targets recomputed per chunk by ``features``).

Data layout (one *pair* per position, the same pairing ``Eagle3Draft`` uses at inference):
for a row ``x_0 .. x_{m-1}`` with features ``f_t`` and target distributions ``p_t``, pair
``j`` (``1 <= j < m``) is ``(f_{j-1}, x_j)`` at position ``j`` and its label is ``p_j``
(the distribution of ``x_{j+1}``).

Training-time test (EAGLE-3): step 1 feeds ``fc(f_{j-1})``; step ``k >= 2`` feeds the
head's own step-``k-1`` output at pair ``j-1`` (what a depth-``k-1`` tree node feeds its
child) and sees, like that node does at inference, the step-1 keys of pairs ``<= j-k+1``
(the committed prefix) plus its own chain of steps ``2..k`` (``ttt_mask`` spells it out).

Loss at each step: cross-entropy of the head's draft-vocabulary distribution against the
target's top-k distribution restricted to the draft vocabulary and renormalised (= KL up
to a constant), weighted ``step_decay ** (k-1)``. Positions of the shared system prompt
get weight 0, user-prompt positions ``prompt_weight``, response positions 1.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable, Sequence

import torch
from tqdm import tqdm

from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head
from rheoplan.models.eagle3.head import RowBlocks
from rheoplan.train.progress import RecentRate


# --------------------------------------------------------------------------------------
# Draft vocabulary
# --------------------------------------------------------------------------------------

def token_counts(rows: Iterable[dict], vocab_size: int, skip_prefix: int = 0) -> torch.Tensor:
    """How often each target token occurs in the rows (after the first ``skip_prefix``
    tokens of each, e.g. the shared system prompt): the draft vocabulary's ranking.

    Why sampled counts and not the target's probability mass: the rows are the target's
    own samples at T = 1, so a token's count is an unbiased estimate of the mass the
    target puts on it, and counting needs no target forward (at 1.5M tokens the estimate
    is tight for every token a 8k-entry draft vocabulary can hold).
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in rows:
        t = r["tokens"][skip_prefix:].long()
        counts.index_add_(0, t, torch.ones(t.numel(), dtype=torch.float64))
    return counts


def choose_draft_vocab(mass: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """Target ids of the draft vocabulary: the ``size`` ids of largest ``mass`` (ties: lower
    id first), ``always`` included, returned sorted ascending (draft id ``i`` = ``i``-th).

    Example:
        >>> choose_draft_vocab(torch.tensor([0., 5., 1., 3.]), 2).tolist()
        [1, 3]
        >>> choose_draft_vocab(torch.tensor([0., 5., 1., 3.]), 2, always=[0]).tolist()
        [0, 1]
    """
    V = mass.numel()
    if not 1 <= size <= V:
        raise ValueError(f"draft vocab size {size}: allowed 1..{V}")
    always = sorted(set(int(a) for a in always))
    if len(always) > size:
        raise ValueError(f"{len(always)} always-included ids exceed the draft vocab size {size}")
    # Stable sort on -mass: equal masses keep id order.
    order = torch.sort(-mass.double(), stable=True).indices.tolist()
    chosen = list(always)
    seen = set(always)
    for t in order:
        if len(chosen) == size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def target_to_draft_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab]`` int64: the draft id of each target id, -1 when not in the draft vocab.

    Consistent with the checkpoint's ``t2d`` (``t2d == (index >= 0)``) and ``d2t``
    (``index[i + d2t[i]] == i``).
    """
    idx = torch.full((vocab_size,), -1, dtype=torch.int64)
    idx[draft_ids] = torch.arange(draft_ids.numel())
    return idx


# --------------------------------------------------------------------------------------
# Head construction
# --------------------------------------------------------------------------------------

def head_config_for(target_config, draft_vocab_size: int) -> Eagle3Config:
    """An ``Eagle3Config`` whose layer matches the target's decoder layer sizes."""
    tc = target_config
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    scaling = getattr(tc, "rope_scaling", None) or rope or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None  # plain RoPE: the reference format leaves rope_scaling null
    elif scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return Eagle3Config(
        vocab_size=int(tc.vocab_size), draft_vocab_size=int(draft_vocab_size),
        hidden_size=int(tc.hidden_size), target_hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size), num_attention_heads=int(tc.num_attention_heads),
        num_key_value_heads=int(tc.num_key_value_heads), rms_norm_eps=float(tc.rms_norm_eps),
        rope_theta=float(theta), rope_scaling=scaling, hidden_act=str(tc.hidden_act),
        max_position_embeddings=int(tc.max_position_embeddings),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads))


def init_head(cfg: Eagle3Config, draft_ids: torch.Tensor, target_model: torch.nn.Module | None = None,
              seed: int = 0) -> Eagle3Head:
    """A fresh head with the vocab map set; with ``target_model``, ``lm_head`` starts as the
    target's output rows of the draft vocabulary and ``norm`` as the target's final norm
    (the head's output then lives in the target's last hidden space from step 0)."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    if cfg.draft_vocab_size != cfg.vocab_size:
        head.set_vocab_map(draft_ids)
    if target_model is not None:
        with torch.no_grad():
            out_w = target_model.get_output_embeddings().weight
            head.lm_head.weight.copy_(out_w[draft_ids].to(head.lm_head.weight.dtype))
            head.norm.weight.copy_(target_model.model.norm.weight)
    return head


def extend_vocab(head: Eagle3Head, target_model: torch.nn.Module, mass: torch.Tensor, size: int) -> Eagle3Head:
    """A copy of ``head`` whose draft vocabulary grows to ``size`` target tokens: its own
    tokens keep their trained output rows; the ``size - n`` tokens of largest ``mass`` not
    in it (the ranking of ``choose_draft_vocab``) are added, their rows the target's output
    rows carried into the head's output space by the affine map that least-squares fits the
    target's rows of the head's own tokens to the head's trained rows.

    Why the map: training moves the rows away from the target's (the shipped head's: cosine
    0.82 on average), and the target's rows put in unmapped left the extended head at 2.2%
    held-out top-1 against 48.6% before; mapped, 48.8%. Every other weight is copied.

    Example:
        >>> cfg = Eagle3Config(vocab_size=10, draft_vocab_size=4, hidden_size=8, intermediate_size=16,
        ...                    num_attention_heads=2, num_key_value_heads=1, head_dim=4)
        >>> target = torch.nn.Module(); target.get_output_embeddings = lambda: torch.nn.Linear(8, 10, bias=False)
        >>> h = init_head(cfg, torch.tensor([0, 2, 5, 7]))
        >>> extend_vocab(h, target, torch.arange(10.0), 6).target_ids().tolist()
        [0, 2, 5, 7, 8, 9]
    """
    old = head.target_ids()
    n = old.numel()
    V = head.config.vocab_size
    if mass.shape != (V,):
        raise ValueError(f"mass has shape {tuple(mass.shape)}: allowed ({V},), one entry per target token")
    if not n < size <= V:
        raise ValueError(f"size={size} is out of range: allowed {n + 1}..{V} (more than the head's {n} tokens)")
    ids = choose_draft_vocab(mass, size, always=old.tolist())  # sorted: old + the next by mass
    extra = ids[~torch.isin(ids, old)]
    new = init_head(replace(head.config, draft_vocab_size=size, extra=dict(head.config.extra)), ids)
    vocab_keys = ("lm_head.weight", "d2t", "t2d")  # new.lm_head is set below; the map by init_head
    got = new.load_state_dict({k: v for k, v in head.state_dict().items() if k not in vocab_keys}, strict=False)
    if got.unexpected_keys or set(got.missing_keys) - set(vocab_keys):  # every other weight copied
        raise ValueError(f"extend_vocab: weights not copied {sorted(set(got.missing_keys) - set(vocab_keys))}, "
                         f"unexpected {got.unexpected_keys}")
    out_w = target_model.get_output_embeddings().weight.detach()

    def target_rows(t: torch.Tensor) -> torch.Tensor:  # [len(t), H + 1]: the map's shift rides on the 1s
        return torch.cat([out_w[t].float(), torch.ones(t.numel(), 1)], 1)

    with torch.no_grad():
        trained = head.lm_head.weight.detach().float()
        A = torch.linalg.lstsq(target_rows(old), trained).solution
        w = new.lm_head.weight
        w[torch.searchsorted(ids, extra)] = (target_rows(extra) @ A).to(w.dtype)
        w[torch.searchsorted(ids, old)] = trained.to(w.dtype)
    return new


def feature_scale(rows: Iterable[dict], eps: float = 1e-3) -> torch.Tensor:
    """``[3H]`` float32: 1 / RMS of each feature channel over the data.

    Why: the residual streams of small LMs carry a few "massive activation" channels
    (SmolLM2: ~1e4 against ~1 elsewhere). Adam gives every fc weight the same step size,
    so the weights on those channels would move fc's output ~1e4 times faster than the
    rest and training diverges. Training feeds ``feats * scale`` (a fixed preconditioner);
    ``fold_feature_scale`` moves it into ``fc.weight`` for export, so the shipped head
    reads raw features like any EAGLE-3 head.
    """
    sq, n = None, 0
    for r in rows:
        f = r["feats"].float()
        sq = f.pow(2).sum(0) if sq is None else sq + f.pow(2).sum(0)
        n += f.shape[0]
    if sq is None:
        raise ValueError("no rows to compute the feature scale from")
    return 1.0 / (sq / n).sqrt().clamp(min=eps)


def fold_feature_scale(head: Eagle3Head, scale: torch.Tensor) -> None:
    """``fc(x * scale) == fc'(x)`` with ``fc'.weight = fc.weight * scale`` (in place)."""
    with torch.no_grad():
        head.fc.weight.mul_(scale.to(head.fc.weight)[None, :])


def unfold_feature_scale(head: Eagle3Head, scale: torch.Tensor) -> None:
    """The inverse of ``fold_feature_scale`` (in place): an exported head, which reads raw
    features, made to read ``feats * scale`` as training feeds them (``--init-from``)."""
    with torch.no_grad():
        head.fc.weight.div_(scale.to(head.fc.weight)[None, :])


# --------------------------------------------------------------------------------------
# Examples, packing, masks
# --------------------------------------------------------------------------------------

@dataclass
class Example:
    """One row as pairs (see the module docstring); all tensors have ``m - 1`` entries."""

    tokens: torch.Tensor  #: int64 x_j
    feats: torch.Tensor  #: f_{j-1} (float32 from ``features.teacher_forced``)
    topk_ids: torch.Tensor  #: int64 top-k target ids of p_j
    topk_logp: torch.Tensor  #: fp16
    weight: torch.Tensor  #: float32 loss weight of pair j
    response: torch.Tensor  #: bool, p_j predicts a response token (evaluation positions)


def common_prefix_len(rows: Sequence[dict]) -> int:
    """Length of the token prefix all rows share (the chat template's system turn)."""
    if not rows:
        return 0
    first = rows[0]["tokens"].tolist()
    n = len(first)
    for r in rows[1:]:
        t = r["tokens"].tolist()
        k = 0
        while k < min(n, len(t)) and t[k] == first[k]:
            k += 1
        n = k
    return n


def make_example(row: dict, *, shared_prefix: int, prompt_weight: float) -> Example | None:
    """Pairs of one row; None if the row has fewer than 2 tokens."""
    m = int(row["tokens"].numel())
    if m < 2:
        return None
    j = torch.arange(1, m)
    P = int(row["prompt_len"])
    response = j >= P - 1
    weight = torch.where(response, 1.0, torch.where(j >= shared_prefix, prompt_weight, 0.0)).float()
    return Example(tokens=row["tokens"][1:].long(), feats=row["feats"][:-1], topk_ids=row["topk_ids"][1:].long(),
                   topk_logp=row["topk_logp"][1:], weight=weight, response=response)


class ExampleList:
    """In-memory examples behind the interface ``train_head`` and ``evaluate`` read
    (``lengths()``, ``get(indices)``); ``features.RowExamples`` is the on-demand one."""

    def __init__(self, examples: Sequence[Example]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> list[int]:
        return [int(e.tokens.numel()) for e in self.examples]

    def get(self, indices: Sequence[int]) -> list[Example]:
        return [self.examples[i] for i in indices]

    def made_again_share(self) -> None:
        """None: these examples are made already, so every epoch runs at one pace
        (``features.RowExamples`` makes its rows in the first epoch)."""
        return None


def as_source(data) -> "ExampleList":
    """``data`` itself when it has ``lengths``/``get``, else an ``ExampleList`` over it."""
    return data if hasattr(data, "lengths") and hasattr(data, "get") else ExampleList(data)


def pack(lengths: Sequence[int], chunk_tokens: int, seed: int | None = None) -> list[list[int]]:
    """Group example indices into chunks of at most ``chunk_tokens`` pairs (an example
    longer than a chunk gets a chunk of its own; empty examples are left out). Shuffled
    when ``seed`` is given.

    Example:
        >>> pack([3, 3, 5, 0, 2], 6)
        [[0, 1], [2], [4]]
    """
    order = [i for i in range(len(lengths)) if lengths[i] > 0]
    if seed is not None:
        random.Random(seed).shuffle(order)
    chunks, cur, n = [], [], 0
    for i in order:
        L = int(lengths[i])
        if cur and n + L > chunk_tokens:
            chunks.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += L
    if cur:
        chunks.append(cur)
    return chunks


def ttt_mask(seq: torch.Tensor, local: torch.Tensor, k: int) -> torch.Tensor:
    """Bool ``[N, k*N]``: which keys the step-``k`` query of each pair may attend to.

    Keys are laid out ``[step 1 | step 2 | ... | step k]``, ``N`` each. Query (seq s, local
    i) at step k sees step-1 keys of seq s with local ``<= i-k+1`` and the step-``m`` key
    at local ``i-k+m`` for ``m = 2..k`` (its own chain). Step 1 is plain causal.
    Queries whose chain would start before the row (``i-k+1 < 0``) see only themselves
    (they carry no loss; this only keeps attention finite).

    Example: one row of 3 pairs, k=2: pair 2 sees step-1 keys 0,1 and step-2 key 2.
        >>> ttt_mask(torch.zeros(3, dtype=torch.long), torch.arange(3), 2).int().tolist()
        [[0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1]]
    """
    same = seq[:, None] == seq[None, :]
    qi, ki = local[:, None], local[None, :]
    blocks = [same & (ki <= qi - k + 1)]
    for m in range(2, k + 1):
        blocks.append(same & (ki == qi - k + m))
    return torch.cat(blocks, dim=1)


@dataclass
class Batch:
    tokens: torch.Tensor
    feats: torch.Tensor
    positions: torch.Tensor
    seq: torch.Tensor
    local: torch.Tensor
    topk_ids: torch.Tensor
    topk_logp: torch.Tensor
    weight: torch.Tensor
    response: torch.Tensor


def collate(examples: Sequence[Example], scale: torch.Tensor | None = None) -> Batch:
    """Concatenate examples into one packed sequence (block-diagonal attention via ``seq``);
    features are multiplied by ``scale`` (see ``feature_scale``) when given."""
    lens = [int(e.tokens.numel()) for e in examples]
    seq = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, n in enumerate(lens)])
    local = torch.cat([torch.arange(n) for n in lens])
    return Batch(tokens=torch.cat([e.tokens for e in examples]),
                 feats=torch.cat([e.feats for e in examples]).float() * (1.0 if scale is None else scale),
                 positions=local + 1, seq=seq, local=local,
                 topk_ids=torch.cat([e.topk_ids for e in examples]),
                 topk_logp=torch.cat([e.topk_logp for e in examples]).float(),
                 weight=torch.cat([e.weight for e in examples]),
                 response=torch.cat([e.response for e in examples]))


# --------------------------------------------------------------------------------------
# Forward, loss, metrics
# --------------------------------------------------------------------------------------

def shift_within_rows(h: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``out[i] = h[i-1]`` inside a row; zeros at each row's first pair."""
    out = torch.zeros_like(h)
    out[1:] = h[:-1]
    return out * (local > 0).to(h.dtype)[:, None]


def ttt_forward(head: Eagle3Head, embed: torch.Tensor, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Output hiddens ``[N, H]`` of steps ``1..steps`` (training-time test)."""
    emb = embed[batch.tokens]
    past = None
    hidden_in = batch.feats
    outs = []
    for k in range(1, steps + 1):
        # each row attends only within itself: one attention per row (``RowBlocks``), not one
        # over the whole chunk's dense mask
        allowed = RowBlocks.from_dense(ttt_mask(batch.seq, batch.local, k), batch.seq, batch.seq.repeat(k))
        h, past = head(emb, hidden_in, batch.positions, past, allowed)
        outs.append(h)
        hidden_in = shift_within_rows(h, batch.local)
    return outs


def soft_targets(topk_ids: torch.Tensor, topk_logp: torch.Tensor, t2d_index: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft ids ``[N, k]`` (0 where out of vocab), target probs ``[N, k]`` (0 where out of
    vocab), and the in-vocab probability mass ``[N]``."""
    d = t2d_index[topk_ids]
    p = topk_logp.float().exp() * (d >= 0)
    return d.clamp(min=0), p, p.sum(-1)


def overlap(p: torch.Tensor, q_at_d: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` over the target's top-k in the draft vocabulary, per
    position: ``p`` from ``soft_targets`` (0 out of vocab), ``q_at_d`` the head's law at its
    draft ids ``d``. The acceptance proxy's lower bound (``step_metrics``) and what the
    total-variation term of ``step_loss`` adds up to ``mass``."""
    return torch.minimum(p, q_at_d * (p > 0)).sum(-1)


def step_loss(logits: torch.Tensor, d: torch.Tensor, p: torch.Tensor, mass: torch.Tensor,
              weight: torch.Tensor, tv_weight: float = 0.0) -> torch.Tensor:
    """Weighted soft cross-entropy against ``p`` renormalised over the draft vocabulary,
    plus ``tv_weight`` times ``mass - overlap(p, q)``: the part of the total-variation
    distance the acceptance proxy sees (a drafted token at T = 1 is accepted with
    probability ``sum_x min(p, q)``, which the cross-entropy only pulls towards indirectly)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    lq = logq.gather(1, d)
    pn = p / mass.clamp(min=1e-9)[:, None]
    per = -(pn * lq).sum(-1)
    if tv_weight:
        per = per + tv_weight * (mass - overlap(p, lq.exp()))
    w = weight * (mass > 0)
    return (per * w).sum() / w.sum().clamp(min=1e-9)


@torch.no_grad()
def step_metrics(logits: torch.Tensor, batch: Batch, draft_ids: torch.Tensor, t2d_index: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, float]:
    """Sums over ``mask`` positions: top-1 agreement with the target's argmax, top-3 (the
    target's argmax among the head's 3 most probable tokens), and the T=1 acceptance proxy
    ``sum_x min(p, q)`` as a lower bound (top-k of p only) and an upper
    bound (adding ``min(p outside top-k, q outside top-k)``)."""
    logits, tk_ids, tk_lp = logits[mask].float(), batch.topk_ids[mask], batch.topk_logp[mask]
    q = torch.softmax(logits, dim=-1)
    top1 = draft_ids[logits.argmax(-1)] == tk_ids[:, 0]
    top3 = (draft_ids[logits.topk(min(3, logits.shape[-1]), dim=-1).indices] == tk_ids[:, :1]).any(-1)
    d, p, _ = soft_targets(tk_ids, tk_lp, t2d_index)
    qk = q.gather(1, d) * (p > 0)
    lower = overlap(p, qk)
    p_rest = (1 - tk_lp.float().exp().sum(-1)).clamp(min=0)
    q_rest = (1 - qk.sum(-1)).clamp(min=0)
    upper = lower + torch.minimum(p_rest, q_rest)
    return {"n": float(mask.sum()), "top1": float(top1.sum()), "top3": float(top3.sum()),
            "accept_lo": float(lower.sum()),
            "accept_hi": float(upper.sum())}


@torch.no_grad()
def evaluate(head: Eagle3Head, embed: torch.Tensor, examples, *, steps: int,
             chunk_tokens: int, draft_ids: torch.Tensor, t2d_index: torch.Tensor,
             autocast: bool = False, scale: torch.Tensor | None = None) -> dict[str, float]:
    """Per-step (= per draft depth) top-1 / top-3 accuracy and T=1 acceptance proxy on the
    response positions. ``examples``: a list of ``Example`` or a source (``as_source``)."""
    head.eval()
    src = as_source(examples)
    tot: dict[int, dict[str, float]] = {}
    loss_sum, loss_n = 0.0, 0
    for chunk in pack(src.lengths(), chunk_tokens):
        b = collate(src.get(chunk), scale)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = ttt_forward(head, embed, b, steps)
        d, p, mass = soft_targets(b.topk_ids, b.topk_logp, t2d_index)
        for k, h in enumerate(outs, 1):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = head.draft_logits(h)
            valid = b.response & (b.local >= k - 1)
            m = step_metrics(logits, b, draft_ids, t2d_index, valid)
            acc = tot.setdefault(k, dict.fromkeys(m, 0.0))
            for key, v in m.items():
                acc[key] += v
            if k == 1:
                loss_sum += float(step_loss(logits, d, p, mass, valid.float())) * float(valid.sum())
                loss_n += int(valid.sum())
    out = {"loss_step1": loss_sum / max(loss_n, 1)}
    for k, acc in tot.items():
        n = max(acc["n"], 1.0)
        out[f"top1_step{k}"] = acc["top1"] / n
        out[f"top3_step{k}"] = acc["top3"] / n
        out[f"accept_lo_step{k}"] = acc["accept_lo"] / n
        out[f"accept_hi_step{k}"] = acc["accept_hi"] / n
        out[f"positions_step{k}"] = acc["n"]
    return out


# --------------------------------------------------------------------------------------
# The training loop
# --------------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    epochs: int = 3
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_frac: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    chunk_tokens: int = 1024
    ttt_steps: int = 2
    step_decay: float = 0.8
    prompt_weight: float = 0.3
    #: weight of the total-variation term of ``step_loss`` (0: cross-entropy alone)
    tv_weight: float = 0.0
    autocast_bf16: bool = True
    seed: int = 0
    ckpt_every: int = 50
    log_every: int = 10


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    warm = max(1, int(total * cfg.warmup_frac))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def save_checkpoint(path: str, head: Eagle3Head, opt: torch.optim.Optimizer, step: int,
                    extra: dict | None = None) -> None:
    tmp = path + ".tmp"
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                "config": head.config.to_dict(), "extra": extra or {}}, tmp)
    os.replace(tmp, path)


def _total(earlier_s: float | None, t0: float) -> float | None:
    """Training wall time of every sitting so far (None when an earlier one's is unknown)."""
    return None if earlier_s is None else earlier_s + time.time() - t0


def make_optimizer(head: Eagle3Head, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``head``'s parameters, weight decay on its matrices only."""
    params = [p for _, p in head.named_parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def train_step(head: Eagle3Head, embed: torch.Tensor, opt: torch.optim.Optimizer, batch: Batch,
               cfg: TrainConfig, t2d_index: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One optimiser step on ``batch`` at the optimiser's current learning rate: the
    training-time test's ``cfg.ttt_steps`` forwards (in bfloat16 autocast when
    ``cfg.autocast_bf16``), their losses weighted by ``cfg.step_decay``, backward, gradient
    clipping, ``opt.step()``. Returns the loss, each step's loss and the gradient norm."""
    d, p, mass = soft_targets(batch.topk_ids, batch.topk_logp, t2d_index)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        outs = ttt_forward(head, embed, batch, cfg.ttt_steps)
        losses = []
        for k, h in enumerate(outs, 1):
            w = batch.weight * (batch.local >= k - 1)
            sel = w > 0
            logits = head.draft_logits(h[sel])
            losses.append(step_loss(logits, d[sel], p[sel], mass[sel], w[sel], cfg.tv_weight))
    loss = sum(cfg.step_decay ** k * l for k, l in enumerate(losses))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    opt.step()
    return loss, losses, gn


def run_eta_s(step: int, end: int, epoch_end: int, steps_per_s: float, *, first_epoch: bool = False,
              made_again: float | None = None, head_steps_per_s: float | None = None) -> float:
    """Seconds a training run has left after step ``step`` (1-based, done) of ``end``: the
    steps to ``epoch_end`` (where the current epoch ends) at ``steps_per_s``, the pace of
    late, and the later epochs' steps at that pace too, except in the first epoch of a
    source that makes its features then (``made_again``: the share of a later epoch's
    pairs made again, ``RowExamples.made_again_share``; None for a source that makes
    nothing). A later step then costs that share at this pace, which includes the target's
    forwards, and the rest at ``head_steps_per_s``, the pace of the head's steps alone
    (the features read back from memory or disk; reading them is not counted, so this is
    a lower bound there). Why: on the 2-core AVX2-only AMD EPYC a first-epoch step spent
    three quarters of its time in the target's forwards (py-spy, 2026-12-07), so an ETA
    that priced every later step at the first epoch's pace was hours too long.

    Example:
        >>> run_eta_s(10, 30, 10, 0.25, first_epoch=True, made_again=0.0, head_steps_per_s=1.0)
        20.0
        >>> run_eta_s(10, 30, 10, 0.25)  # one pace throughout
        80.0
    """
    if not steps_per_s > 0:
        raise ValueError(f"steps_per_s={steps_per_s}: allowed > 0")
    this_epoch, later = max(epoch_end - step, 0), max(end - max(epoch_end, step), 0)
    if not first_epoch or made_again is None or head_steps_per_s is None:
        return (this_epoch + later) / steps_per_s
    if not 0 <= made_again <= 1 or not head_steps_per_s > 0:
        raise ValueError(f"made_again={made_again}, head_steps_per_s={head_steps_per_s}: "
                         "allowed 0 <= made_again <= 1 and head_steps_per_s > 0")
    return this_epoch / steps_per_s + later * (made_again / steps_per_s + (1 - made_again) / head_steps_per_s)


def train_head(head: Eagle3Head, embed: torch.Tensor, train_ex, cfg: TrainConfig, *,
               ckpt_path: str | None = None, resume: bool = False, log_path: str | None = None,
               progress: bool = True, max_steps: int | None = None,
               on_epoch_end: Callable[[int], dict] | None = None,
               scale: torch.Tensor | None = None) -> dict:
    """Train ``head`` in place; returns a summary (steps, wall time of this sitting and of
    all sittings, last losses).

    ``train_ex``: a list of ``Example`` or a source with ``lengths()`` / ``get(indices)``
    (``features.RowExamples`` makes each chunk's examples by target forwards on demand).

    Resumable: with ``resume`` and an existing ``ckpt_path``, head, optimiser and step are
    restored and the run continues at the next chunk of the same (seeded) epoch order.
    ``max_steps`` stops early (for tests) without changing the schedule.
    ``on_epoch_end(epoch)`` runs after each epoch's last chunk (e.g. held-out evaluation);
    what it returns is logged and collected in the summary's ``epoch_evals``.
    ``scale``: per-channel feature preconditioner (``feature_scale``), or None.
    """
    draft_ids = head.target_ids().cpu()
    t2d_index = target_to_draft_index(draft_ids, head.config.vocab_size)
    src = as_source(train_ex)
    lengths = src.lengths()
    epochs_chunks = [pack(lengths, cfg.chunk_tokens, seed=cfg.seed + e) for e in range(cfg.epochs)]
    schedule = [(e, c) for e, chunks in enumerate(epochs_chunks) for c in chunks]
    total = len(schedule)
    epoch_stop = [sum(len(c) for c in epochs_chunks[:e + 1]) for e in range(cfg.epochs)]  # step each ends at
    opt = make_optimizer(head, cfg)
    start = 0
    earlier_s = 0.0  # training wall time of the earlier sittings this run resumes
    if resume and ckpt_path and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        start = int(ck["step"])
        # None: a checkpoint written before sittings were timed; the total is then unknown
        earlier_s = ck.get("extra", {}).get("wall_s_total")
    head.train()
    t0 = time.time()
    log = open(log_path, "a") if log_path else None
    history = []
    pairs = 0
    epoch_evals: list[dict] = []
    end = total if max_steps is None else min(total, max_steps)
    bar = tqdm(range(start, end), desc="train", unit="chunk", disable=not progress, dynamic_ncols=True,
               initial=start, total=end)
    recent = RecentRate()  # steps a second lately: a later epoch reads cached features, a pause ends
    recent.add(t0, start)
    # the head's steps alone (their time added up, as the clock of a RecentRate): what a
    # later epoch costs once the features are read back rather than made (``run_eta_s``)
    head_recent, head_s = RecentRate(), 0.0
    head_recent.add(head_s, start)
    made_again = src.made_again_share() if hasattr(src, "made_again_share") else 1.0
    for step in bar:
        epoch, chunk = schedule[step]
        b = collate(src.get(chunk), scale)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        t_head = time.time()
        loss, losses, gn = train_step(head, embed, opt, b, cfg, t2d_index)
        pairs += int(b.tokens.numel())
        now = time.time()
        el = now - t0
        recent.add(now, step + 1)
        head_s += now - t_head
        head_recent.add(head_s, step + 1)
        steps_per_s = recent.rate() or (step + 1 - start) / max(el, 1e-9)
        epoch_end = min(epoch_stop[epoch], end)
        head_steps_per_s = head_recent.rate() or (step + 1 - start) / max(head_s, 1e-9)
        rec = {"step": step + 1, "epoch": epoch, "loss": loss.item(), "grad_norm": float(gn),
               "lr": opt.param_groups[0]["lr"], **{f"loss_step{k}": l.item() for k, l in enumerate(losses, 1)},
               "elapsed_s": el, "tokens_per_s": pairs / max(el, 1e-9),
               "steps_per_s": steps_per_s, "head_steps_per_s": head_steps_per_s,
               "eta_s": run_eta_s(step + 1, end, epoch_end, steps_per_s, first_epoch=epoch == 0,
                                  made_again=made_again, head_steps_per_s=head_steps_per_s),
               "epoch_eta_s": run_eta_s(step + 1, epoch_end, epoch_end, steps_per_s)}
        later_at_head_pace = epoch == 0 and made_again is not None and made_again < 1 and end > epoch_stop[0]
        history.append(rec)
        bar.set_postfix(ep=epoch, loss=f"{rec['loss']:.3f}", l1=f"{rec['loss_step1']:.3f}")
        if (step + 1) % cfg.log_every == 0:
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if not progress:  # background runs: one readable line per log_every steps
                print(f"[train] {time.strftime('%H:%M:%S')} step {step + 1}/{end} epoch {epoch} "
                      f"loss {rec['loss']:.3f} (step-1 {rec['loss_step1']:.3f}) | {rec['tokens_per_s']:.0f} tok/s "
                      f"| this epoch ends in {rec['epoch_eta_s'] / 3600:.2f} h, the run in {rec['eta_s'] / 3600:.2f} h "
                      + (f"(the later epochs' pairs {1 - made_again:.0%} at the head steps' pace, their features "
                         "read back)" if later_at_head_pace else "at this rate"), flush=True)
        if ckpt_path and ((step + 1) % cfg.ckpt_every == 0 or step + 1 == end):
            save_checkpoint(ckpt_path, head, opt, step + 1,
                            {"train_config": asdict(cfg), "wall_s_total": _total(earlier_s, t0)})
        last_of_epoch = step + 1 == total or schedule[step + 1][0] != epoch
        if on_epoch_end is not None and last_of_epoch:
            ev = {"epoch": epoch, "step": step + 1, "elapsed_s": time.time() - t0, **on_epoch_end(epoch)}
            head.train()
            epoch_evals.append(ev)
            if log:
                log.write(json.dumps({"eval": ev}) + "\n")
                log.flush()
    if log:
        log.close()
    head.eval()
    return {"steps_total": total, "steps_done": end, "started_at_step": start,
            "wall_s": time.time() - t0, "wall_s_total": _total(earlier_s, t0),
            "last": history[-1] if history else None, "history": history, "epoch_evals": epoch_evals}
