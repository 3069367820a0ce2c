"""``DraftModel`` over a standalone Hugging Face causal LM sharing the target's tokenizer.

The draft keeps its own KV cache laid out as ``[committed prefix | this step's nodes]``.
Nodes are appended as they are forwarded (tree attention over the prefix and their own
ancestors, ``position = prefix_len + depth``). ``commit`` keeps the accepted nodes it had
forwarded and drops the rest; emitted tokens it never forwarded (accepted leaves, the
bonus token) are *pending* and run as a chain in front of the next root.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=101)
    >>> draft = HFDraft(LlamaForCausalLM(cfg).eval())
    >>> draft.start([5, 6, 7])   # 5, 6 pending; 7 is the root
"""

from __future__ import annotations

import torch

from rheoplan.ir import DraftTree
from rheoplan.models.base import DraftModel, check_draft_call, check_emitted, check_prompt_ids
from rheoplan.models._hf_common import (
    base_model, cache_length, new_cache, output_head, run_base, commit_cache,
)


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits ``[n, Vd]`` as ``[n, vocab_size]`` float32: extra columns (padding rows of an
    lm_head) are dropped, missing ones are -inf (tokens the draft cannot propose).

    Example: Vd = 3, vocab_size = 4 -> ``[[a, b, c, -inf]]``.
    """
    logits = logits.to(torch.float32)
    vd = logits.shape[-1]
    if vd >= vocab_size:
        return logits[:, :vocab_size]
    pad = torch.full((logits.shape[0], vocab_size - vd), float("-inf"), device=logits.device)
    return torch.cat([logits, pad], dim=1)


class HFDraft(DraftModel):
    """``DraftModel`` wrapping a small transformers causal LM (same tokenizer as the target).

    Args:
        model: a ``*ForCausalLM`` in eval mode.
        vocab_size: the target's vocabulary size (default: the draft's); draft columns
            beyond it are dropped, missing ones get -inf.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None) -> None:
        self.model = model
        self.base = base_model(model)
        self.head = output_head(model)
        self.vocab_size = int(vocab_size or model.config.vocab_size)
        self.device = next(model.parameters()).device
        self.cache = None
        self._prefix = 0  #: committed entries in the cache
        self._pending: list[int] = []  #: committed tokens not forwarded yet (before the root)
        self.root: int | None = None
        self._slot: dict[int, int] = {}  #: node id -> cache index, for this step's nodes
        self._logits: dict[int, torch.Tensor] = {}  #: node id -> logits, this step

    def start(self, prompt_ids: list[int]) -> None:
        ids = check_prompt_ids(prompt_ids, self.vocab_size)
        self.cache = new_cache(self.model)
        self._prefix = 0
        # The prompt runs lazily with the first root, in the same forward.
        self._pending = ids[:-1]
        self.root = ids[-1]
        self._slot, self._logits = {}, {}

    @property
    def committed_len(self) -> int:
        """Tokens committed before the root (cached + pending)."""
        return self._prefix + len(self._pending)

    @torch.no_grad()
    def node_logits(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        nodes = check_draft_call(tree, nodes, self.root if self.cache is not None else None,
                                 self.committed_len)
        if 0 in nodes and 0 not in self._slot and nodes[0] != 0:
            raise ValueError(f"nodes={nodes}: the root must come first in the call that forwards it")
        new = [v for v in dict.fromkeys(nodes) if v not in self._logits]
        if new:
            self._forward(tree, new)
        return torch.stack([self._logits[v] for v in nodes])

    def _forward(self, tree: DraftTree, new: list[int]) -> None:
        """Forward ``pending`` (only with the root) then ``new`` nodes; record slots and logits."""
        base_len = cache_length(self.cache)
        pending = self._pending if 0 in new else []
        q = len(pending) + len(new)
        prefix_len = self.committed_len
        row_of = {v: len(pending) + r for r, v in enumerate(new)}  # row in this forward
        allowed = torch.zeros(q, base_len + q, dtype=torch.bool)
        allowed[:, :base_len] = True  # committed prefix and earlier nodes of the step, refined below
        tokens, positions = list(pending), [self._prefix + k for k in range(len(pending))]
        for k in range(len(pending)):
            allowed[k, base_len + k] = True
            allowed[k, base_len:base_len + k] = True
        step_cols = torch.arange(self._prefix, base_len)
        for v in new:
            r = row_of[v]
            # Earlier nodes of this step are visible only if they are ancestors.
            allowed[r, step_cols] = False
            allowed[r, base_len:base_len + len(pending)] = True
            a = v
            while a >= 0:
                if a in row_of:
                    allowed[r, base_len + row_of[a]] = True
                elif a in self._slot:
                    allowed[r, self._slot[a]] = True
                else:
                    raise ValueError(f"node {v}'s ancestor {a} was not forwarded yet in this step; "
                                     "parents must be passed before their children")
                a = int(tree.parent[0, a]) if a > 0 else -1
            tokens.append(int(tree.token[0, v]))
            positions.append(prefix_len + int(tree.depth[0, v]))
        tok = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = run_base(self.base, self.cache, tok, pos, allowed.to(self.device))
        self._prefix += len(pending)
        self._pending = [] if pending else self._pending
        logits = fit_vocab(self.head(hidden[len(pending):]), self.vocab_size)
        for v, row in zip(new, logits):
            self._slot[v] = base_len + row_of[v]
            self._logits[v] = row

    def commit(self, tree: DraftTree, path_nodes: list[int], emitted: list[int],
               features: list[torch.Tensor | None]) -> None:
        if self.cache is None:
            raise RuntimeError("commit() called before start()")
        path_nodes = check_emitted(tree, path_nodes, emitted)
        # Forwarded nodes' ancestors were forwarded, so the forwarded part is a path prefix.
        done = [v for v in path_nodes if v in self._slot]
        if done != path_nodes[:len(done)]:
            raise AssertionError(f"forwarded path nodes {done} are not a prefix of {path_nodes}")
        commit_cache(self.cache, self._prefix, [self._slot[v] - self._prefix for v in done])
        self._prefix += len(done)
        path_tokens = [int(tree.token[0, 0])] + [int(t) for t in emitted[:-1]]
        self._pending = self._pending + path_tokens[len(done):]
        self.root = int(emitted[-1])
        self._slot, self._logits = {}, {}
