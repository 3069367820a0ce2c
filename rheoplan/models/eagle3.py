"""EAGLE-3 draft head (module, checkpoint I/O) and its ``DraftModel`` adapter.

The head (EAGLE_REFERENCE.md, "EAGLE-3 draft head"): target features from three layers
(``3 * H_target``) are fused by ``fc`` to ``H``; one decoder layer (``midlayer``) takes
``[input_layernorm(token_embedding), hidden_norm(hidden)]`` (2H) into q/k/v, with the
hidden as residual, then ``post_attention_layernorm`` and a SwiGLU MLP; logits are
``lm_head(norm(h))`` over a reduced draft vocabulary, mapped back to target ids with
``d2t`` (draft id ``i`` -> target id ``i + d2t[i]``). Token embeddings are the target's.

How the draft is fed (why ``Eagle3Draft`` needs target features):
the head's input at a token is the pair ``(feature, token)`` where ``feature`` is the
target's feature at the *previous* position (the one whose output predicted ``token``).
Committed pairs use true target features; tree nodes use the head's own output hidden at
their parent (``H`` wide, so ``fc`` is skipped). So:

* ``start``: pairs ``(f_t, x_{t+1})`` of the prompt. ``f`` is read lazily on the first
  ``node_logits`` from ``features_from``: an ``HFTarget`` with capture (its
  ``prompt_features()``, free), or the target *model* itself (the draft then runs one
  capturing prefill of its own; this is what ``load_eagle3_draft`` does, so a caller
  that builds the target adapter separately, like ``plan_and_decode``, needs no wiring).
  ``set_prompt_features`` sets them explicitly. A 1-token prompt has no feature; its
  root pair uses a zero feature.
* root call of each step: the pending pairs run as a chain; the output at the last one
  (whose token is the root) gives the root's logits and the hidden its children consume.
* ``commit(tree, path, emitted, features)``: the tree entries are dropped (they were made
  from draft hiddens) and ``(features[j], emitted[j])`` become the pending pairs; the last
  one's token is the new root.

Positions: a pair sits at its token's position (tree node: ``prefix_len + depth``); RoPE
only sees differences, so this matches EAGLE's own numbering up to a constant.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rheoplan.ir import DraftTree
from rheoplan.models.base import DraftModel, TargetModel, check_draft_call, check_emitted, check_prompt_ids

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
TORCH_NAME = "pytorch_model.bin"


class Eagle3LoadError(ValueError):
    """A checkpoint does not match the EAGLE-3 head format (keys, shapes, config)."""


@dataclass
class Eagle3Config:
    """The config.json fields an EAGLE-3 head reads (EAGLE_REFERENCE.md).

    ``bias`` is read and written back but no layer has a bias: the reference state-dict
    keys carry none. ``draft_vocab_size`` and ``target_hidden_size`` default to
    ``vocab_size`` and ``hidden_size``.
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
    bias: bool = True
    head_dim: int | None = None
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
        known = {k: v for k, v in d.items() if k in names}
        return cls(**known, extra={k: v for k, v in d.items() if k not in names})

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
        dt = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H concatenation and whose output is H."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None,
                allowed: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x [n, 2H]``, ``cos/sin [n, hd]``, ``past`` k/v ``[kv, S, hd]``, ``allowed [n, S+n]``."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.n_kv, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=1)
            v = torch.cat([past[1], v], dim=1)
        rep = self.n_heads // self.n_kv
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0),
            attn_mask=allowed[None])
        out = out.transpose(0, 1).reshape(n, self.n_heads * self.head_dim)
        return self.o_proj(out), (k, v)


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


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head; state-dict keys are exactly the reference checkpoint's.

    Example:
        >>> cfg = Eagle3Config(vocab_size=50, draft_vocab_size=20, hidden_size=32,
        ...                    intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> head = Eagle3Head(cfg)
        >>> sorted(head.state_dict())[:3]
        ['d2t', 'fc.weight', 'lm_head.weight']
    """

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        if cfg.draft_vocab_size != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
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
        ids = draft_to_target.to(torch.int64)
        if ids.shape != (cfg.draft_vocab_size,) or self.d2t is None:
            raise ValueError(f"draft_to_target has shape {tuple(ids.shape)}, expected "
                             f"({cfg.draft_vocab_size},) with draft_vocab_size < vocab_size")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"draft_to_target must hold distinct ids in [0, {cfg.vocab_size})")
        self.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
        self.t2d.zero_()
        self.t2d[ids] = True

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
                past: tuple[torch.Tensor, torch.Tensor] | None, allowed: torch.Tensor,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One midlayer pass over ``n`` pairs.

        Args:
            embeds: ``[n, H]`` token embeddings (the target's).
            hidden: ``[n, 3*H_t]`` target features or ``[n, H]`` own hiddens.
            positions: ``[n]`` int64 RoPE positions.
            past: cached k/v ``[kv_heads, S, head_dim]`` or None.
            allowed: bool ``[n, S + n]``, row i may attend to column j.
        Returns:
            the output hidden ``[n, H]`` (pre-norm; children consume it) and the k/v
            ``[kv_heads, S + n, head_dim]`` including the new entries.
        """
        h = self.fuse(hidden)
        cos, sin = self.rotary(h[None], positions[None])
        return self.midlayer(embeds, h, cos[0], sin[0], past, allowed)

    def draft_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(h))`` over the draft vocabulary, ``[n, draft_vocab]``."""
        return self.lm_head(self.norm(out_hidden))

    def target_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits placed at target ids ``[n, vocab]`` (float32); other ids are -inf."""
        d = self.draft_logits(out_hidden).to(torch.float32)
        out = torch.full((d.shape[0], self.config.vocab_size), float("-inf"), device=d.device)
        out[:, self.target_ids()] = d
        return out


