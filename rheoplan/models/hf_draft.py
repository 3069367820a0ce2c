"""``DraftModel`` over a standalone Hugging Face causal LM sharing the target's tokenizer.

The draft keeps its own KV cache laid out as ``[committed prefix | this step's nodes]``.
Nodes are appended as they are forwarded (tree attention over the prefix and their own
ancestors, ``position = prefix_len + depth``). ``commit`` keeps the accepted path's nodes it
had forwarded but the last (see ``commit``) and drops the rest; the other emitted tokens
(the path's last node, the bonus token) are *pending* and run as a chain in front of the
next root. Node ids given as a tensor (the Triton planner) take a device path that reads
nothing back to the host.

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
from rheoplan.models.base import (DraftModel, HostDraft, check_device_path, check_draft_call, check_emitted,
                                  check_prompt_ids, draft_on_host, drafts_on_host)
from rheoplan.models._hf_common import (
    base_model, cache_length, new_cache, output_head, run_base, commit_cache, forward_memory,
)
from rheoplan.models.row_cache import RowCache


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
        self._reset_step()

    def _reset_step(self) -> None:
        """Forget this step's nodes (their cache entries are dropped or kept by ``commit``)."""
        # host path (node ids as lists): what the host knows of the step's forwarded nodes
        self._slot: dict[int, int] = {}  #: node id -> cache index
        self._logits: dict[int, torch.Tensor] = {}  #: node id -> logits
        # device path (node ids as a tensor): per node id, on the model's device, sized by the
        # tree's capacity at the step's first call; never read back to the host
        self._device_step = False
        self._n_step = 0  #: this step's entries in the cache after the committed prefix
        self._col: torch.Tensor | None = None  #: [cap] step column of each node (-1: not forwarded)
        self._anc: torch.Tensor | None = None  #: [cap, cap] step columns each node sees
        self._rows: torch.Tensor | None = None  #: [cap, vocab] logits of each forwarded node

    def memory_estimate(self, batch: int, width: int, tree_len: int) -> int:
        """The draft model's KV cache of ``batch`` rows ``width`` columns wide and its
        largest call (one depth's frontier: at most ``tree_len`` nodes per row)."""
        elem = next(self.model.parameters()).element_size()
        return forward_memory(self.model.config, elem, self.vocab_size, batch, width, tree_len)

    def start(self, prompt_ids: list[int]) -> None:
        ids = check_prompt_ids(prompt_ids, self.vocab_size)
        self.cache = new_cache(self.model)
        self._prefix = 0
        # The prompt runs lazily with the first root, in the same forward.
        self._pending = ids[:-1]
        self.root = ids[-1]
        self._reset_step()

    @property
    def committed_len(self) -> int:
        """Tokens committed before the root (cached + pending)."""
        return self._prefix + len(self._pending)

    @torch.no_grad()
    def node_logits(self, tree: DraftTree, nodes) -> torch.Tensor:
        """Draft logits ``[len(nodes), vocab_size]`` (float32) of tree 0's ``nodes``.

        ``nodes`` as a list of ints (any order with parents before children; repeats are
        served from this step's results) is checked against the draft's state with one read
        of the tree. As a tensor (what the device planner passes: one depth's frontier of new,
        distinct nodes, the root alone in the step's first call) nothing is read back to the
        host, so the tree is trusted to be the one the draft was committed to (its root is
        ``self.root``, its prefix ``committed_len``), as in ``Eagle3Draft``.
        """
        if isinstance(nodes, torch.Tensor):
            return self._tensor_call(tree, nodes)
        if self.cache is None:
            raise RuntimeError("node_logits() called before start()")
        if self._device_step:
            raise ValueError("nodes came as a tensor earlier in this step: pass every call of a step "
                             "the same way (a list or a tensor)")
        host = draft_on_host(tree, nodes)  # one transfer: tokens, parents, the call's ids
        nodes = check_draft_call(tree, nodes, self.root, self.committed_len, host=host)
        if 0 in nodes and 0 not in self._slot and nodes[0] != 0:
            raise ValueError(f"nodes={nodes}: the root must come first in the call that forwards it")
        new = [v for v in dict.fromkeys(nodes) if v not in self._logits]
        if new:
            self._forward(host, new)
        return torch.stack([self._logits[v] for v in nodes])

    def _forward(self, host: HostDraft, new: list[int]) -> None:
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
            a, depth = v, -1
            while a >= 0:
                if a in row_of:
                    allowed[r, base_len + row_of[a]] = True
                elif a in self._slot:
                    allowed[r, self._slot[a]] = True
                else:
                    raise ValueError(f"node {v}'s ancestor {a} was not forwarded yet in this step; "
                                     "parents must be passed before their children")
                a, depth = host.parent[a] if a > 0 else -1, depth + 1
            tokens.append(host.token[v])
            positions.append(prefix_len + depth)
        tok = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = run_base(self.base, self.cache, tok, pos, allowed.to(self.device),
                          all_allowed=_sees_all(q, base_len - self._prefix))
        self._prefix += len(pending)
        self._pending = [] if pending else self._pending
        logits = fit_vocab(self.head(hidden[len(pending):]), self.vocab_size)
        for v, row in zip(new, logits):
            self._slot[v] = base_len + row_of[v]
            self._logits[v] = row

    def _tensor_call(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        """The device path: tokens, depths and parents are gathered on the device, the
        attention mask is built from the parents' rows of ``_anc``; no host read."""
        if self.cache is None:
            raise RuntimeError("node_logits() called before start()")
        if nodes.dim() != 1 or nodes.numel() < 1 or nodes.dtype.is_floating_point:
            raise ValueError(f"nodes has shape {tuple(nodes.shape)} and dtype {nodes.dtype}: allowed a "
                             "non-empty 1-D integer tensor of node ids")
        if self._slot:
            raise ValueError("nodes came as a list earlier in this step: pass every call of a step "
                             "the same way (a list or a tensor)")
        dev = self.device
        cap = tree.parent.shape[1]
        if not self._device_step:
            if nodes.numel() != 1:
                raise ValueError(f"nodes has {nodes.numel()} entries in the step's first call: the root "
                                 "must be forwarded alone first")
            self._device_step = True
            self._col = torch.full((cap,), -1, dtype=torch.int64, device=dev)
            self._anc = torch.zeros(cap, cap, dtype=torch.bool, device=dev)
            self._rows = torch.zeros(cap, self.vocab_size, dtype=torch.float32, device=dev)
            self._forward_root()
        else:
            self._forward_nodes(tree, nodes)
        return self._rows[nodes.to(dev)]

    def _forward_root(self) -> None:
        """The pending chain and the root (node 0, token ``self.root``) in one forward: the
        same query rows, positions and mask as the host path's root call."""
        dev, P = self.device, len(self._pending)
        q = P + 1
        tok = torch.tensor(self._pending + [self.root], dtype=torch.int64, device=dev)
        pos = torch.arange(self._prefix, self._prefix + q, dtype=torch.int64, device=dev)
        allowed = torch.cat([torch.ones(q, self._prefix, dtype=torch.bool, device=dev),
                             torch.ones(q, q, dtype=torch.bool, device=dev).tril()], dim=1)
        hidden = run_base(self.base, self.cache, tok, pos, allowed, all_allowed=_sees_all(q, 0))
        self._prefix += P
        self._pending = []
        self._rows[0] = fit_vocab(self.head(hidden[P:]), self.vocab_size)[0]
        self._col[0] = 0
        self._anc[0, 0] = True
        self._n_step = 1

    def _forward_nodes(self, tree: DraftTree, new: torch.Tensor) -> None:
        """Forward nodes ``new`` (distinct, their parents forwarded in earlier calls) as one
        batch: each sees the committed prefix, its ancestors' step entries and itself."""
        dev, q, T = self.device, new.numel(), self._n_step
        cap = self._anc.shape[0]
        if T + q > cap:
            raise ValueError(f"{T + q} nodes forwarded in this step but the tree holds {cap}: with nodes "
                             "as a tensor each node must be new (forwarded once per step)")
        new = new.to(tree.parent.device)
        par = tree.parent[0, new].to(dev)
        tok = tree.token[0, new].to(dev)
        pos = tree.depth[0, new].to(dev) + self._prefix  # the pending chain ran with the root
        new = new.to(dev)
        ar = torch.arange(q, device=dev)
        sees = self._anc[par]  # [q, cap]: the parents' step entries
        sees[ar, T + ar] = True  # and each node's own
        allowed = torch.cat([torch.ones(q, self._prefix, dtype=torch.bool, device=dev), sees[:, :T + q]], dim=1)
        hidden = run_base(self.base, self.cache, tok, pos, allowed, all_allowed=_sees_all(q, T))
        self._anc[new] = sees
        self._col[new] = T + ar
        self._rows[new] = fit_vocab(self.head(hidden), self.vocab_size)
        self._n_step += q

    # -- batched decoding: one forward per depth for every row (rheoplan.models.row_cache) ----

    def start_rows(self, prompts: list[list[int]]) -> None:
        """Reset for a batch; each row's prompt runs lazily with its first root, as in batch 1."""
        ids = [check_prompt_ids(p, self.vocab_size) for p in prompts]
        self.cache = None  # the batch-1 state is not used in batch mode
        self._rows = RowCache(self.model, len(ids), self.device)
        self._r_cached = [0] * len(ids)  #: committed entries of each row in the cache
        self._r_pending = [p[:-1] for p in ids]
        self._r_root = [p[-1] for p in ids]
        self._r_slot: list[dict[int, int]] = [{} for _ in ids]  #: node -> cache column, this step
        self._r_logits: list[dict[int, torch.Tensor]] = [{} for _ in ids]

    def add_rows(self, prompts: list[list[int]]) -> None:
        """Rows joining the batch (between steps), appended after the current rows; their
        prompts run lazily with their first roots."""
        rc = self._row_started("add_rows")
        ids = [check_prompt_ids(p, self.vocab_size) for p in prompts]
        rc.extend(RowCache(self.model, len(ids), self.device))
        self._r_cached += [0] * len(ids)
        self._r_pending += [p[:-1] for p in ids]
        self._r_root += [p[-1] for p in ids]
        self._r_slot += [{} for _ in ids]
        self._r_logits += [{} for _ in ids]

    def _row_started(self, what: str) -> RowCache:
        rows = getattr(self, "_rows", None)
        if rows is None:
            raise RuntimeError(f"{what}() called before start_rows()")
        return rows

    @torch.no_grad()
    def node_logits_rows(self, tree: DraftTree, nodes: list[list[int]]) -> list[torch.Tensor]:
        rc = self._row_started("node_logits_rows")
        B = rc.batch
        if tree.batch != B or len(nodes) != B:
            raise ValueError(f"tree holds {tree.batch} trees and nodes {len(nodes)} rows for {B} rows")
        news, pend = [], []
        for b in range(B):
            if int(tree.token[b, 0]) != self._r_root[b]:
                raise ValueError(f"row {b}: tree root token {int(tree.token[b, 0])} differs from the "
                                 f"draft's root {self._r_root[b]}; was commit_rows() called after the last step?")
            committed = self._r_cached[b] + len(self._r_pending[b])
            if int(tree.prefix_len[b]) != committed:
                raise ValueError(f"row {b}: tree.prefix_len={int(tree.prefix_len[b])} but the draft has "
                                 f"{committed} committed tokens before the root")
            nb = [int(v) for v in nodes[b]]
            bad = [v for v in nb if not 0 <= v < int(tree.n_nodes[b])]
            if bad:
                raise ValueError(f"row {b}: nodes {bad} are outside the tree's created nodes")
            new = [v for v in dict.fromkeys(nb) if v not in self._r_logits[b]]
            if 0 in new and nb[0] != 0:
                raise ValueError(f"row {b}: nodes={nb}: the root must come first in the call that forwards it")
            news.append(new)
            pend.append(self._r_pending[b] if 0 in new else [])
        q = max(len(p) + len(n) for p, n in zip(pend, news))
        if q > 0:
            self._forward_rows(rc, tree, news, pend, q)
        return [torch.stack([self._r_logits[b][int(v)] for v in nodes[b]]) if len(nodes[b]) else
                torch.zeros(0, self.vocab_size, device=self.device) for b in range(B)]

    def _forward_rows(self, rc: RowCache, tree: DraftTree, news: list[list[int]], pend: list[list[int]],
                      q: int) -> None:
        """Forward each row's pending chain (with its root) then its new nodes, padded to ``q``
        queries; the pending tokens become committed entries at once."""
        B, S0 = rc.batch, rc.width
        tokens = torch.zeros(B, q, dtype=torch.int64)
        positions = torch.zeros(B, q, dtype=torch.int64)
        block = torch.zeros(B, q, q, dtype=torch.bool)
        extra = torch.zeros(B, q, S0, dtype=torch.bool)
        for b in range(B):
            P, new = len(pend[b]), news[b]
            committed = self._r_cached[b] + len(self._r_pending[b])
            for k, tok in enumerate(pend[b]):
                tokens[b, k] = tok
                positions[b, k] = self._r_cached[b] + k
                block[b, k, :k + 1] = True
            row_of = {v: P + r for r, v in enumerate(new)}
            for r, v in enumerate(new):
                i = P + r
                block[b, i, :P] = True
                a = v
                while a >= 0:
                    if a in row_of:
                        block[b, i, row_of[a]] = True
                    elif a in self._r_slot[b]:
                        extra[b, i, self._r_slot[b][a]] = True
                    else:
                        raise ValueError(f"row {b}: node {v}'s ancestor {a} was not forwarded yet in this "
                                         "step; parents must be passed before their children")
                    a = int(tree.parent[b, a]) if a > 0 else -1
                tokens[b, i] = int(tree.token[b, v])
                positions[b, i] = committed + int(tree.depth[b, v])
            for i in range(P + len(new), q):
                block[b, i, i] = True  # padding query: sees only itself
        hidden = rc.forward(self.base, tokens, positions, block, extra)
        rc.keep([[S0 + k for k in range(len(p))] for p in pend])
        for b in range(B):
            P, new = len(pend[b]), news[b]
            if P:
                self._r_cached[b] += P
                self._r_pending[b] = []
            if new:
                logits = fit_vocab(self.head(hidden[b, P:P + len(new)]), self.vocab_size)
                for r, v in enumerate(new):
                    self._r_slot[b][v] = S0 + P + r
                    self._r_logits[b][v] = logits[r]

    def commit_rows(self, tree: DraftTree, path_nodes: list[list[int]], emitted: list[list[int]],
                    features: list[list[torch.Tensor | None]]) -> None:
        rc = self._row_started("commit_rows")
        keep = []
        hosts = drafts_on_host(tree)  # every row's tree in one transfer
        for b in range(rc.batch):
            nodes = check_emitted(tree, path_nodes[b], emitted[b], b, hosts[b])
            done = [v for v in nodes if v in self._r_slot[b]]
            if done != nodes[:len(done)]:
                raise AssertionError(f"row {b}: forwarded path nodes {done} are not a prefix of {nodes}")
            keep.append([self._r_slot[b][v] for v in done])
            self._r_cached[b] += len(done)
            path_tokens = [int(tree.token[b, 0])] + [int(t) for t in emitted[b][:-1]]
            self._r_pending[b] = self._r_pending[b] + path_tokens[len(done):]
            self._r_root[b] = int(emitted[b][-1])
            self._r_slot[b], self._r_logits[b] = {}, {}
        rc.keep(keep)
        rc.maybe_compact()

    def keep_rows(self, rows: list[int]) -> None:
        rc = self._row_started("keep_rows")
        for name in ("_r_cached", "_r_pending", "_r_root", "_r_slot", "_r_logits"):
            have = getattr(self, name)
            setattr(self, name, [have[r] for r in rows])
        rc.select(rows)

    def commit(self, tree: DraftTree, path_nodes: list[int], emitted: list[int],
               features: list[torch.Tensor | None]) -> None:
        """Keep the cache entries of the accepted path's forwarded nodes, except its last node
        (unless the path is the root alone); every other emitted token becomes pending.

        Why not the last: after a device step the host does not know whether the last node was
        forwarded (only the ids on the device do), while every node with a child on the path was
        (the planner drafts a node before giving it children) and so was the root. Both paths
        follow the same rule, so they keep the same cache; the last node's token runs again
        with the next root, one more query row in a forward that happens anyway."""
        if self.cache is None:
            raise RuntimeError("commit() called before start()")
        if self._device_step:
            path_nodes = check_device_path(path_nodes, emitted)  # reads nothing back
            done = path_nodes[:max(1, len(path_nodes) - 1)]
            cols = self._col[torch.tensor(done, dtype=torch.int64, device=self.device)]
        else:
            path_nodes = check_emitted(tree, path_nodes, emitted)  # one read of the tree
            # Forwarded nodes' ancestors were forwarded, so the forwarded part is a path prefix.
            done = [v for v in path_nodes if v in self._slot]
            if done != path_nodes[:len(done)]:
                raise AssertionError(f"forwarded path nodes {done} are not a prefix of {path_nodes}")
            done = done[:max(1, len(path_nodes) - 1)]
            cols = [self._slot[v] - self._prefix for v in done]
        commit_cache(self.cache, self._prefix, cols)
        self._prefix += len(done)
        path_tokens = [self.root] + [int(t) for t in emitted[:-1]]
        self._pending = self._pending + path_tokens[len(done):]
        self.root = int(emitted[-1])
        self._reset_step()


def _sees_all(q: int, step_entries: int) -> bool:
    """Whether every query of a forward sees every cache column, decided on the host the same
    way on both paths: one query and no entry of this step before it (the root's own call
    without pending tokens). Then no mask is passed (attention's unmasked path)."""
    return q == 1 and step_entries == 0
