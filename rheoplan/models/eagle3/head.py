"""The EAGLE-3 draft head as a torch module, its config, and the vocabulary-map rule.

The head, as in the EAGLE authors' released EAGLE-3 code and checkpoints: target features from three layers
(``3 * H_target``) are fused by ``fc`` to ``H``; one decoder layer (``midlayer``) takes
``[input_layernorm(token_embedding), hidden_norm(hidden)]`` (2H) into q/k/v, with the
hidden as residual, then ``post_attention_layernorm`` and a SwiGLU MLP; logits are
``lm_head(norm(h))`` over a reduced draft vocabulary, mapped back to target ids with
``d2t`` (draft id ``i`` -> target id ``i + d2t[i]``). Token embeddings are the target's.

Reading and writing checkpoints is ``checkpoint.py``; running the head as a
``DraftModel`` is ``draft.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from rheoplan.kernels import decoder_glue as glue
from rheoplan.kernels.decoder_glue.reference import rms_norm as rms_norm_reference


class Eagle3LoadError(ValueError):
    """A checkpoint or config does not match the EAGLE-3 head format, or does not fit the
    target it is paired with."""


def check_vocab_map(target_ids: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> None:
    """The one vocabulary-map rule: draft id ``i`` maps to target id ``target_ids[i]``
    (``i + d2t[i]``); the ids are distinct and inside ``[0, vocab_size)``, and ``t2d``
    (one flag per target token, or None when absent) is true exactly at those ids.

    Raises ``Eagle3LoadError`` listing the offending ids.

    Example:
        >>> t2d = torch.tensor([True, False, True, False])
        >>> check_vocab_map(torch.tensor([0, 2]), t2d, 4)
        >>> check_vocab_map(torch.tensor([0, 1]), t2d, 4)
        Traceback (most recent call last):
        ...
        rheoplan.models.eagle3.head.Eagle3LoadError: EAGLE-3 t2d disagrees with d2t: t2d flags target ids [2] that d2t does not map to, and d2t maps to target ids [1] that t2d does not flag; allowed t2d[t] true exactly for the targets of d2t
    """
    ids = target_ids.to(torch.int64).cpu()
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise Eagle3LoadError(f"EAGLE-3 d2t maps draft ids to target ids {bad.tolist()[:8]} out of "
                              f"range: allowed target ids in [0, {vocab_size})")
    uniq, counts = torch.unique(ids, return_counts=True)
    if uniq.numel() != ids.numel():
        dup = uniq[counts > 1].tolist()[:8]
        raise Eagle3LoadError(f"EAGLE-3 d2t maps several draft ids to the same target ids {dup}: "
                              "allowed a one-to-one map (distinct target ids)")
    if t2d is None:
        return
    if tuple(t2d.shape) != (vocab_size,):
        raise Eagle3LoadError(f"EAGLE-3 t2d has shape {tuple(t2d.shape)}: allowed ({vocab_size},) "
                              "(one flag per target token)")
    expect = torch.zeros(vocab_size, dtype=torch.bool)
    expect[ids] = True
    flags = t2d.to(torch.bool).cpu()
    if not torch.equal(flags, expect):
        extra = (flags & ~expect).nonzero().flatten().tolist()
        lacking = (expect & ~flags).nonzero().flatten().tolist()
        parts = []
        if extra:
            parts.append(f"t2d flags target ids {extra[:8]}{' ...' if len(extra) > 8 else ''} "
                         "that d2t does not map to")
        if lacking:
            parts.append(f"d2t maps to target ids {lacking[:8]}{' ...' if len(lacking) > 8 else ''} "
                         "that t2d does not flag")
        raise Eagle3LoadError(f"EAGLE-3 t2d disagrees with d2t: {', and '.join(parts)}; allowed "
                              "t2d[t] true exactly for the targets of d2t")


#: RoPE scaling types the head supports, with the fields each one requires (transformers'
#: ``ROPE_INIT_FUNCTIONS`` computes them; these are the types EAGLE-3 heads ship with).
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}


def read_rope(d: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from a config dict in either transformers style:
    4.x (``rope_theta`` and ``rope_scaling`` at the top level) or 5.x (``rope_parameters``
    holding ``rope_theta``, ``rope_type`` and the scaling fields). ``rope_scaling`` is None
    for plain RoPE. An unsupported type or a missing field raises ``Eagle3LoadError``; two
    different thetas (top level and ``rope_parameters``) too, rather than picking one.

    Example:
        >>> read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
        (500000.0, None)
        >>> read_rope({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
        (500000.0, {'rope_type': 'linear', 'factor': 2.0})
    """
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    if params is not None:
        if not isinstance(params, dict):
            raise Eagle3LoadError(f"config rope_parameters={params!r}: allowed a dict")
        p_theta = params.get("rope_theta")
        if theta is not None and p_theta is not None and float(theta) != float(p_theta):
            raise Eagle3LoadError(f"config sets rope_theta={theta} and rope_parameters.rope_theta="
                                  f"{p_theta}: allowed one value (remove one of them)")
        theta = p_theta if p_theta is not None else theta
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling is not None and rest and scaling != rest:
            raise Eagle3LoadError(f"config sets both rope_scaling={scaling} and rope_parameters={params}: "
                                  "allowed one of them")
        scaling = scaling if scaling is not None else rest
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise Eagle3LoadError(f"config rope_theta={theta!r} is out of range: allowed a number > 0")
    if not scaling:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise Eagle3LoadError(f"config rope_scaling={scaling!r}: allowed null or a dict with rope_type")
    scaling = {("rope_type" if k == "type" else k): v for k, v in scaling.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise Eagle3LoadError(f"config rope_scaling type {kind!r} is not supported: allowed "
                              f"{sorted(ROPE_TYPES)}")
    missing = [k for k in ROPE_TYPES[kind] if k not in scaling]
    if missing:
        raise Eagle3LoadError(f"config rope_scaling of type {kind!r} lacks {missing}")
    return float(theta), (None if kind == "default" else scaling)


@dataclass
class Eagle3Config:
    """The config.json fields an EAGLE-3 head reads (those of the released EAGLE-3 checkpoints).

    ``draft_vocab_size`` and ``target_hidden_size`` default to ``vocab_size`` and
    ``hidden_size``. ``eagle_aux_hidden_state_layer_ids`` are the target layers whose inputs
    the head reads (None: EAGLE-3's ``[2, n // 2, n - 3]`` of an ``n``-layer target). RoPE is
    read in either transformers style (``read_rope``). The reference config's ``bias`` is not
    a field: whether ``fc`` has a bias is read from the checkpoint's keys (it stays in
    ``extra`` when present).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    head_dim: int | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    extra: dict = field(default_factory=dict)  #: other config.json fields, kept for saving

    def __post_init__(self) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "draft_vocab_size", "target_hidden_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise Eagle3LoadError(f"config {name}={v!r} is out of range: allowed int >= 1")
        if self.draft_vocab_size > self.vocab_size:
            raise Eagle3LoadError(f"config draft_vocab_size={self.draft_vocab_size} exceeds "
                                  f"vocab_size={self.vocab_size}")
        ids = self.eagle_aux_hidden_state_layer_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or len(ids) != 3
                                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
            raise Eagle3LoadError(f"config eagle_aux_hidden_state_layer_ids={ids!r}: allowed null or "
                                  "three layer indices >= 0")
        self.rope_theta, self.rope_scaling = read_rope({"rope_theta": self.rope_theta,
                                                        "rope_scaling": self.rope_scaling})
        if self.num_attention_heads % self.num_key_value_heads:
            raise Eagle3LoadError(f"config num_attention_heads={self.num_attention_heads} is not a "
                                  f"multiple of num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        """Read the known fields; keep the others in ``extra``."""
        names = {f.name for f in fields(cls)} - {"extra"}
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_attention_heads", "num_key_value_heads") if n not in d]
        if missing:
            raise Eagle3LoadError(f"config.json lacks required fields {missing}")
        theta, scaling = read_rope(d)
        known = {k: v for k, v in d.items() if k in names}
        known.update(rope_theta=theta, rope_scaling=scaling)
        # rope_parameters (transformers 5) is folded into rope_theta / rope_scaling above
        extra = {k: v for k, v in d.items() if k not in names and k != "rope_parameters"}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}


class RMSNorm(nn.Module):
    """Llama RMSNorm (computed in float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)  # the one definition of the formula


def _hook_free(*modules: nn.Module) -> bool:
    """Whether no forward hook, of these modules or global, would see their calls: the fused
    glue calls their parts directly (``Eagle3Head.fuse_glue``)."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


@dataclass(frozen=True)
class RowBlocks:
    """A block-diagonal attention mask kept as its blocks: ``(start, stop, cols, mask)``
    each, query rows ``start:stop`` attending only to the key columns ``cols`` (int64), as
    the bool ``mask [stop - start, len(cols)]`` says. An ``Eagle3Head`` takes it wherever it
    takes a dense ``allowed`` and computes the same attention, one
    ``scaled_dot_product_attention`` per block.

    Why: training packs several rows into one sequence, each attending within itself. torch's
    CPU attention computes every entry of a dense mask, so a 1,024-pair chunk of four rows
    did four times the attention it needed. The attention's forward and backward in the
    training-time test's two steps, rows of 300, 250, 200 and 274 pairs packed (the shipped
    head's 9 query and 3 key/value heads, float32, 2 threads, the AVX2-only AMD EPYC), took
    287-308 ms with the dense mask and 88-96 ms a block per row (three rounds).
    """

    blocks: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]

    @classmethod
    def from_dense(cls, allowed: torch.Tensor, query_seq: torch.Tensor, key_seq: torch.Tensor) -> "RowBlocks":
        """The blocks of ``allowed [n, S]``: one per run of equal ids in ``query_seq [n]``, over
        the key columns whose ``key_seq [S]`` id is the same. Raises ``ValueError`` when
        ``allowed`` lets a query see a key of another id (the blocks would lose it).

        Example: two rows of two pairs, causal within each.
            >>> seq = torch.tensor([0, 0, 1, 1])
            >>> causal = (seq[:, None] == seq[None, :]) & (torch.arange(4)[None, :] <= torch.arange(4)[:, None])
            >>> [(a, b, c.tolist(), m.int().tolist()) for a, b, c, m in RowBlocks.from_dense(causal, seq, seq).blocks]
            [(0, 2, [0, 1], [[1, 0], [1, 1]]), (2, 4, [2, 3], [[1, 0], [1, 1]])]
        """
        if allowed.dim() != 2 or tuple(allowed.shape) != (query_seq.numel(), key_seq.numel()):
            raise ValueError(f"allowed has shape {tuple(allowed.shape)}: allowed "
                             f"({query_seq.numel()}, {key_seq.numel()}), query_seq by key_seq")
        ids, counts = torch.unique_consecutive(query_seq, return_counts=True)
        blocks, start, kept = [], 0, 0
        for i, c in zip(ids.tolist(), counts.tolist()):
            cols = torch.nonzero(key_seq == i).flatten()
            mask = allowed[start:start + c][:, cols]
            blocks.append((start, start + c, cols, mask))
            kept += int(mask.sum())
            start += c
        if kept != int(allowed.sum()):
            raise ValueError(f"allowed lets {int(allowed.sum()) - kept} (query, key) pairs of different ids "
                             "attend: allowed a mask that is block diagonal by query_seq and key_seq")
        return cls(tuple(blocks))


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H concatenation and whose output is H.
    ``in_width``: another input width (default 2H; H for a plain decoder layer stacked on
    the midlayer, as ``examples/measure_head_layers.py`` tries)."""

    def __init__(self, cfg: Eagle3Config, in_width: int | None = None) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        W = 2 * H if in_width is None else in_width
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(W, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(W, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(W, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                allowed: torch.Tensor | RowBlocks) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x [n, in_width]``, ``cos/sin [n, hd]``, ``past`` k/v ``[kv, S, hd]``, ``allowed [n, S+n]``
        (or its ``RowBlocks``)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.n_kv, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return self._attend(q, k, v, past, allowed)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                      past: tuple[torch.Tensor, torch.Tensor] | None,
                      allowed: torch.Tensor | RowBlocks) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``forward`` with the rotary embedding of the queries and of the keys in one
        ``decoder_glue.rope`` call each, over the projections' rows (``signed_sin``:
        ``sin`` with its first half negated, as the kernel takes it). The same bits:
        ``rotate_half(x) * sin`` and ``roll(x) * signed_sin`` are the same products."""
        n, hd = x.shape[0], self.head_dim
        q = glue.rope(self.q_proj(x), cos, signed_sin, hd).view(n, self.n_heads, hd).transpose(0, 1)
        k = glue.rope(self.k_proj(x), cos, signed_sin, hd).view(n, self.n_kv, hd).transpose(0, 1)
        v = self.v_proj(x).view(n, self.n_kv, hd).transpose(0, 1)
        return self._attend(q, k, v, past, allowed)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                allowed: torch.Tensor | RowBlocks) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The attention of rotated ``q [heads, n, hd]`` over ``past`` and the new ``k`` /
        ``v [kv, n, hd]``, through ``o_proj``; returns it and the whole k/v."""
        n = q.shape[1]
        if past is not None:
            k = torch.cat([past[0], k], dim=1)
            v = torch.cat([past[1], v], dim=1)
        if isinstance(allowed, RowBlocks):
            out = torch.cat([self._sdpa(q[:, a:b], k[:, cols], v[:, cols], m) for a, b, cols, m in allowed.blocks], 1)
        else:
            out = self._sdpa(q, k, v, allowed)
        out = out.transpose(0, 1).reshape(n, self.n_heads * self.head_dim)
        return self.o_proj(out), (k, v)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``[heads, n, hd]``: the attention of ``q [heads, n, hd]`` over ``k``/``v [kv, S, hd]``
        where the bool ``allowed [n, S]`` is true."""
        # Each key/value head serves ``rep`` query heads (h -> h // rep): fold them into its
        # query axis, one attention per key/value head, rather than copying the whole cache
        # ``rep`` times per call (``repeat_interleave``). On the 2-core CPU in bfloat16 the
        # attention of one query over 400 cached entries took 0.08 ms against 0.19, a whole
        # head call of 16 queries over 1200 entries 2.08 against 2.42 (docs/results.md).
        # The inputs get a leading batch axis: torch's CPU attention takes its fused (flash)
        # kernel only for 4-D inputs, 3-D ones go to the unfused math path. In bfloat16 on
        # the 2-core AMD EPYC, 3 queries over 150 entries took 29 us against 77 (docs/results.md,
        # "Lean steps, twenty-first round").
        n, rep = q.shape[1], self.n_heads // self.n_kv
        out = F.scaled_dot_product_attention(
            q.reshape(1, self.n_kv, rep * n, self.head_dim), k[None], v[None],
            attn_mask=(allowed if rep == 1 else allowed.repeat(rep, 1))[None, None])  # rows (group member, query)
        return out.view(self.n_heads, n, self.head_dim)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The midlayer: attention over [embedding, hidden] with the hidden as residual."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, past, allowed):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, kv = self.self_attn(x, cos, sin, past, allowed)
        h = hidden + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv

    def forward_fused(self, embeds, hidden, cos, sin, past, allowed):
        """``forward`` with its glue in ``rheoplan.kernels.decoder_glue`` (``Eagle3Head.fuse_glue``):
        each norm, the residual sum with the norm after it and each rotary embedding one
        call, the same bits (each call falls back to the reference where its kernel does
        not apply)."""
        norms = (self.input_layernorm, self.hidden_norm, self.post_attention_layernorm)
        if any(type(m) is not RMSNorm for m in norms):  # a replaced norm runs its own forward
            return self.forward(embeds, hidden, cos, sin, past, allowed)
        x = torch.cat([glue.rms_norm(embeds, self.input_layernorm.weight, self.input_layernorm.eps),
                       glue.rms_norm(hidden, self.hidden_norm.weight, self.hidden_norm.eps)], dim=-1)
        half = cos.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        attn, kv = self.self_attn.forward_fused(x, cos, signed_sin, past, allowed)
        pn = self.post_attention_layernorm
        h, normed = glue.add_rms_norm(hidden, attn, pn.weight, pn.eps)
        return h + self.mlp(normed), kv


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head; state-dict keys are exactly the reference checkpoint's.

    Example:
        >>> cfg = Eagle3Config(vocab_size=50, draft_vocab_size=20, hidden_size=32,
        ...                    intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> head = Eagle3Head(cfg)
        >>> sorted(head.state_dict())[:3]
        ['d2t', 'fc.weight', 'lm_head.weight']
    """

    def __init__(self, cfg: Eagle3Config, *, vocab_map: bool | None = None, fc_bias: bool = False,
                 embed_tokens: bool = False) -> None:
        """``vocab_map``: hold ``d2t``/``t2d`` (default: when the draft vocabulary is smaller;
        checkpoints of the reference code hold them even when it is not). ``fc_bias``: ``fc``
        has a bias. ``embed_tokens``: the head carries its own copy of the token embeddings
        (``embed_tokens.weight``, used instead of the target's)."""
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=fc_bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if embed_tokens else None
        if vocab_map is None:
            vocab_map = cfg.draft_vocab_size != cfg.vocab_size
        elif not vocab_map and cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"vocab_map=False with draft_vocab_size={cfg.draft_vocab_size} < vocab_size="
                             f"{cfg.vocab_size}: a reduced draft vocabulary needs d2t/t2d")
        if vocab_map:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
            if cfg.draft_vocab_size == cfg.vocab_size:
                self.t2d.fill_(True)  # the identity map (d2t = 0)
        else:
            self.d2t = self.t2d = None
        # Reuse transformers' RoPE so rope_scaling (llama3, linear, ...) means what it means there;
        # its buffers are non-persistent, matching checkpoints that do not store them.
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(
            hidden_size=H, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
            num_key_value_heads=cfg.num_key_value_heads, rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings))

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Fill ``d2t``/``t2d`` from the target ids of the draft vocabulary (``[draft_vocab]``)."""
        cfg = self.config
        ids = torch.as_tensor(draft_to_target).to(torch.int64)
        if self.d2t is None:
            raise ValueError(f"set_vocab_map() on a head without d2t/t2d (draft_vocab_size == "
                             f"vocab_size == {cfg.vocab_size}; build it with vocab_map=True)")
        if ids.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"draft_to_target has shape {tuple(ids.shape)}: allowed "
                             f"({cfg.draft_vocab_size},) (one target id per draft id)")
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids.clamp(0, cfg.vocab_size - 1)] = True
        check_vocab_map(ids, t2d, cfg.vocab_size)
        self.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
        self.t2d.copy_(t2d)

    def target_ids(self) -> torch.Tensor:
        """Target id of each draft id, ``[draft_vocab]`` (``i + d2t[i]``)."""
        ar = torch.arange(self.config.draft_vocab_size, device=self.lm_head.weight.device)
        return ar if self.d2t is None else ar + self.d2t

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target features ``[..., 3*H_t]`` through ``fc``; own hiddens ``[..., H]`` as they are."""
        H, F3 = self.config.hidden_size, 3 * self.config.target_hidden_size
        if hidden.shape[-1] == H:
            return hidden
        if hidden.shape[-1] == F3:
            return self.fc(hidden)
        raise ValueError(f"hidden has width {hidden.shape[-1]}: allowed {F3} (target features) "
                         f"or {H} (the head's own hidden)")

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, allowed: torch.Tensor | RowBlocks,
                max_position: int | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One midlayer pass over ``n`` pairs.

        Args:
            embeds: ``[n, H]`` token embeddings (the target's).
            hidden: ``[n, 3*H_t]`` target features or ``[n, H]`` own hiddens.
            positions: ``[n]`` int64 RoPE positions.
            past: cached k/v ``[kv_heads, S, head_dim]`` or None.
            allowed: bool ``[n, S + n]``, row i may attend to column j, or the same mask as
                ``RowBlocks`` when it is block diagonal (training's packed rows).
            max_position: a bound the caller knows on the host (no device read) of every
                position, or None; with it, ``cos_sin`` may read a table.
        Returns:
            the output hidden ``[n, H]`` (pre-norm; children consume it) and the k/v
            ``[kv_heads, S + n, head_dim]`` including the new entries.
        """
        h = self.fuse(hidden)
        cos, sin = self.cos_sin(h, positions, max_position)
        m = self.midlayer
        if (self._glue_applies(h) and type(m) is Eagle3Layer  # (a subclass: its own forward)
                and _hook_free(m, m.self_attn, m.input_layernorm, m.hidden_norm, m.post_attention_layernorm)):
            return m.forward_fused(embeds, h, cos, sin, past, allowed)
        return self.midlayer(embeds, h, cos, sin, past, allowed)

    def fuse_glue(self, on: bool = True) -> None:
        """Run (``on``) or stop running the head's norms, residual sum and rotary embedding
        through ``rheoplan.kernels.decoder_glue`` (one numba call each, bfloat16 on the
        CPU, the same bits) in calls of at most ``decoder_glue.MAX_ROWS`` pairs without
        autograd. The loader turns it on where the target's glue paid
        (``rheoplan.loading.fuse_head_glue``); training never runs it (its tensors need
        gradients)."""
        self.glue_fused = bool(on)

    #: whether ``fuse_glue`` is on (off until the loader turns it on)
    glue_fused: bool = False

    def _glue_applies(self, h: torch.Tensor) -> bool:
        """Whether this call's glue runs fused: ``fuse_glue`` on, bfloat16 CPU rows, at most
        ``decoder_glue.MAX_ROWS`` of them, and no gradient to track."""
        return (self.glue_fused and h.dtype == torch.bfloat16 and h.is_cpu and h.shape[0] <= glue.MAX_ROWS
                and not torch.is_grad_enabled())

    def cos_sin(self, h: torch.Tensor, positions: torch.Tensor,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``self.rotary``'s cos and sin ``[n, head_dim]`` at ``positions`` ``[n]``, in ``h``'s
        dtype. Given ``max_position`` (a host int at least every position) and positions
        on the CPU, they are rows of a table made by ``self.rotary`` itself (at least 256
        rows, doubled until it holds ``max_position``): each entry is ``cos(position *
        inv_freq)`` whatever else is in the call, so the rows are the same floats. Why: a
        decode asks for two or three positions per draft call, and the module's call took
        ~65 us of them inside decodes (0.15 ms a step at one row on the 2-core Zen 5 AMD
        EPYC) against a few us for two gathers. Every ``ROPE_TYPES`` entry has a fixed
        ``inv_freq``, so a table stays right. Without a bound (training) or off the CPU, the
        module runs: sizing the table from the positions themselves would be a host read,
        which the device step must not make."""
        if max_position is None or positions.device.type != "cpu":
            cos, sin = self.rotary(h[None], positions[None])
            return cos[0], sin[0]
        key = (h.dtype, h.device, self.rotary.inv_freq.data_ptr())
        table = self.__dict__.get("_rope_table")
        top = int(max_position)
        if table is None or table[0] != key or table[1].shape[0] <= top:
            n = max(256, table[1].shape[0] if table is not None and table[0] == key else 0)
            while n <= top:
                n *= 2
            cos, sin = self.rotary(h[None], torch.arange(n, device=h.device)[None])
            table = self.__dict__["_rope_table"] = (key, cos[0], sin[0])
        return table[1][positions], table[2][positions]

    def draft_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(h))`` over the draft vocabulary, ``[n, draft_vocab]``."""
        if self._glue_applies(out_hidden) and type(self.norm) is RMSNorm and _hook_free(self.norm):
            return self.lm_head(glue.rms_norm(out_hidden, self.norm.weight, self.norm.eps))
        return self.lm_head(self.norm(out_hidden))

    def target_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits placed at target ids ``[n, vocab]`` (float32); other ids are -inf."""
        d = self.draft_logits(out_hidden).to(torch.float32)
        out = torch.full((d.shape[0], self.config.vocab_size), float("-inf"), device=d.device)
        out[:, self.target_ids()] = d
        return out
