"""``TargetModel`` over a Hugging Face causal LM, with tree attention and lazy logits.

One verify step is one forward of the root and every kept drafted node with a 4D mask
(cached prefix fully visible, tree block = ancestor mask) and ``position = prefix_len +
depth``. Only the decoder stack runs; the output projection is applied to a node's final
hidden state when the verifier asks for that node's logits, because the walk visits only a
handful of the ~48 nodes and the projection over a large vocabulary is a sizeable share of
the forward. ``commit`` compacts the KV cache in place (no re-forward).

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=101)
    >>> target = HFTarget(LlamaForCausalLM(cfg).eval())
    >>> target.start([5, 6, 7])   # caches [5, 6]; 7 is the first root
    >>> target.cached_len
    2
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from rheoplan.costmodel import ProjectionTimings, projection_timings
from rheoplan.ir import LinearTree
from rheoplan.models.base import (HostTree, TargetModel, TreeLogits, check_commit_path, check_groups,
                                  check_prompt_ids, linear_on_host, linears_on_host)
from rheoplan.models._hf_common import (
    base_model, cache_length, crop_cache, new_cache, output_head, prefix_and_block_mask,
    run_base, commit_cache, forward_memory,
)
from rheoplan.models.lean_llama import capture_hook
from rheoplan.models.row_cache import RowCache
from rheoplan.models.tree_attention import (
    TreeAttentionArgs, check_tree_attention_available, tree_attention_active,
)
from rheoplan.mutation import active


def eagle3_layers(num_layers: int) -> list[int]:
    """Layers whose *inputs* an EAGLE-3 head reads: ``[2, num_layers // 2, num_layers - 3]``.

    Input of layer ``i`` = ``hidden_states[i]`` of ``output_hidden_states=True``.

    Example: 32 layers -> ``[2, 16, 29]``.
    """
    if num_layers < 4:
        raise ValueError(f"num_layers={num_layers} is too small for EAGLE-3 capture "
                         "(layers 2, n//2, n-3 must exist): allowed >= 4")
    return [2, num_layers // 2, num_layers - 3]


class _FeatureCapture:
    """Forward pre-hooks that record the input hidden states of chosen decoder layers."""

    def __init__(self, layers: torch.nn.ModuleList, indices: Sequence[int]) -> None:
        self.indices = list(indices)
        self.seen: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i in self.indices]

    def _hook(self, i: int):
        @capture_hook  # reads the input only: lean_llama.lean_forward calls it itself
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.seen[i] = h.detach()
        return hook

    def take(self) -> torch.Tensor:
        """Concatenated captures ``[q, len(indices) * H]`` of the last forward."""
        return self.take_rows()[0]

    def take_rows(self) -> torch.Tensor:
        """Concatenated captures ``[B, q, len(indices) * H]`` of the last (batched) forward."""
        out = torch.cat([self.seen[i] for i in self.indices], dim=-1)
        self.seen.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class HFTreeLogits(TreeLogits):
    """Result of one verify forward: final hidden states; logits projected on demand."""

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module,
                 features: torch.Tensor | None, projection: ProjectionTimings | str = "lazy") -> None:
        self._hidden = hidden  #: [n, H] final (normed) hidden states
        self._head = head
        self._features = features  #: [n, 3H] or None
        self._projection = projection  #: measured c_p(k), or 'all' / 'lazy' (``HFTarget.projection``)
        self._memo: dict[int, torch.Tensor] = {}
        self.n_projected = 0  #: nodes whose logits were computed (laziness is measurable)

    @property
    def n(self) -> int:
        return self._hidden.shape[0]

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"linear node {i} is outside [0, {self.n})")

    def logits(self, i: int) -> torch.Tensor:
        self._check(i)
        if i not in self._memo:
            t0 = time.perf_counter()
            with torch.no_grad():
                self._memo[i] = self._head(self._hidden[i]).to(torch.float32)
            self.projection_seconds += time.perf_counter() - t0
            self.n_projected += 1
        return self._memo[i]

    def prefetch(self, nodes: Sequence[int]) -> None:
        """Project ``nodes`` in one batched matmul and keep the results for ``logits``.

        Why: a single-row projection is a matrix-vector product that reads the whole lm_head
        weight, so five one-by-one projections cost about as much as all 48 rows at once
        (measured in examples/measure_lazy_logits.py). A caller that can guess the walk
        (e.g. the draft's most likely path) saves the difference by projecting it in one go.
        """
        todo = [int(i) for i in dict.fromkeys(nodes) if int(i) not in self._memo]
        for i in todo:
            self._check(i)
        if not todo:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self._head(self._hidden[todo]).to(torch.float32)
        self.projection_seconds += time.perf_counter() - t0
        self._store(todo, out)

    def _store(self, nodes: list[int], out: torch.Tensor) -> None:
        for i, row in zip(nodes, out):
            self._memo[i] = row
        self.n_projected += len(nodes)

    def all_logits(self) -> torch.Tensor:
        """Logits ``[n, V]`` at every node in one projection (for measurement and tests)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self._head(self._hidden).to(torch.float32)
        self.projection_seconds += time.perf_counter() - t0
        self.n_projected += self.n
        return out

    def prefers_all_logits(self, path_len: int) -> bool:
        """The measured choice (``ProjectionTimings.project_all``) of all rows at once over
        the likely path and then node by node; ``HFTarget.projection`` may fix it."""
        p = self._projection
        if isinstance(p, str):
            return p == "all"
        return p.project_all(self.n, path_len)

    def features(self, i: int) -> torch.Tensor | None:
        self._check(i)
        return None if self._features is None else self._features[i]


class HFTarget(TargetModel):
    """``TargetModel`` wrapping a transformers causal LM (Llama family and alike).

    Args:
        model: a ``*ForCausalLM`` in eval mode; its dtype and device are used as they are.
        capture_layers: None (no features), ``"eagle3"`` (the inputs of layers 2,
            n//2, n-3) or explicit layer indices; ``TreeLogits.features(i)`` and
            ``prompt_features()`` return their concatenation.

    ``projection`` (attribute, default ``'auto'``): how the CPU walk gets a tree's logits.
    ``'auto'`` measures the output projection of 1..64 rows once (per process, cached on
    disk: ``rheoplan.costmodel.projection_timings``) on the first verify forward and takes
    the cheaper of all rows at once and the likely path then node by node
    (``ProjectionTimings.project_all``); ``'all'`` and ``'lazy'`` fix the choice.
    """

    #: the walk's projection choice: 'auto' (measured), 'all' or 'lazy'
    PROJECTIONS = ("auto", "all", "lazy")
    #: batched prefills take ``groups=`` (``_prefill_groups``)
    prefills_in_groups = True

    def __init__(self, model: torch.nn.Module, capture_layers: Sequence[int] | str | None = None) -> None:
        self.model = model
        self.base = base_model(model)
        self.head = output_head(model)
        self.vocab_size = int(model.config.vocab_size)
        #: longest context the model was built for (the decode loop checks it up front)
        self.max_context: int | None = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        n_layers = len(self.base.layers)
        if capture_layers == "eagle3":
            capture_layers = eagle3_layers(n_layers)
        elif isinstance(capture_layers, str):
            raise ValueError(f"capture_layers={capture_layers!r}: allowed None, 'eagle3' or a list of ints")
        self._capture = None
        if capture_layers is not None:
            capture_layers = [int(i) for i in capture_layers]
            bad = [i for i in capture_layers if not 0 <= i < n_layers]
            if bad or not capture_layers:
                raise ValueError(f"capture_layers={capture_layers} must be non-empty indices in "
                                 f"[0, {n_layers})")
            self._capture = _FeatureCapture(self.base.layers, capture_layers)
        self.capture_layers = capture_layers
        self.cache = None
        self._prompt_features: torch.Tensor | None = None
        self._tree: HostTree | None = None  #: last verified tree, read on the host (its entries follow the prefix)
        self._prefix = 0  #: committed entries in the cache
        self._tree_attention = False  #: verify forward through the Triton tree-attention kernel
        self._tree_attention_tf32 = False
        self.projection = "auto"
        self._projection_timings: ProjectionTimings | None = None

    def use_tree_attention(self, enabled: bool = True, allow_tf32: bool = False) -> bool:
        """Run the verify forward (``forward_tree``) through the Triton tree-attention kernel,
        registered as a transformers attention implementation (``rheoplan.models.tree_attention``);
        prefill (``start``) keeps the model's own attention. Needs the model on a CUDA device,
        or on the CPU under ``TRITON_INTERPRET=1``; raises before any model work otherwise.
        ``allow_tf32`` lets a float32 model use TF32 dots in the kernel (GPU only)."""
        if enabled:
            check_tree_attention_available(self.device)
        self._tree_attention = bool(enabled)
        self._tree_attention_tf32 = bool(allow_tf32)
        return self._tree_attention

    @property
    def tree_attention(self) -> bool:
        """Whether ``forward_tree`` runs the Triton tree-attention kernel."""
        return self._tree_attention

    def close(self) -> None:
        """Remove the feature-capture hooks from the model (they would outlive this adapter)."""
        if self._capture is not None:
            self._capture.remove()
            self._capture = None

    @property
    def cached_len(self) -> int:
        """Committed tokens in the cache (tokens before the current root)."""
        return self._prefix

    def _features(self) -> torch.Tensor | None:
        return None if self._capture is None else self._capture.take()

    def start(self, prompt_ids: list[int]) -> None:
        self._prefill(check_prompt_ids(prompt_ids, self.vocab_size), with_root=False)

    def start_and_root(self, prompt_ids: list[int]) -> HFTreeLogits:
        """Prefill the whole prompt; its last position's output serves the first new token
        (``TargetModel.start_and_root``): one forward fewer than ``start`` + a root-only
        verify, as ``generate`` draws its first token from the prefill. ``prompt_features()``
        then holds one feature per prompt token (the last one's too)."""
        hidden, feats = self._prefill(check_prompt_ids(prompt_ids, self.vocab_size), with_root=True)
        return self._served(hidden[None], None if feats is None else feats[None])[0]

    @torch.no_grad()
    def _prefill(self, ids: list[int], with_root: bool):
        """Reset and cache ``ids`` (without the last token unless ``with_root``); returns
        the forward's hidden states and captured features (None, None for no token)."""
        self.cache = new_cache(self.model)
        self._tree = None
        n = len(ids) if with_root else len(ids) - 1
        self._prefix = n
        self._prompt_features = None
        if n == 0:
            if self._capture is not None:
                width = len(self.capture_layers) * self.base.config.hidden_size
                self._prompt_features = torch.zeros(0, width, device=self.device)
            return None, None
        tok = torch.tensor(ids[:n], dtype=torch.int64, device=self.device)
        pos = torch.arange(n, dtype=torch.int64, device=self.device)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        hidden = run_base(self.base, self.cache, tok, pos, causal, all_allowed=n == 1)  # causal: all allowed iff one token
        feats = self._features()
        self._prompt_features = feats  # one per cached token
        return hidden, feats

    def prompt_features(self) -> torch.Tensor:
        """Captured features of the cached prompt tokens: ``[len(prompt) - 1, 3H]`` after
        ``start``, ``[len(prompt), 3H]`` after ``start_and_root`` (the last token is cached).

        Feature ``t`` is taken at prompt position ``t`` (its output predicts token
        ``t + 1``); an EAGLE-3 draft pairs it with token ``t + 1``. Needs ``capture_layers``
        and a prior ``start`` or ``start_and_root``.
        """
        if self._capture is None:
            raise RuntimeError("prompt_features() needs HFTarget(..., capture_layers='eagle3' or indices)")
        if self._prompt_features is None:
            raise RuntimeError("prompt_features() called before start()")
        return self._prompt_features

    def prompt_features_for(self, model) -> torch.Tensor | None:
        """The prompt's captured features when ``model`` is the model this adapter wraps
        and it captures exactly the EAGLE-3 layers (handing them over saves an EAGLE-3
        draft a second forward over the whole prompt), else None."""
        if model is not self.model or self.capture_layers is None or self._prompt_features is None:
            return None
        if list(self.capture_layers) != eagle3_layers(len(self.base.layers)):
            return None
        return self._prompt_features

    @torch.no_grad()
    def forward_tree(self, linear: LinearTree) -> HFTreeLogits:
        if self.cache is None:
            raise RuntimeError("forward_tree() called before start()")
        if self.projection not in self.PROJECTIONS:
            raise ValueError(f"HFTarget.projection={self.projection!r}: allowed one of {self.PROJECTIONS}")
        if self._tree is not None:
            # A second verify of the same step (no commit in between) replaces the first.
            crop_cache(self.cache, self._prefix)
        # one device-to-host transfer per verify: n (the forward's shape), the root's position and
        # the tokens (checked before any model work) and the parents (commit's check reads them)
        host = linear_on_host(linear)
        n = host.n
        if n < 1:
            raise ValueError(f"linear.n[0]={n}: a tree holds at least its root")
        if host.position0 != self._prefix:
            raise ValueError(f"linear.position[0, 0]={host.position0} but the target caches "
                             f"{self._prefix} tokens before the root; positions must be "
                             "prefix_len + depth")
        if min(host.token) < 0 or max(host.token) >= self.vocab_size:
            raise ValueError(f"linear.token holds ids outside [0, {self.vocab_size}) in its first "
                             f"n={n} slots")
        pos = linear.position[0, :n].to(self.device)
        tok = linear.token[0, :n].to(self.device)
        if self._tree_attention:
            # The Triton kernel reads the ancestor words; no dense [n, prefix + n] mask is built.
            words = (n + 63) // 64
            args = TreeAttentionArgs(torch.full((1,), self._prefix, dtype=torch.int64, device=self.device),
                                     linear.ancestor_bits[:1, :n, :words].to(self.device),
                                     allow_tf32=self._tree_attention_tf32)
            with tree_attention_active(self.model):
                hidden = run_base(self.base, self.cache, tok, pos, None, rheoplan_tree=args)
        elif n == 1:
            # the root alone sees everything: no mask at all, as ``generate``'s one-token step
            hidden = run_base(self.base, self.cache, tok, pos, None, all_allowed=True)
        else:
            # with a child the root cannot see that child
            allowed = prefix_and_block_mask(self._prefix, linear.ancestor_mask[0, :n, :n].to(self.device))
            hidden = run_base(self.base, self.cache, tok, pos, allowed, all_allowed=False)
        self._tree = host
        return HFTreeLogits(hidden, self.head, self._features(), self._projection_choice(hidden))

    def _projection_choice(self, hidden: torch.Tensor) -> ProjectionTimings | str:
        if self.projection != "auto":
            return self.projection
        if self._projection_timings is None:
            self._projection_timings = projection_timings(
                self.head, self.vocab_size, hidden.shape[-1], device=hidden.device, dtype=hidden.dtype)
        return self._projection_timings

    # -- batched decoding: one forward for every row (rheoplan.models.row_cache) ------------

    def start_rows(self, prompts: list[list[int]], groups: list[list[int]] | None = None) -> None:
        """Prefill every row's prompt but its last token in one forward per group of rows
        (``TargetModel.start_rows``; left padding: the shorter prompts' first columns are
        holes)."""
        self._start_rows(prompts, with_root=False, groups=groups)

    def start_rows_and_roots(self, prompts: list[list[int]],
                             groups: list[list[int]] | None = None) -> list[HFTreeLogits]:
        """Prefill every row's whole prompt in one forward per group of rows; row ``b``'s
        last column serves its first new token (``TargetModel.start_rows_and_roots``)."""
        return self._served(*self._start_rows(prompts, with_root=True, groups=groups))

    def _start_rows(self, prompts: list[list[int]], with_root: bool, groups: list[list[int]] | None):
        ids = [check_prompt_ids(p, self.vocab_size) for p in prompts]
        self.cache = None  # the batch-1 state is not used in batch mode
        self._tree = None
        self._row_tree: LinearTree | None = None
        self._row_tree_start = 0  #: the cache column where the last verified trees start
        self._rows, self._row_prefix, self._row_prompt_features, hidden, feats = self._prefill_rows(
            ids, with_root, groups)
        return hidden, feats

    def add_rows(self, prompts: list[list[int]], groups: list[list[int]] | None = None) -> None:
        """Rows joining the batch (after ``commit_rows`` / ``keep_rows``): their prompts are
        prefilled in forwards of their own (one per group), then appended after the current
        rows."""
        self._add_rows(prompts, with_root=False, groups=groups)

    def add_rows_and_roots(self, prompts: list[list[int]],
                           groups: list[list[int]] | None = None) -> list[HFTreeLogits]:
        """``add_rows`` with the whole prompts cached; each new row's last column serves its
        first token (``TargetModel.add_rows_and_roots``)."""
        return self._served(*self._add_rows(prompts, with_root=True, groups=groups))

    def _add_rows(self, prompts: list[list[int]], with_root: bool, groups: list[list[int]] | None):
        if getattr(self, "_rows", None) is None:
            raise RuntimeError("add_rows() called before start_rows()")
        if self._row_tree is not None:
            raise RuntimeError("add_rows() called between forward_trees() and commit_rows()")
        ids = [check_prompt_ids(p, self.vocab_size) for p in prompts]
        rc, prefix, feats, hidden, f = self._prefill_rows(ids, with_root, groups)
        self._rows.extend(rc)
        self._row_prefix += prefix
        if self._row_prompt_features is not None and feats is not None:
            self._row_prompt_features += feats
        return hidden, f

    def _served(self, hidden: torch.Tensor, feats: torch.Tensor | None) -> list[HFTreeLogits]:
        """Each row's last column of a whole-prompt prefill (``[B, n, .]``) as a one-node
        ``HFTreeLogits``: the output that serves its first new token."""
        last = slice(-2, -1) if active("served_root_stale") and hidden.shape[1] > 1 else slice(-1, None)
        return [HFTreeLogits(hidden[b, last], self.head, None if feats is None else feats[b, last], "all")
                for b in range(hidden.shape[0])]

    @torch.no_grad()
    def _prefill_rows(self, ids: list[list[int]], with_root: bool, groups: list[list[int]] | None = None):
        """One left-padded forward over every row's prompt (without its last token unless
        ``with_root``), or one per group of rows in ``groups`` (``check_groups``): the row
        cache, the cached lengths, the prompt features (one per cached token), and the
        forwards' hidden states and features ``[B, n, .]`` (None for no token)."""
        if groups is not None and len(check_groups(groups, len(ids))) > 1:
            return self._prefill_groups(ids, with_root, groups)
        B = len(ids)
        rc = RowCache(self.model, B, self.device)
        prefix = [len(p) - (0 if with_root else 1) for p in ids]
        n = max(prefix)
        if n == 0:
            feats = None
            if self._capture is not None:
                width = len(self.capture_layers) * self.base.config.hidden_size
                feats = [torch.zeros(0, width, device=self.device) for _ in ids]
            return rc, prefix, feats, None, None
        tok = torch.zeros(B, n, dtype=torch.int64)
        pos = torch.zeros(B, n, dtype=torch.int64)
        real = torch.zeros(B, n, dtype=torch.bool)
        for b, (p, k) in enumerate(zip(ids, prefix)):
            tok[b, n - k:] = torch.tensor(p[:k])
            pos[b, n - k:] = torch.arange(k)
            real[b, n - k:] = True
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        # a padding query sees only itself (a fully masked row would be NaN in some kernels)
        block = (causal[None] & real[:, None, :]) | (torch.eye(n, dtype=torch.bool)[None] & ~real[:, :, None])
        hidden = rc.forward(self.base, tok, pos, block)
        rc.keep([list(range(n - k, n)) for k in prefix])
        f = feats = None
        if self._capture is not None:
            f = self._capture.take_rows()
            feats = [f[b, n - k:] for b, k in enumerate(prefix)]  # one per cached token
        return rc, prefix, feats, hidden, f

    def _prefill_groups(self, ids: list[list[int]], with_root: bool, groups: list[list[int]]):
        """``_prefill_rows`` as one forward per group: each group is padded only to its own
        longest prompt (rows of similar lengths together waste less than one forward padded
        to the longest of all: ``rheoplan.costmodel.prefill_groups``). The groups' caches
        are stacked (``RowCache.extend``) and put back in the rows' order
        (``RowCache.select``); hidden states and features are left-padded to the longest."""
        cached = lambda g: max(len(ids[i]) - (0 if with_root else 1) for i in g)  # noqa: E731
        groups = [list(g) for g in groups]
        for k in range(len(groups) - 1, -1, -1):  # a group caching nothing joins a neighbour
            if len(groups) > 1 and cached(groups[k]) == 0:
                g = groups.pop(k)
                groups[min(k, len(groups) - 1)][:0] = g
        if len(groups) == 1:
            return self._prefill_rows(ids, with_root)
        parts = [self._prefill_rows([ids[i] for i in g], with_root) for g in groups]
        order = [i for g in groups for i in g]
        back = sorted(range(len(order)), key=order.__getitem__)  # back[b]: row b's place in `order`
        rc = parts[0][0]
        for p in parts[1:]:
            rc.extend(p[0])
        rc.select(back)
        prefix = [x for p in parts for x in p[1]]
        prefix = [prefix[j] for j in back]
        feats = None
        if parts[0][2] is not None:  # features captured (every part alike)
            feats = [x for p in parts for x in p[2]]
            feats = [feats[j] for j in back]
        return (rc, prefix, feats, _stack_left([p[3] for p in parts], back), _stack_left([p[4] for p in parts], back))

    def prompt_features_rows_for(self, model) -> list[torch.Tensor | None]:
        """Per row, what ``prompt_features_for`` gives in batch 1."""
        if (model is not self.model or self.capture_layers is None or self._row_prompt_features is None
                or list(self.capture_layers) != eagle3_layers(len(self.base.layers))):
            return [None] * len(self._row_prefix)
        return list(self._row_prompt_features)

    @torch.no_grad()
    def forward_trees(self, linear: LinearTree) -> list[HFTreeLogits]:
        """One verify forward of every row's tree (trees padded to the largest with
        masked-out dummy nodes); one ``HFTreeLogits`` per row."""
        rows = getattr(self, "_rows", None)
        if rows is None:
            raise RuntimeError("forward_trees() called before start_rows()")
        if self._tree_attention:
            raise ValueError("use_tree_attention is on: the Triton tree-attention verify forward "
                             "runs one row; allowed for batched decoding: use_tree_attention(False)")
        B = rows.batch
        if linear.n.shape[0] != B:
            raise ValueError(f"linear holds {linear.n.shape[0]} trees for {B} rows")
        if self._row_tree is not None:
            rows.drop_tail(self._row_tree_start)  # a second verify of the same step replaces the first
        n = linear.n.cpu()
        L = int(n.max())
        real = torch.arange(L)[None, :] < n[:, None]  # [B, L]
        pos = torch.where(real, linear.position[:, :L].cpu(), 0)
        tok = torch.where(real, linear.token[:, :L].cpu(), 0)
        off = (pos[:, 0] != torch.tensor(self._row_prefix)).nonzero().flatten()
        if off.numel():
            b = int(off[0])
            raise ValueError(f"row {b}: linear.position[{b}, 0]={int(pos[b, 0])} but the target "
                             f"caches {self._row_prefix[b]} tokens of that row before its root")
        if int(tok.min()) < 0 or int(tok.max()) >= self.vocab_size:
            raise ValueError(f"linear.token holds ids outside [0, {self.vocab_size}) in its real slots")
        anc = linear.ancestor_mask[:, :L, :L].cpu()
        block = (anc & real[:, :, None] & real[:, None, :]) | (torch.eye(L, dtype=torch.bool)[None] & ~real[:, :, None])
        self._row_tree_start = rows.width
        hidden = rows.forward(self.base, tok, pos, block)
        feats = self._capture.take_rows() if self._capture is not None else None
        self._row_tree = linear
        choice = self._projection_choice(hidden)
        return [HFTreeLogits(hidden[b, :int(n[b])], self.head, None if feats is None else feats[b, :int(n[b])],
                             choice) for b in range(B)]

    def prefetch_rows(self, logits: list[HFTreeLogits], paths: list[list[int]]) -> None:
        """Project every row's likely path in ONE lm_head call (B single-row calls would
        read the 49k x H output matrix B times: at batch 16 that was a quarter of a step,
        py-spy in docs/batch.md). Every node of every row is projected instead when the
        measured ``c_p`` (``ProjectionTimings``) says all ``N`` rows cost no more than the
        ``P`` path rows plus one single-row projection per row that can leave its path."""
        if len(logits) != len(paths):
            raise ValueError(f"paths holds {len(paths)} paths for {len(logits)} rows")
        if not logits:
            return
        if any(fw._head is not self.head for fw in logits):
            raise ValueError("prefetch_rows() takes the TreeLogits of this target's forward_trees()")
        for fw, p in zip(logits, paths):
            for i in p:
                fw._check(int(i))
        choice = logits[0]._projection
        sizes = [fw.n for fw in logits]
        off = sum(1 for n, p in zip(sizes, paths) if n > len(set(p)))
        if isinstance(choice, str):
            every = choice == "all"
        else:
            every = choice.project_all(sum(sizes), sum(len(set(p)) for p in paths), leaving=off)
        want = [list(range(n)) if every else [int(i) for i in dict.fromkeys(p)] for n, p in zip(sizes, paths)]
        want = [[i for i in w if i not in fw._memo] for fw, w in zip(logits, want)]
        if not any(want):
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.head(torch.cat([fw._hidden[w] for fw, w in zip(logits, want)])).to(torch.float32)
        share = (time.perf_counter() - t0) / sum(len(w) for w in want)  # each row's part of one call
        for fw, w, part in zip(logits, want, out.split([len(w) for w in want])):
            fw._store(w, part)
            fw.projection_seconds += share * len(w)

    def commit_rows(self, paths: list[list[int]]) -> None:
        if getattr(self, "_row_tree", None) is None:
            raise RuntimeError("commit_rows() called before forward_trees()")
        if len(paths) != self._rows.batch:
            raise ValueError(f"paths holds {len(paths)} paths for {self._rows.batch} rows")
        checked = []
        for b, (host, p) in enumerate(zip(linears_on_host(self._row_tree), paths)):
            checked.append(check_commit_path(host, p))
            self._row_prefix[b] += len(checked[-1])
        # accepted entries move to the front of the tree's columns, the rest are dropped
        self._rows.commit_paths(self._row_tree_start, checked)
        self._row_tree = None
        self._rows.maybe_compact()

    def keep_rows(self, rows: list[int]) -> None:
        if getattr(self, "_rows", None) is None:
            raise RuntimeError("keep_rows() called before start_rows()")
        if self._row_tree is not None:
            self._rows.drop_tail(self._row_tree_start)
            self._row_tree = None
        self._row_prefix = [self._row_prefix[r] for r in rows]
        if self._row_prompt_features is not None:
            self._row_prompt_features = [self._row_prompt_features[r] for r in rows]
        self._rows.select(rows)

    def memory_estimate(self, batch: int, width: int, tree_len: int) -> int:
        """Bytes a batched decode needs at most: the KV cache of ``batch`` rows ``width``
        columns wide (committed tokens, tree and holes) and one verify forward's largest
        activations (hidden states, the MLP, the attention scores, the logits of
        every node). A rough upper estimate from the model config, to refuse a batch
        that cannot fit before any model work."""
        elem = next(self.model.parameters()).element_size()
        return forward_memory(self.base.config, elem, self.vocab_size, batch, width, tree_len)

    def commit(self, path: list[int]) -> None:
        if self._tree is None:
            raise RuntimeError("commit() called before forward_tree()")
        path = check_commit_path(self._tree, path)
        commit_cache(self.cache, self._prefix, path)
        self._prefix += len(path)
        self._tree = None
        assert cache_length(self.cache) == self._prefix


def _stack_left(parts: list[torch.Tensor | None], back: list[int]) -> torch.Tensor | None:
    """Per-group ``[g, n_i, D]`` tensors as one ``[B, max n_i, D]`` (shorter ones left-padded
    with zeros, as one left-padded forward lays them out), rows taken in the order ``back``."""
    real = [x for x in parts if x is not None]
    if not real:
        return None
    n = max(x.shape[1] for x in real)
    ref = real[0]
    padded = [torch.cat([x.new_zeros(x.shape[0], n - x.shape[1], *x.shape[2:]), x], dim=1) for x in real]
    return torch.cat(padded, dim=0).index_select(0, torch.as_tensor(back, device=ref.device))