# --------------------------------------------------------------------------------------
# Checkpoint I/O
# --------------------------------------------------------------------------------------

def save_eagle3(head: Eagle3Head, path: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the reference format."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(head.config.to_dict(), f, indent=2, sort_keys=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, os.path.join(path, SAFETENSORS_NAME))


def _read_state(path: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, SAFETENSORS_NAME), os.path.join(path, TORCH_NAME)
    if os.path.exists(st):
        from safetensors.torch import load_file

        return load_file(st)
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise Eagle3LoadError(f"{path} holds neither {SAFETENSORS_NAME} nor {TORCH_NAME}")


def load_eagle3_head(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Eagle3Head:
    """Load a head from ``path`` (config.json + weights), checking keys and shapes strictly.

    Raises ``Eagle3LoadError`` naming every missing and unexpected key and every shape
    mismatch (the reference loader is non-strict and would run with random weights).
    """
    path = os.fspath(path)
    cfg_file = os.path.join(path, CONFIG_NAME)
    if not os.path.exists(cfg_file):
        raise Eagle3LoadError(f"{path} has no {CONFIG_NAME}")
    with open(cfg_file) as f:
        cfg = Eagle3Config.from_dict(json.load(f))
    head = Eagle3Head(cfg)
    state = _read_state(path)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs expected {tuple(v.shape)}"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        raise Eagle3LoadError(
            f"EAGLE-3 checkpoint {path} does not match the head built from its config "
            f"(draft_vocab_size={cfg.draft_vocab_size}, vocab_size={cfg.vocab_size}): "
            f"missing keys {missing}; unexpected keys {unexpected}; shape mismatches {shapes}")
    head.load_state_dict(state, strict=True)
    if head.d2t is not None:
        ids = head.target_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise Eagle3LoadError(f"d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    # Module.to(dtype) casts floating tensors only, so d2t/t2d stay int64/bool.
    return head.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------------------
# The DraftModel adapter
# --------------------------------------------------------------------------------------

class FeatureSource(Protocol):
    def prompt_features(self) -> torch.Tensor: ...


def _embedding_weight(target_embed: Any) -> torch.Tensor:
    w = target_embed.weight if isinstance(target_embed, nn.Module) else target_embed
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError("target_embed must be an nn.Embedding or a [vocab, H] tensor, got "
                        f"{type(target_embed).__name__}")
    return w.detach()


class Eagle3Draft(DraftModel):
    """``DraftModel`` running an ``Eagle3Head`` with its own KV cache and tree attention.

    Args:
        head: the EAGLE-3 head.
        target_embed: the target's token embeddings (``nn.Embedding`` or ``[vocab, H]``).
        features_from: an ``HFTarget`` built with ``capture_layers='eagle3'`` (its
            ``prompt_features()``), or the target model (one extra capturing prefill per
            ``start``); read on the first ``node_logits`` after ``start``, so target and draft
            may be started in either order. Without it, call ``set_prompt_features``.

    Example:
        >>> # target = HFTarget(model, capture_layers="eagle3")
        >>> # draft = Eagle3Draft(head, model.get_input_embeddings(), features_from=target)
    """

    def __init__(self, head: Eagle3Head, target_embed: Any,
                 features_from: FeatureSource | None = None) -> None:
        self.head = head
        self.embed = _embedding_weight(target_embed)
        cfg = head.config
        if tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target_embed has shape {tuple(self.embed.shape)}, expected "
                             f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})")
        self.features_from = features_from
        self.vocab_size = cfg.vocab_size
        self._param = next(head.parameters())
        self.device = self._param.device
        self._reset()

    def check_vocab_map(self, target_vocab_size: int) -> None:
        """Check that ``d2t``/``t2d`` map the draft vocabulary into ``[0, target_vocab_size)``
        one to one (``plan_and_decode`` calls it before any model work)."""
        head, cfg = self.head, self.head.config
        if head.d2t is None:
            return
        ids = head.target_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size:
            bad = ids[(ids < 0) | (ids >= target_vocab_size)].tolist()[:5]
            raise ValueError(f"EAGLE-3 d2t maps draft ids to target ids {bad} out of range: allowed "
                             f"target ids in [0, {target_vocab_size})")
        if len(set(ids.tolist())) != ids.numel():
            raise ValueError("EAGLE-3 d2t maps two draft ids to the same target id: allowed a "
                             "one-to-one map (distinct target ids)")
        t2d = head.t2d
        if tuple(t2d.shape) != (target_vocab_size,):
            raise ValueError(f"EAGLE-3 t2d has shape {tuple(t2d.shape)}: allowed ({target_vocab_size},) "
                             "(one flag per target token)")
        expect = torch.zeros(target_vocab_size, dtype=torch.bool, device=t2d.device)
        expect[ids.to(t2d.device)] = True
        if not torch.equal(t2d.to(torch.bool), expect):
            raise ValueError(f"EAGLE-3 t2d flags {int(t2d.sum())} target ids but d2t maps to "
                             f"{cfg.draft_vocab_size}: allowed t2d[t] true exactly for the targets of d2t")

    def _reset(self) -> None:
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prefix = 0  #: committed pairs in the kv cache
        self._committed = 0  #: tokens committed before the root
        self._pending_tokens: list[int] = []
        self._pending_feats: list[torch.Tensor] | None = None  #: None = prompt features not read yet
        self.root: int | None = None
        self._prompt: list[int] = []
        self._slot: dict[int, int] = {}  #: tree node -> kv index (root: -1, it is committed)
        self._hidden: dict[int, torch.Tensor] = {}  #: node -> output hidden [H]
        self._logits: dict[int, torch.Tensor] = {}

    def start(self, prompt_ids: list[int]) -> None:
        ids = check_prompt_ids(prompt_ids, self.vocab_size)
        self._reset()
        self._prompt = ids
        self._committed = len(ids) - 1
        self.root = ids[-1]
        # Pair tokens: x_1 .. x_{n-1}; a 1-token prompt pairs its only token with a zero feature.
        self._pending_tokens = ids[1:] if len(ids) > 1 else ids[:1]

    def set_prompt_features(self, features: torch.Tensor) -> None:
        """Target features ``[len(prompt) - 1, 3*H_t]`` of the prompt (see the module doc)."""
        n = len(self._prompt)
        if not self._prompt:
            raise RuntimeError("set_prompt_features() called before start()")
        if features.dim() != 2 or features.shape[0] != n - 1:
            raise ValueError(f"features has shape {tuple(features.shape)}, expected "
                             f"({n - 1}, 3*target_hidden_size) for a {n}-token prompt")
        if n == 1:
            width = 3 * self.head.config.target_hidden_size
            self._pending_feats = [torch.zeros(width, device=self._param.device, dtype=self._param.dtype)]
        else:
            self._pending_feats = list(features.to(self._param.device, self._param.dtype))

    def take_prompt_features(self, target: TargetModel) -> None:
        """Take the prompt's features from ``target`` when it captured them from the model
        this draft reads its features from (``features_from``): no second prompt forward."""
        feats = target.prompt_features_for(self.features_from)
        if feats is not None:
            self.set_prompt_features(feats)

    @torch.no_grad()
    def node_logits(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        nodes = check_draft_call(tree, nodes, self.root, self._committed)
        new = [v for v in dict.fromkeys(nodes) if v not in self._logits]
        if 0 in new:
            if new != [0]:
                raise ValueError(f"nodes={nodes}: the root must be forwarded alone (its children "
                                 "consume its output hidden)")
            self._forward_root()
        elif new:
            self._forward_nodes(tree, new)
        return torch.stack([self._logits[v] for v in nodes])

    def _run(self, tokens: list[int], hidden: torch.Tensor, positions: list[int],
             allowed: torch.Tensor) -> torch.Tensor:
        dev = self._param.device
        tok = torch.tensor(tokens, dtype=torch.int64, device=self.embed.device)
        emb = self.embed[tok].to(dev, self._param.dtype)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        out, self._kv = self.head(emb, hidden, pos, self._kv, allowed.to(dev))
        return out

    def _ensure_prompt_features(self) -> None:
        if self._pending_feats is not None:
            return
        src = self.features_from
        if src is None:
            raise RuntimeError("Eagle3Draft needs the prompt's target features: pass "
                               "features_from=<HFTarget with capture_layers='eagle3' or the target "
                               "model> or call set_prompt_features() after start()")
        if hasattr(src, "prompt_features"):
            self.set_prompt_features(src.prompt_features())
            return
        from rheoplan.models.hf_target import HFTarget

        # Only the target model is known: run one capturing prefill, then drop the hooks.
        probe = HFTarget(src, capture_layers="eagle3")
        try:
            probe.start(self._prompt)
            self.set_prompt_features(probe.prompt_features())
        finally:
            probe.close()

    def _forward_root(self) -> None:
        self._ensure_prompt_features()
        P = len(self._pending_tokens)
        S = self._prefix
        allowed = torch.cat([torch.ones(P, S, dtype=torch.bool),
                             torch.ones(P, P, dtype=torch.bool).tril()], dim=1)
        positions = [self._committed - P + 1 + k for k in range(P)]
        feats = torch.stack([self.head.fuse(f) for f in self._pending_feats])
        out = self._run(self._pending_tokens, feats, positions, allowed)
        self._prefix += P
        self._pending_tokens, self._pending_feats = [], []
        self._hidden[0] = out[-1]
        self._slot[0] = -1
        self._logits[0] = self.head.target_logits(out[-1:])[0]

    def _forward_nodes(self, tree: DraftTree, new: list[int]) -> None:
        for v in new:
            p = int(tree.parent[0, v])
            if p not in self._hidden:
                raise ValueError(f"node {v}'s parent {p} was not forwarded in an earlier call of "
                                 "this step; parents must be passed before their children")
        S = self._kv[0].shape[1]
        q = len(new)
        allowed = torch.zeros(q, S + q, dtype=torch.bool)
        allowed[:, :self._prefix] = True
        parents_hidden, tokens, positions = [], [], []
        for r, v in enumerate(new):
            p = int(tree.parent[0, v])
            a = p
            while a > 0:
                allowed[r, self._slot[a]] = True
                a = int(tree.parent[0, a])
            allowed[r, S + r] = True
            parents_hidden.append(self._hidden[p])
            tokens.append(int(tree.token[0, v]))
            positions.append(self._committed + int(tree.depth[0, v]))
        out = self._run(tokens, torch.stack(parents_hidden), positions, allowed)
        logits = self.head.target_logits(out)
        for r, v in enumerate(new):
            self._slot[v] = S + r
            self._hidden[v] = out[r]
            self._logits[v] = logits[r]

    def commit(self, tree: DraftTree, path_nodes: list[int], emitted: list[int],
               features: list[torch.Tensor | None]) -> None:
        if self.root is None:
            raise RuntimeError("commit() called before start()")
        path_nodes = check_emitted(tree, path_nodes, emitted)
        if len(features) != len(path_nodes) or any(f is None for f in features):
            raise ValueError(f"features must hold one target feature tensor per path node "
                             f"({len(path_nodes)}), got {len(features)} entries "
                             f"({sum(f is None for f in features)} None); build the target with "
                             "capture_layers='eagle3'")
        # If the step never ran the draft, the pending pairs are still owed: keep them.
        self._ensure_prompt_features()
        # Tree entries came from draft hiddens; the true pairs use target features instead.
        if self._kv is not None:
            self._kv = (self._kv[0][:, :self._prefix], self._kv[1][:, :self._prefix])
        dev, dt = self._param.device, self._param.dtype
        self._pending_tokens = self._pending_tokens + [int(t) for t in emitted]
        self._pending_feats = self._pending_feats + [f.to(dev, dt) for f in features]
        self._committed += len(path_nodes)
        self.root = int(emitted[-1])
        self._slot, self._hidden, self._logits = {}, {}, {}


def load_eagle3_draft(path: str | os.PathLike, target_model: nn.Module, *,
                      dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> Eagle3Draft:
    """Load a head for ``target_model`` (a transformers causal LM): embeddings and prompt
    features come from the model, per-step features from the verify forward
    (``as_target(model)`` captures them by default).

    Example:
        >>> # draft = load_eagle3_draft("ckpt/", model)
        >>> # plan_and_decode(model, draft, prompt_ids)
    """
    return load_eagle3(path, target_model.get_input_embeddings(), features_from=target_model,
                       dtype=dtype, device=device)


def load_eagle3(path: str | os.PathLike, target_embeddings: Any, *,
                features_from: FeatureSource | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Eagle3Draft:
    """Load a head (strictly, see ``load_eagle3_head``) and wrap it as a ``DraftModel``.

    Example:
        >>> # target = HFTarget(model, capture_layers="eagle3")
        >>> # draft = load_eagle3("ckpt/", model.get_input_embeddings(), features_from=target)
    """
    head = load_eagle3_head(path, dtype=dtype, device=device)
    return Eagle3Draft(head, target_embeddings, features_from=features_from)
