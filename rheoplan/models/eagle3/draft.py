"""``Eagle3Draft``: an ``Eagle3Head`` run as a ``DraftModel`` (own KV cache, tree attention),
and ``load_eagle3_checkpoint``, the one loader a user calls.

How the draft is fed (why ``Eagle3Draft`` needs target features):
the head's input at a token is the pair ``(feature, token)`` where ``feature`` is the
target's feature at the *previous* position (the one whose output predicted ``token``).
Committed pairs use true target features; tree nodes use the head's own output hidden at
their parent (``H`` wide, so ``fc`` is skipped). So:

* ``start``: pairs ``(f_t, x_{t+1})`` of the prompt. ``f`` is read lazily on the first
  ``node_logits`` from ``features_from``: an ``HFTarget`` with capture (its
  ``prompt_features()``, free), or the target *model* itself (the draft then runs one
  capturing prefill of its own; this is what ``load_eagle3_checkpoint(path, model)`` does, so a caller
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

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from rheoplan.distributions import SubsetLogits
from rheoplan.ir import DraftTree
from rheoplan.models._hf_common import base_model
from rheoplan.models.base import (DraftModel, TargetModel, check_device_path, check_draft_call, check_emitted,
                                  check_prompt_ids, drafts_on_host)
from rheoplan.models.eagle3.checkpoint import read_eagle3
from rheoplan.models.eagle3.head import Eagle3Head, Eagle3LoadError, check_vocab_map
from rheoplan.models.hf_target import HFTarget, eagle3_layers


class FeatureSource(Protocol):
    def prompt_features(self) -> torch.Tensor: ...


def _embedding_weight(target_embed: Any) -> torch.Tensor:
    w = target_embed.weight if isinstance(target_embed, nn.Module) else target_embed
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError("target_embed must be an nn.Embedding or a [vocab, H] tensor, got "
                        f"{type(target_embed).__name__}")
    return w.detach()


@dataclass
class _Row:
    """One row of a batched ``Eagle3Draft`` (what ``_reset`` holds for batch 1)."""

    prompt: list[int]
    committed: int  #: tokens committed before the root
    root: int
    pending_tokens: list[int]
    pending_feats: list[torch.Tensor] | None = None  #: None = prompt features not read yet
    slot: dict[int, int] = field(default_factory=dict)  #: tree node -> flat kv column (root: -1)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)


class Eagle3Draft(DraftModel):
    """``DraftModel`` running an ``Eagle3Head`` with its own KV cache and tree attention.

    Args:
        head: the EAGLE-3 head.
        target_embed: the target's token embeddings (``nn.Embedding`` or ``[vocab, H]``);
            None when the head carries its own (``head.embed_tokens``, from a checkpoint's
            ``embed_tokens.weight``), which is then used in any case.
        features_from: an ``HFTarget`` built with ``capture_layers='eagle3'`` (its
            ``prompt_features()``), or the target model (one extra capturing prefill per
            ``start``); read on the first ``node_logits`` after ``start``, so target and draft
            may be started in either order. Without it, call ``set_prompt_features``.

    Example (a tiny random target and head; the shipped head loads with
    ``load_eagle3_checkpoint``):
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from rheoplan import plan_and_decode, TreeConfig
        >>> from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                      num_hidden_layers=4, num_attention_heads=4,
        ...                                      num_key_value_heads=2)).eval()
        >>> head = Eagle3Head(Eagle3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                num_attention_heads=4, num_key_value_heads=2))
        >>> target = HFTarget(model, capture_layers="eagle3")
        >>> draft = Eagle3Draft(head, model.get_input_embeddings(), features_from=target)
        >>> r = plan_and_decode(target, draft, [1, 2, 3], max_new_tokens=6, seed=0,
        ...                     tree=TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=8))
        >>> len(r.tokens)
        6
    """

    def __init__(self, head: Eagle3Head, target_embed: Any = None,
                 features_from: FeatureSource | None = None) -> None:
        self.head = head
        cfg = head.config
        if head.embed_tokens is not None:
            self.embed = head.embed_tokens.weight.detach()
        elif target_embed is None:
            raise ValueError("target_embed is None and the head has no embed_tokens of its own: pass "
                             "the target's token embeddings (model.get_input_embeddings())")
        else:
            self.embed = _embedding_weight(target_embed)
        if tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target_embed has shape {tuple(self.embed.shape)}, expected "
                             f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}): an "
                             "EAGLE-3 head reads the target's token embeddings, so its hidden_size "
                             "must be the target's embedding width")
        self.features_from = features_from
        self.vocab_size = cfg.vocab_size
        # The draft vocabulary ordered by target id: the planner works on these columns
        # (``vocab_logits``) and maps the chosen ones to target ids; a head whose d2t is not
        # increasing gets its columns reordered once per call (``_order``).
        ids = head.target_ids()
        order = torch.argsort(ids)
        self._order = None if torch.equal(order, torch.arange(len(ids), device=order.device)) else order
        #: target ids of the draft vocabulary, increasing (None: the full target vocabulary)
        self.vocab_ids = ids[order] if cfg.draft_vocab_size < cfg.vocab_size else None
        self._param = next(head.parameters())
        self.device = self._param.device
        self._reset()

    def check_vocab_map(self, target_vocab_size: int) -> None:
        """The vocabulary-map rule (``check_vocab_map`` in ``head.py``) against the target's
        vocabulary; ``plan_and_decode`` calls it before any model work."""
        head = self.head
        if head.d2t is not None:
            check_vocab_map(head.target_ids(), head.t2d, target_vocab_size)

    def capture_layers(self, num_layers: int) -> list[int]:
        """The target layers (inputs) this head reads, for an ``num_layers``-layer target."""
        ids = self.head.config.eagle_aux_hidden_state_layer_ids
        return list(ids) if ids is not None else eagle3_layers(num_layers)

    def check_target(self, target: Any) -> None:
        """Check that this head fits ``target`` (a transformers causal LM or an adapter
        wrapping one, e.g. ``HFTarget``) before any model work, with a message that says what
        to change: vocabulary and its map, the feature width (``target_hidden_size``), the
        layers the head reads (they must exist, and an adapter must capture exactly them),
        and the embeddings' width. ``plan_and_decode`` calls it; so does
        ``load_eagle3_checkpoint``. Raises ``Eagle3LoadError``."""
        cfg = self.head.config
        model = target if isinstance(target, nn.Module) else getattr(target, "model", None)
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            return  # not a transformers model: only the vocabulary can be checked (decode does)
        mcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        vocab = int(getattr(target, "vocab_size", None) or mcfg.vocab_size)
        if cfg.vocab_size != vocab:
            raise Eagle3LoadError(f"EAGLE-3 head has vocab_size={cfg.vocab_size} but the target has "
                                  f"{vocab} tokens: allowed a head trained for this target's tokenizer")
        self.check_vocab_map(vocab)
        hidden = int(mcfg.hidden_size)
        if cfg.target_hidden_size != hidden:
            raise Eagle3LoadError(
                f"EAGLE-3 head has target_hidden_size={cfg.target_hidden_size} (its fc reads "
                f"3 * {cfg.target_hidden_size} = {3 * cfg.target_hidden_size} features) but the target's "
                f"hidden_size is {hidden}: allowed a head trained for this target (or fix "
                "target_hidden_size in the head's config.json if it is wrong)")
        layers = getattr(base_model(model), "layers", None)
        n_layers = len(layers) if layers is not None else int(mcfg.num_hidden_layers)
        try:
            want = self.capture_layers(n_layers)
        except ValueError as e:
            raise Eagle3LoadError(f"the target has {n_layers} decoder layers: {e}") from None
        bad = [i for i in want if not 0 <= i < n_layers]
        if bad:
            raise Eagle3LoadError(f"EAGLE-3 head reads the inputs of target layers {want} but the target "
                                  f"has {n_layers} layers (layers {bad} do not exist): allowed a head "
                                  "trained for this target")
        captured = getattr(target, "capture_layers", "n/a")
        if target is not model and captured != "n/a" and (captured is None or list(captured) != want):
            raise Eagle3LoadError(
                f"the target adapter captures layers {captured} but this EAGLE-3 head reads the inputs "
                f"of layers {want}: build it with HFTarget(model, capture_layers={want}) (or pass the "
                "model itself to plan_and_decode, which captures the EAGLE-3 default layers)")
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if self.head.embed_tokens is None and emb is not None and tuple(emb.weight.shape) != tuple(self.embed.shape):
            raise Eagle3LoadError(f"the target's token embeddings have shape {tuple(emb.weight.shape)} "
                                  f"but the head reads ({cfg.vocab_size}, {cfg.hidden_size})")

    def _reset(self) -> None:
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prefix = 0  #: committed pairs in the kv cache
        self._committed = 0  #: tokens committed before the root
        self._pending_tokens: list[int] = []
        self._pending_feats: list[torch.Tensor] | None = None  #: None = prompt features not read yet
        self.root: int | None = None
        self._prompt: list[int] = []
        self._reset_step()

    def _reset_step(self) -> None:
        """Forget the step's tree nodes (their kv entries are cropped by ``commit``)."""
        self._root_done = False
        self._forwarded: set[int] = set()  #: node ids forwarded this step (host-path calls)
        self._n_tree = 0  #: tree entries in the kv cache after the prefix
        self._device_step = False  #: node ids came as a tensor this step (the device planner)
        # per node id (the tree's creation ids): output hidden, draft-vocabulary logits and
        # which tree kv entries it sees (its ancestors below the root, and itself)
        self._hid: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._anc: torch.Tensor | None = None

    def memory_estimate(self, batch: int, width: int, tree_len: int) -> int:
        """The batched head's flat KV cache (every row's ``width`` columns in one sequence),
        the pending target features, and its largest call: ``batch * tree_len`` queries
        against the whole flat cache (float32 mask and scores) and their logits over the
        head's vocabulary."""
        cfg = self.head.config
        elem = self._param.element_size()
        S, Q = batch * width, batch * tree_len
        kv = 2 * cfg.num_key_value_heads * cfg.head_dim * S * elem
        feats = S * 3 * cfg.target_hidden_size * elem
        scores = 2 * cfg.num_attention_heads * Q * (S + Q) * 4
        vocab = len(self.vocab_ids) if self.vocab_ids is not None else self.vocab_size
        return int(kv + feats + scores + Q * (4 * cfg.hidden_size * elem + vocab * 4))

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
    def node_logits(self, tree: DraftTree, nodes) -> torch.Tensor:
        """Draft logits ``[len(nodes), vocab]`` over the target vocabulary (``-inf`` outside
        the draft vocabulary); ``vocab_logits`` gives the same rows over the draft
        vocabulary only, which is what the decode loop asks for."""
        rows = self.vocab_logits(tree, nodes)
        if self.vocab_ids is None:
            return rows
        return SubsetLogits(rows, self.vocab_ids).dense(self.vocab_size)

    @torch.no_grad()
    def vocab_logits(self, tree: DraftTree, nodes) -> torch.Tensor:
        """Draft logits ``[len(nodes), len(vocab_ids)]`` (float32) at target ids
        ``vocab_ids``: the head's own vocabulary, ordered by target id, with no scatter to
        the target's vocabulary.

        ``nodes`` as a list of ints is checked against the draft's state (root token,
        prefix, parents forwarded before children; repeats are served from this step's
        results). As a tensor (what the device planner passes: one depth's frontier of new,
        distinct nodes) nothing is read back to the host: the first call of a step is the
        root's, every later one forwards all of its nodes.
        """
        if isinstance(nodes, torch.Tensor):
            return self._tensor_call(tree, nodes)
        nodes = check_draft_call(tree, nodes, self.root, self._committed)
        new = [v for v in dict.fromkeys(nodes) if v not in self._forwarded]
        rows = None
        if 0 in new:
            if new != [0]:
                raise ValueError(f"nodes={nodes}: the root must be forwarded alone (its children "
                                 "consume its output hidden)")
            rows = self._forward_root(tree)
        elif new:
            for v in new:
                p = int(tree.parent[0, v])
                if p not in self._forwarded:
                    raise ValueError(f"node {v}'s parent {p} was not forwarded in an earlier call of "
                                     "this step; parents must be passed before their children")
            rows = self._forward_nodes(tree, torch.tensor(new, dtype=torch.int64))
        self._forwarded.update(new)
        if rows is not None and new == nodes:
            return rows  # the planner's usual call (one depth's new frontier): no gather
        return self._rows[torch.tensor(nodes, dtype=torch.int64, device=self._rows.device)]

    def _tensor_call(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        if self.root is None:
            raise RuntimeError("node_logits() called before start()")
        if nodes.dim() != 1 or nodes.numel() < 1 or nodes.dtype.is_floating_point:
            raise ValueError(f"nodes has shape {tuple(nodes.shape)} and dtype {nodes.dtype}: allowed a "
                             "non-empty 1-D integer tensor of node ids")
        self._device_step = True
        if not self._root_done:
            if nodes.numel() != 1:
                raise ValueError(f"nodes has {nodes.numel()} entries in the step's first call: the root "
                                 "must be forwarded alone first (its children consume its output hidden)")
            self._forward_root(tree)
        else:
            self._forward_nodes(tree, nodes)
        return self._rows[nodes.to(self._rows.device)]

    def _project(self, out: torch.Tensor) -> torch.Tensor:
        """The head's logits ``[n, draft_vocab]`` in float32, columns ordered by target id."""
        d = self.head.draft_logits(out).to(torch.float32)
        return d if self._order is None else d[:, self._order]

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             allowed: torch.Tensor, max_position: int) -> torch.Tensor:
        """The head over these pairs; ``max_position``: a host bound on ``positions``."""
        dev = self._param.device
        emb = self.embed[tokens.to(self.embed.device)].to(dev, self._param.dtype)
        out, self._kv = self.head(emb, hidden, positions.to(dev), self._kv, allowed.to(dev), max_position)
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
        # Only the target model is known: run one capturing prefill, then drop the hooks.
        n_layers = len(getattr(getattr(src, "base_model", src), "layers", ()))
        probe = HFTarget(src, capture_layers=self.capture_layers(n_layers))
        try:
            probe.start(self._prompt)
            self.set_prompt_features(probe.prompt_features())
        finally:
            probe.close()

    def _forward_root(self, tree: DraftTree) -> torch.Tensor:
        """Run the pending pairs (the root's is the last) and start this step's node
        tables; returns the root's logit row ``[1, draft_vocab]``, also kept in ``_rows``."""
        self._ensure_prompt_features()
        dev = self._param.device
        P = len(self._pending_tokens)
        S = self._prefix
        allowed = torch.cat([torch.ones(P, S, dtype=torch.bool),
                             torch.ones(P, P, dtype=torch.bool).tril()], dim=1)
        positions = torch.arange(self._committed - P + 1, self._committed + 1, dtype=torch.int64)
        feats = self.head.fuse(torch.stack(self._pending_feats))
        out = self._run(torch.tensor(self._pending_tokens, dtype=torch.int64), feats, positions, allowed,
                        self._committed)
        self._prefix += P
        self._pending_tokens, self._pending_feats = [], []
        # this step's node tables, sized by the tree's capacity (a shape: no host read); a
        # node's hidden and logit rows are read only after it was forwarded, so they start
        # uninitialised (no cap x draft_vocab fill per step)
        cap = tree.parent.shape[1]
        self._hid = out.new_empty(cap, out.shape[-1])
        self._rows = torch.empty(cap, self.head.config.draft_vocab_size, dtype=torch.float32, device=dev)
        self._anc = torch.zeros(cap, cap, dtype=torch.bool, device=dev)  # the root sees no tree entry
        self._hid[0] = out[-1]
        rows = self._project(out[-1:])
        self._rows[0] = rows[0]
        self._root_done = True
        return rows

    def _forward_nodes(self, tree: DraftTree, new: torch.Tensor) -> torch.Tensor:
        """Forward nodes ``new`` (ids, their parents forwarded already) as one batch: each
        sees the committed pairs, its ancestors' tree entries below the root, and itself.
        Returns their logit rows (``_project``), also kept in ``_rows``."""
        dev = self._param.device
        new = new.to(tree.parent.device)
        par = tree.parent[0, new].to(dev)
        tokens = tree.token[0, new]
        positions = tree.depth[0, new].to(dev) + self._committed
        new = new.to(dev)
        q, T, S = new.shape[0], self._n_tree, self._kv[0].shape[1]
        ar = torch.arange(q, device=dev)
        sees = self._anc[par]  # [q, cap]: the parents' tree entries
        sees[ar, T + ar] = True  # and each node's own entry
        allowed = torch.cat([torch.ones(q, self._prefix, dtype=torch.bool, device=dev),
                             sees[:, :T + q]], dim=1)  # [q, S + q]: S = prefix + T
        # a node's depth is below the tree's capacity: a bound with no read of the depths
        out = self._run(tokens, self._hid[par], positions, allowed, self._committed + tree.parent.shape[1])
        self._anc[new] = sees
        self._hid[new] = out
        rows = self._project(out)
        self._rows[new] = rows
        self._n_tree += q
        assert self._kv[0].shape[1] == S + q
        return rows

    def commit(self, tree: DraftTree, path_nodes: list[int], emitted: list[int],
               features: list[torch.Tensor | None]) -> None:
        if self.root is None:
            raise RuntimeError("commit() called before start()")
        if self._device_step:
            path_nodes = check_device_path(path_nodes, emitted)  # reads nothing back
        else:
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
        self._reset_step()

    # -- batched decoding: every row's pairs in one head call per depth -------------------
    # The head is a one-sequence module, so the batch is flattened: one k/v cache
    # [kv_heads, S, head_dim] holds every row's committed pairs, ``_owner [S]`` says whose each
    # column is (-1: a hole, e.g. this step's tree entries, dropped at commit as in batch 1),
    # and the queries of all rows go through one call with a block mask (a row sees its own
    # committed columns, its ancestors and itself). Holes are compacted away when they are
    # more than half of the columns.

    def start_rows(self, prompts: list[list[int]]) -> None:
        ids = [check_prompt_ids(p, self.vocab_size) for p in prompts]
        self._reset()
        self._bkv = None
        self._owner = torch.zeros(0, dtype=torch.int64)
        self._brows = [self._new_row(p) for p in ids]

    def _new_row(self, ids: list[int]) -> _Row:
        return _Row(ids, len(ids) - 1, ids[-1], ids[1:] if len(ids) > 1 else ids[:1])

    def add_rows(self, prompts: list[list[int]]) -> None:
        rows = self._brows_started("add_rows")
        rows += [self._new_row(check_prompt_ids(p, self.vocab_size)) for p in prompts]

    def _brows_started(self, what: str) -> list[_Row]:
        rows = getattr(self, "_brows", None)
        if rows is None:
            raise RuntimeError(f"{what}() called before start_rows()")
        return rows

    def take_prompt_features_rows(self, target: TargetModel, rows: list[int] | None = None) -> None:
        have = self._brows_started("take_prompt_features_rows")
        src = self.features_from
        model = src.model if isinstance(src, HFTarget) else src
        feats = target.prompt_features_rows_for(model)
        for b in range(len(have)) if rows is None else rows:
            if feats[b] is not None:
                have[b].pending_feats = self._prompt_feats(have[b].prompt, feats[b])

    def _prompt_feats(self, prompt: list[int], features: torch.Tensor) -> list[torch.Tensor]:
        n = len(prompt)
        if features.dim() != 2 or features.shape[0] != n - 1:
            raise ValueError(f"features has shape {tuple(features.shape)}, expected "
                             f"({n - 1}, 3*target_hidden_size) for a {n}-token prompt")
        if n == 1:
            width = 3 * self.head.config.target_hidden_size
            return [torch.zeros(width, device=self._param.device, dtype=self._param.dtype)]
        return list(features.to(self._param.device, self._param.dtype))

    def _ensure_row_features(self, row: _Row) -> None:
        if row.pending_feats is not None:
            return
        src = self.features_from
        if src is None or isinstance(src, HFTarget) or hasattr(src, "prompt_features"):
            raise RuntimeError("a batched Eagle3Draft reads each row's prompt features from the "
                               "batched target (plan_and_decode does this) or from the target model "
                               "(features_from=model): pass features_from=<the target model>")
        n_layers = len(getattr(getattr(src, "base_model", src), "layers", ()))
        probe = HFTarget(src, capture_layers=self.capture_layers(n_layers))
        try:
            probe.start(row.prompt)
            row.pending_feats = self._prompt_feats(row.prompt, probe.prompt_features())
        finally:
            probe.close()

    @torch.no_grad()
    def node_logits_rows(self, tree: DraftTree, nodes: list[list[int]]) -> list[torch.Tensor]:
        rows = self.vocab_logits_rows(tree, nodes)
        if self.vocab_ids is None:
            return rows
        return [SubsetLogits(r, self.vocab_ids).dense(self.vocab_size) for r in rows]

    @torch.no_grad()
    def vocab_logits_rows(self, tree: DraftTree, nodes: list[list[int]]) -> list[torch.Tensor]:
        """``vocab_logits`` of every row: ``[len(nodes[b]), len(vocab_ids)]`` (float32), one
        head call for all rows (their queries flattened, a block mask keeping rows apart)."""
        rows = self._brows_started("node_logits_rows")
        if tree.batch != len(rows) or len(nodes) != len(rows):
            raise ValueError(f"tree holds {tree.batch} trees and nodes {len(nodes)} rows for {len(rows)} rows")
        dev = self._param.device
        S = 0 if self._bkv is None else self._bkv[0].shape[1]
        owner = self._owner
        toks, hids, poss, items = [], [], [], []  # items: (row, node or None, own column)
        feat_at = []  # the places in ``hids`` that hold target features, fused below in one call
        # per query: the columns it sees besides its row's committed ones (``_owner == row``):
        # this step's ancestors in the cache (< S) and this call's own entries (>= S)
        vis: list[list[int]] = []
        for b, (row, nb) in enumerate(zip(rows, nodes)):
            if int(tree.token[b, 0]) != row.root:
                raise ValueError(f"row {b}: tree root token {int(tree.token[b, 0])} differs from the "
                                 f"draft's root {row.root}; was commit_rows() called after the last step?")
            if int(tree.prefix_len[b]) != row.committed:
                raise ValueError(f"row {b}: tree.prefix_len={int(tree.prefix_len[b])} but the draft has "
                                 f"{row.committed} committed tokens before the root")
            nb = [int(v) for v in nb]
            bad = [v for v in nb if not 0 <= v < int(tree.n_nodes[b])]
            if bad:
                raise ValueError(f"row {b}: nodes {bad} are outside the tree's created nodes")
            new = [v for v in dict.fromkeys(nb) if v not in row.logits]
            if not new:
                continue
            if 0 in new:
                if new != [0]:
                    raise ValueError(f"row {b}: nodes={nb}: the root must be forwarded alone (its "
                                     "children consume its output hidden)")
                self._ensure_row_features(row)
                P = len(row.pending_tokens)
                first = S + len(items)
                for k, (tok, f) in enumerate(zip(row.pending_tokens, row.pending_feats)):
                    toks.append(tok)
                    feat_at.append(len(hids))
                    hids.append(f)
                    poss.append(row.committed - P + 1 + k)
                    vis.append(list(range(first, first + k + 1)))
                    items.append((b, 0 if k == P - 1 else None, first + k))
                continue
            for v in new:
                p = int(tree.parent[b, v])
                if p not in row.hidden:
                    raise ValueError(f"row {b}: node {v}'s parent {p} was not forwarded in an earlier "
                                     "call of this step; parents must be passed before their children")
                cols = []
                a = p
                while a > 0:
                    cols.append(row.slot[a])
                    a = int(tree.parent[b, a])
                cols.append(S + len(items))
                toks.append(int(tree.token[b, v]))
                hids.append(row.hidden[p])
                poss.append(row.committed + int(tree.depth[b, v]))
                vis.append(cols)
                items.append((b, v, S + len(items)))
        if items:
            Q = len(items)
            allowed = torch.zeros(Q, S + Q, dtype=torch.bool)
            qrow = torch.tensor([b for b, _, _ in items], dtype=torch.int64)
            allowed[:, :S] = owner[None, :] == qrow[:, None]  # each query's row's committed pairs
            qi = [i for i, cols in enumerate(vis) for _ in cols]
            allowed[qi, [c for cols in vis for c in cols]] = True
            tok = torch.tensor(toks, dtype=torch.int64, device=self.embed.device)
            emb = self.embed[tok].to(dev, self._param.dtype)
            hidden = self._fused_hidden(hids, feat_at).to(dev, self._param.dtype)
            pos = torch.tensor(poss, dtype=torch.int64, device=dev)
            out, self._bkv = self.head(emb, hidden, pos, self._bkv, allowed.to(dev), max(poss))
            new_owner = torch.full((Q,), -1, dtype=torch.int64)
            want = [i for i, (_, v, _) in enumerate(items) if v is not None]
            logits = self._project(out[want]) if want else None
            for r, i in enumerate(want):
                b, v, col = items[i]
                row = rows[b]
                row.hidden[v] = out[i]
                row.logits[v] = logits[r]
                row.slot[v] = -1 if v == 0 else col
            for i, (b, v, col) in enumerate(items):
                if v is None or v == 0:  # a pending pair: committed at once (batch 1: _prefix)
                    new_owner[i] = b
            for b in {b for b, v, _ in items if v == 0}:  # rows whose pending pairs ran
                rows[b].pending_tokens, rows[b].pending_feats = [], []
            self._owner = torch.cat([owner, new_owner])
        return [torch.stack([rows[b].logits[int(v)] for v in nodes[b]]) if len(nodes[b]) else
                torch.zeros(0, self.vocab_size if self.vocab_ids is None else len(self.vocab_ids), device=dev)
                for b in range(len(rows))]

    def _fused_hidden(self, hids: list[torch.Tensor], feat_at: list[int]) -> torch.Tensor:
        """``hids`` stacked, the target features at ``feat_at`` through the head's ``fc``
        in one product (one call per pair read ``fc``'s weight once per pair: ~11 pairs
        a call at 4 rows of SmolLM2: the 4-row draft phase went 2.12 -> 1.80 ms a step; a
        joining row's whole prompt, once)."""
        if not feat_at:
            return torch.stack(hids)
        fused = self.head.fuse(torch.stack([hids[i] for i in feat_at]))
        if len(feat_at) == len(hids):
            return fused
        for j, i in enumerate(feat_at):
            hids[i] = fused[j]
        return torch.stack(hids)

    def commit_rows(self, tree: DraftTree, path_nodes: list[list[int]], emitted: list[list[int]],
                    features: list[list[torch.Tensor | None]]) -> None:
        rows = self._brows_started("commit_rows")
        dev, dt = self._param.device, self._param.dtype
        hosts = drafts_on_host(tree)  # every row's tree in one transfer
        for b, row in enumerate(rows):
            nodes = check_emitted(tree, path_nodes[b], emitted[b], b, hosts[b])
            feats = features[b]
            if len(feats) != len(nodes) or any(f is None for f in feats):
                raise ValueError(f"row {b}: features must hold one target feature tensor per path node "
                                 f"({len(nodes)}), got {len(feats)} entries; build the target with "
                                 "capture_layers='eagle3'")
            self._ensure_row_features(row)  # a step that never ran the draft still owes them
            row.pending_tokens = row.pending_tokens + [int(t) for t in emitted[b]]
            row.pending_feats = row.pending_feats + [f.to(dev, dt) for f in feats]
            row.committed += len(nodes)
            row.root = int(emitted[b][-1])
            row.slot, row.hidden, row.logits = {}, {}, {}
        self._drop_tree_tail()
        self._maybe_compact()

    def _drop_tree_tail(self) -> None:
        """Drop the holes at the cache's end: this step's tree entries. They come after every
        committed pair (a step's first call runs the pending pairs, its later calls only tree
        nodes), so one row's cache keeps no holes, as at batch 1, and a batch keeps only
        those of rows whose pairs ran in a later call."""
        if self._bkv is None:
            return
        used = (self._owner >= 0).nonzero()
        n = int(used[-1]) + 1 if used.numel() else 0
        if n < self._owner.numel():
            self._bkv = (self._bkv[0][:, :n], self._bkv[1][:, :n])
            self._owner = self._owner[:n]

    def keep_rows(self, rows: list[int]) -> None:
        have = self._brows_started("keep_rows")
        remap = torch.full((len(have) + 1,), -1, dtype=torch.int64)
        for new, old in enumerate(rows):
            remap[old] = new
        self._owner = torch.where(self._owner >= 0, remap[self._owner.clamp(min=0)], -1)
        self._brows = [have[r] for r in rows]
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop hole columns when they are at least 64 and more than half of the cache."""
        if self._bkv is None:
            return
        keep = (self._owner >= 0).nonzero().flatten()
        S = self._owner.numel()
        if S - keep.numel() >= max(64, keep.numel()):
            idx = keep.to(self._bkv[0].device)
            self._bkv = (self._bkv[0].index_select(1, idx), self._bkv[1].index_select(1, idx))
            self._owner = self._owner[keep]


def load_eagle3_checkpoint(path: str | os.PathLike, target: Any = None, *,
                           features_from: FeatureSource | None = None,
                           dtype: torch.dtype = torch.float32,
                           device: str | torch.device | None = None) -> Eagle3Draft:
    """Load the EAGLE-3 checkpoint in ``path`` (strictly, see ``read_eagle3``) as a draft.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin``.
        target: the target the head drafts for: a transformers causal LM (embeddings and
            prompt features come from it; per-step features from the verify forward, which
            ``as_target(model)`` captures by default), or its token embeddings
            (``nn.Embedding`` or a ``[vocab, H]`` tensor; then pass ``features_from`` or call
            ``set_prompt_features``), or None when the checkpoint carries
            ``embed_tokens.weight``. With a model, ``Eagle3Draft.check_target`` runs here.
        features_from: where prompt features come from (default: ``target`` when it is a model).
        dtype: the head's floating dtype.
        device: the head's device (default: the target's).

    Example (a tiny random target and head, saved and loaded back):
        >>> import tempfile
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from rheoplan import plan_and_decode, TreeConfig
        >>> from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                      num_hidden_layers=4, num_attention_heads=4,
        ...                                      num_key_value_heads=2)).eval()
        >>> ckpt = tempfile.mkdtemp()
        >>> save_eagle3(Eagle3Head(Eagle3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                     num_attention_heads=4, num_key_value_heads=2)), ckpt)
        >>> draft = load_eagle3_checkpoint(ckpt, model)
        >>> r = plan_and_decode(model, draft, [1, 2, 3], max_new_tokens=6, seed=0,
        ...                     tree=TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=8))
        >>> len(r.tokens)
        6
    """
    is_model = isinstance(target, nn.Module) and hasattr(target, "get_input_embeddings")
    embed = target.get_input_embeddings() if is_model else target
    if features_from is None and is_model:
        features_from = target
    if device is None:
        device = _embedding_weight(embed).device if embed is not None else "cpu"
    head = read_eagle3(path, dtype=dtype, device=device)
    draft = Eagle3Draft(head, embed, features_from=features_from)
    if is_model:
        draft.check_target(target)
    return draft
