"""The two model interfaces the decode loop talks to (batch 1 per decode).

Before the first step the loop checks the pair (``vocab_size``, ``device``,
``draft.check_vocab_map``, ``draft.check_target``, ``target.max_context``), calls
``target.start_and_root(prompt_ids)``. An adapter whose ``start_and_root`` prefills the
whole prompt hands back the last prompt token's output: the first new token is drawn from
it (step 0, a plain step with no forward of its own: the prompt's forward serves it, as
in ``generate``; no ``commit`` follows, the token before it is cached already), then the
loop calls ``draft.start(prompt_ids + [first token])`` and
``draft.take_prompt_features(target)`` (the target's prompt features then cover every
prompt token). Where ``start_and_root`` returns None the loop calls ``target.start``,
``draft.start(prompt_ids)`` and ``draft.take_prompt_features(target)``, and step 0 is a
tree rooted at the last prompt token. Then a decode step, in the order the loop calls
these methods:

1. ``draft.node_logits(tree, nodes)`` once for the root (``nodes == [0]``), then once
   per depth for the frontier nodes. Every node's ancestors were passed in an earlier
   call of the same step (the root's ancestors are the committed context).
2. ``target.forward_tree(linear)`` runs the root and every kept drafted node in one
   forward with the ancestor mask; it returns a ``TreeLogits``: when its
   ``prefers_all_logits`` says so the walk reads every node from one ``all_logits()``,
   else the loop calls its ``prefetch`` with the most likely path, then the verifier asks
   ``logits(i)`` only at the linear nodes it visits (lazy output projection).
3. ``target.commit(path)`` and ``draft.commit(tree, path_nodes, tokens, features)``
   keep the root and the accepted nodes; the bonus token becomes the next root
   and is *not* cached by either model until the next step.

After the decode the loop calls ``target.close()`` on a target adapter it built itself.
Custom adapters subclass ``TargetModel`` / ``DraftModel`` (the abstract methods are the
ones every adapter needs; the others have defaults).

Batched decoding (``plan_and_decode`` with several prompts) talks to the ``*_rows``
methods instead: ``start_rows_and_roots(prompts)`` (or ``start_rows``), per depth
``draft.node_logits_rows(tree, nodes)`` (one call for every row; ``tree`` holds B trees,
row ``b`` is tree ``b``), ``target.forward_trees(linear)`` (one verify forward for all
rows, one ``TreeLogits`` per row back), ``target.prefetch_rows(logits, paths)`` (every
row's likely walk projected at once), ``commit_rows``, ``keep_rows(rows)`` (rows that
finished leave the batch) and ``add_rows_and_roots(prompts)`` (or ``add_rows``: waiting
prompts join it).
Their defaults run a shallow copy of the adapter per row through the batch-1 methods
(B calls, correct for any adapter whose ``start`` resets all its state); ``HFTarget``,
``HFDraft``, ``Eagle3Draft`` and ``FunctionalDraft`` override them with one call for the
whole batch.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from rheoplan.ir import DraftTree, LinearTree


class TreeLogits(ABC):
    """Result of one verify forward (tree b = 0)."""

    #: wall seconds this result spent turning hidden states into logits (the output
    #: matrix, when an adapter projects on demand): model compute the walk triggers, which
    #: ``generate`` counts inside its forward. The decode loops report it as
    #: ``StepStats.t_project`` (part of ``t_walk``); 0 for adapters whose logits are free.
    projection_seconds: float = 0.0

    @abstractmethod
    def logits(self, i: int) -> torch.Tensor:
        """Raw next-token logits ``[V]`` (float32) at linear node ``i``."""

    def features(self, i: int) -> torch.Tensor | None:
        """Target hidden features at linear node ``i`` for an EAGLE-3 head, or None (default)."""
        return None

    def prefetch(self, nodes: Sequence[int]) -> None:
        """Hint: ``logits`` will likely be asked at linear nodes ``nodes`` (the walk's most
        likely route); an adapter may project them in one batch. Default: nothing."""

    def all_logits(self) -> torch.Tensor:
        """Logits ``[n, V]`` at every real linear node in one projection, on the target's
        device: what the Triton backend's device walk reads (``rheoplan.walk``). Default:
        not available, and that walk falls back to the lazy reference walk."""
        raise NotImplementedError(f"{type(self).__name__}.all_logits")

    def prefers_all_logits(self, path_len: int) -> bool:
        """Whether one ``all_logits()`` call is cheaper for the CPU walk than projecting the
        likely path's ``path_len`` rows (``prefetch``) and then node by node (``logits``);
        both give the same logits up to the rounding of a batched product. Default: False
        (the lazy walk), right for an adapter whose logits cost nothing to read."""
        return False


class _RowCopies:
    """The batch form's row bookkeeping shared by ``TargetModel`` and ``DraftModel``: an
    adapter without batched methods of its own serves a batch as one shallow copy of
    itself per row (``_row_adapters``, set by ``start_rows``)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only rows ``rows`` (in that order); the others leave the batch."""
        have = self._rows_started("keep_rows")
        self._row_adapters = [have[r] for r in rows]

    def add_rows(self, prompts: list[list[int]]) -> None:
        """Rows joining the batch between steps (continuous batching), after the current ones."""
        have = self._rows_started("add_rows")
        new = [copy.copy(self) for _ in prompts]
        for row, ids in zip(new, prompts):
            row._row_adapters = None
            row.start(ids)
        self._row_adapters = have + new

    def _rows_started(self, what: str) -> list:
        rows = getattr(self, "_row_adapters", None)
        if rows is None:
            raise RuntimeError(f"{what}() called before start_rows()")
        return rows


class TargetModel(_RowCopies, ABC):
    """The model whose distribution the decode preserves.

    Subclasses implement ``start``, ``forward_tree`` and ``commit`` and set ``vocab_size``;
    the other members have defaults that fit a model with no device, no context limit and
    nothing to release.
    """

    vocab_size: int
    #: the device the model's tensors live on (the draft must use the same), or None
    device: torch.device | None = None
    #: the longest sequence the model handles (prompt + new tokens + one verify tree), or None
    max_context: int | None = None
    #: whether ``start_rows``, ``start_rows_and_roots``, ``add_rows`` and
    #: ``add_rows_and_roots`` take ``groups=``: the rows to prefill together, one forward
    #: per group (``check_groups``; the batched loop passes ``rheoplan.costmodel.prefill_groups``
    #: when it has a cost model). Adapters that prefill each row alone have no use for it.
    prefills_in_groups: bool = False

    @abstractmethod
    def start(self, prompt_ids: list[int]) -> None:
        """Reset; cache every prompt token except the last (the first root)."""

    def start_and_root(self, prompt_ids: list[int]) -> TreeLogits | None:
        """Reset and cache every prompt token, the last one too, in one forward; return
        that forward's output at the last token as a one-node ``TreeLogits`` (node 0: its
        logits are the law of the first new token), or None, having done nothing, where the
        adapter cannot (default: the loop then calls ``start`` and verifies the last prompt
        token as the first root, one forward more).

        After it the next root (the first new token) sits at position ``len(prompt_ids)``;
        the loop calls no ``commit`` for the served step, and ``prompt_features_for`` (if the
        adapter captures features) covers every prompt token, the last one too."""
        return None

    @abstractmethod
    def forward_tree(self, linear: LinearTree) -> TreeLogits:
        """Verify forward of tree 0 of ``linear`` (root not cached yet)."""

    @abstractmethod
    def commit(self, path: list[int]) -> None:
        """Keep in the cache linear nodes ``path`` (root first, then accepted nodes)."""

    # -- batched decoding (see the module docstring); defaults: one copy per row ----------

    def start_rows(self, prompts: list[list[int]]) -> None:
        """Reset for a batch: row ``b`` caches ``prompts[b]`` but its last token."""
        self._row_adapters = [copy.copy(self) for _ in prompts]
        for row, ids in zip(self._row_adapters, prompts):
            row._row_adapters = None
            row.start(ids)

    def start_rows_and_roots(self, prompts: list[list[int]]) -> list[TreeLogits] | None:
        """``start_and_root`` for a batch: row ``b`` caches all of ``prompts[b]``; one
        one-node ``TreeLogits`` per row back, or None (then the loop calls ``start_rows``).
        Default: one copy per row through ``start_and_root``, where the adapter has one."""
        served = self._served_copies(prompts)
        if served is None:
            return None
        self._row_adapters, out = served
        return out

    def add_rows_and_roots(self, prompts: list[list[int]]) -> list[TreeLogits] | None:
        """``add_rows`` with each new row's whole prompt cached, its last token's output
        back as in ``start_rows_and_roots``, or None, having done nothing (then the loop
        calls ``add_rows``). Default: row copies through ``start_and_root``."""
        have = self._rows_started("add_rows_and_roots")
        served = self._served_copies(prompts)
        if served is None:
            return None
        self._row_adapters = have + served[0]
        return served[1]

    def _served_copies(self, prompts: list[list[int]]) -> tuple[list, list[TreeLogits]] | None:
        """One shallow copy of this adapter per prompt, each started by ``start_and_root``,
        and their served outputs; None where the adapter (or one row) cannot serve."""
        if type(self).start_and_root is TargetModel.start_and_root:
            return None
        copies = [copy.copy(self) for _ in prompts]
        out = []
        for row, ids in zip(copies, prompts):
            row._row_adapters = None
            out.append(row.start_and_root(ids))
        return None if any(o is None for o in out) else (copies, out)

    def forward_trees(self, linear: LinearTree) -> list[TreeLogits]:
        """Verify forward of every tree of ``linear`` (tree ``b`` = row ``b``); one
        ``TreeLogits`` per row. Default: one batch-1 forward per row."""
        rows = self._rows_started("forward_trees")
        if linear.n.shape[0] != len(rows):
            raise ValueError(f"linear holds {linear.n.shape[0]} trees for {len(rows)} rows")
        return [r.forward_tree(_linear_rows(linear, [b])) for b, r in enumerate(rows)]

    def prefetch_rows(self, logits: list[TreeLogits], paths: list[list[int]]) -> None:
        """Hint for a batch: row ``b``'s walk likely visits linear nodes ``paths[b]`` of
        ``logits[b]`` (a ``forward_trees`` result). An adapter whose projection reads the
        whole output matrix per call projects every row's nodes in one call. Default: each
        row's ``prefetch``."""
        if len(logits) != len(paths):
            raise ValueError(f"paths holds {len(paths)} paths for {len(logits)} rows")
        for fw, p in zip(logits, paths):
            fw.prefetch(p)

    def commit_rows(self, paths: list[list[int]]) -> None:
        """Row ``b`` keeps linear nodes ``paths[b]`` of its last verified tree."""
        rows = self._rows_started("commit_rows")
        if len(paths) != len(rows):
            raise ValueError(f"paths holds {len(paths)} paths for {len(rows)} rows")
        for r, p in zip(rows, paths):
            r.commit(p)

    def prompt_features_rows_for(self, model: Any) -> list[torch.Tensor | None]:
        """``prompt_features_for(model)`` of every row (default: each row adapter's)."""
        return [r.prompt_features_for(model) for r in self._rows_started("prompt_features_rows_for")]

    def memory_estimate(self, batch: int, width: int, tree_len: int) -> int | None:
        """Bytes a batched decode of ``batch`` rows needs at most with a cache ``width``
        columns wide and verify trees of ``tree_len`` nodes, or None when the adapter
        cannot tell (default). ``plan_and_decode`` refuses a batch whose estimate exceeds
        the free memory of the target's device before any model work."""
        return None

    def prompt_features_for(self, model: Any) -> torch.Tensor | None:
        """The EAGLE-3 features of the prompt (``[len(prompt) - 1, width]``) when this
        adapter captured them in ``start`` from ``model`` itself, else None (default).
        An EAGLE-3 draft reading its features from ``model`` takes them instead of running
        a second forward over the prompt."""
        return None

    def use_tree_attention(self, enabled: bool = True, allow_tf32: bool = False) -> bool:
        """Run the verify forward's attention through the Triton tree-attention kernel (what the
        "triton" backend asks for); returns whether this adapter now does. Default: it has no
        attention layers to switch (a functional model), so False."""
        return False

    def close(self) -> None:
        """Release what the adapter holds on the model (hooks); default: nothing. The
        decode loop calls it for adapters it built itself."""


class DraftModel(_RowCopies, ABC):
    """The proposal model. Subclasses implement ``start``, ``node_logits`` and ``commit``
    and set ``vocab_size``; the other members have defaults."""

    vocab_size: int
    #: the device the model's tensors live on (must be the target's), or None
    device: torch.device | None = None
    #: target ids of the only tokens the draft can propose, strictly increasing (e.g. an
    #: EAGLE-3 head's reduced vocabulary), or None (any token). When set, the decode loop
    #: calls ``vocab_logits`` and the planner works on these columns
    #: (``rheoplan.distributions.SubsetLogits``): the same draft law, without the zeros.
    vocab_ids: torch.Tensor | None = None

    @abstractmethod
    def start(self, prompt_ids: list[int]) -> None:
        """Reset; the last prompt token is the first root."""

    @abstractmethod
    def node_logits(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """Draft next-token logits ``[len(nodes), V]`` (target vocabulary ids; tokens the
        draft cannot propose get ``-inf``) at nodes of tree 0."""

    def vocab_logits(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """``node_logits`` at the columns ``vocab_ids`` only, ``[len(nodes), len(vocab_ids)]``
        (what the decode loop asks for when ``vocab_ids`` is set). Default: the columns
        taken from ``node_logits``; a draft that computes them directly saves the scatter."""
        out = self.node_logits(tree, nodes)
        return out if self.vocab_ids is None else out[:, self.vocab_ids.to(out.device)]

    @abstractmethod
    def commit(self, tree: DraftTree, path_nodes: list[int], emitted: list[int],
               features: list[torch.Tensor | None]) -> None:
        """The step accepted creation ids ``path_nodes`` (root first) and emitted
        ``emitted`` (accepted drafted tokens then the bonus token). ``features`` holds the
        target's features at the root and each accepted node, for heads that need them."""

    # -- batched decoding (see the module docstring); defaults: one copy per row ----------

    def start_rows(self, prompts: list[list[int]]) -> None:
        """Reset for a batch: row ``b``'s root is the last token of ``prompts[b]``."""
        self._row_adapters = [copy.copy(self) for _ in prompts]
        for row, ids in zip(self._row_adapters, prompts):
            row._row_adapters = None
            row.start(ids)

    def take_prompt_features_rows(self, target: TargetModel, rows: list[int] | None = None) -> None:
        """``take_prompt_features`` for rows ``rows`` (default: every row), from the batched
        ``target``. Default: each row copy takes its row's features; nothing for an adapter
        with its own ``start_rows``."""
        have = getattr(self, "_row_adapters", None)
        if have is None:
            return
        feats = target.prompt_features_rows_for(getattr(self, "features_from", None))
        for b in range(len(have)) if rows is None else rows:
            have[b].take_prompt_features(_Features(feats[b]))

    def node_logits_rows(self, tree: DraftTree, nodes: list[list[int]]) -> list[torch.Tensor]:
        """Draft logits ``[len(nodes[b]), V]`` at nodes ``nodes[b]`` of tree ``b``, for every
        row (a row with no nodes gets ``[0, V]``). Default: one batch-1 call per row."""
        rows = self._rows_started("node_logits_rows")
        out = []
        for b, (row, nb) in enumerate(zip(rows, nodes)):
            out.append(row.node_logits(tree.rows([b]), nb) if nb else
                       torch.zeros(0, self.vocab_size, device=self.device))
        return out

    def vocab_logits_rows(self, tree: DraftTree, nodes: list[list[int]]) -> list[torch.Tensor]:
        """``node_logits_rows`` at the columns ``vocab_ids`` only (what the batched loop asks
        for when ``vocab_ids`` is set). Default: the columns taken from ``node_logits_rows``."""
        out = self.node_logits_rows(tree, nodes)
        if self.vocab_ids is None:
            return out
        return [o[:, self.vocab_ids.to(o.device)] for o in out]

    def commit_rows(self, tree: DraftTree, path_nodes: list[list[int]], emitted: list[list[int]],
                    features: list[list[torch.Tensor | None]]) -> None:
        """``commit`` of every row (tree ``b`` of ``tree``)."""
        rows = self._rows_started("commit_rows")
        for b, row in enumerate(rows):
            row.commit(tree.rows([b]), path_nodes[b], emitted[b], features[b])

    def memory_estimate(self, batch: int, width: int, tree_len: int) -> int | None:
        """Bytes the draft needs at most in a batched decode (as
        ``TargetModel.memory_estimate``), or None when it cannot tell (default);
        ``plan_and_decode`` adds it to the target's estimate."""
        return None

    def check_vocab_map(self, target_vocab_size: int) -> None:
        """Raise ``ValueError`` if the draft's own vocabulary map (e.g. an EAGLE-3 head's
        draft-to-target ids) does not fit a target of ``target_vocab_size`` tokens.
        Default: nothing to check."""

    def check_target(self, target: TargetModel) -> None:
        """Raise ``ValueError`` if the draft cannot draft for ``target`` (e.g. an EAGLE-3 head
        trained for another feature width or layer count). Called before any model work.
        Default: nothing to check."""

    def take_prompt_features(self, target: TargetModel) -> None:
        """Called once after both models' ``start``: a draft that needs the target's
        features of the prompt may take them from ``target`` here
        (``target.prompt_features_for``). Default: nothing."""

    def close(self) -> None:
        """Release what the adapter holds; default: nothing."""


def _linear_rows(linear: LinearTree, rows: list[int]) -> LinearTree:
    """Trees ``rows`` of a ``LinearTree`` as a batch of their own."""
    idx = torch.as_tensor(rows, dtype=torch.int64, device=linear.n.device)
    return LinearTree(**{f.name: getattr(linear, f.name).index_select(0, idx) for f in fields(linear)})


class _Features(TargetModel):
    """What a row copy of a draft sees of a batched target in ``take_prompt_features``:
    only its row's prompt features."""

    vocab_size = 0

    def __init__(self, features: torch.Tensor | None) -> None:
        self._f = features

    def prompt_features_for(self, model: Any) -> torch.Tensor | None:
        return self._f

    def start(self, prompt_ids):  # pragma: no cover - never decoded
        raise NotImplementedError

    def forward_tree(self, linear):  # pragma: no cover
        raise NotImplementedError

    def commit(self, path):  # pragma: no cover
        raise NotImplementedError


# -- argument checks shared by every adapter ----------------------------------------------


def check_prompt_ids(prompt_ids, vocab_size: int) -> list[int]:
    """``prompt_ids`` as a list of ints; non-empty and inside ``[0, vocab_size)``."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty: at least one token is needed (it becomes the root)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids holds token ids {bad[:5]} outside [0, {vocab_size})")
    return ids


def check_groups(groups, batch: int) -> list[list[int]]:
    """``groups`` (rows prefilled together, ``TargetModel.prefills_in_groups``) as lists of
    ints: every row index in ``[0, batch)`` exactly once, no group empty."""
    out = [[int(i) for i in g] for g in groups]
    seen = sorted(i for g in out for i in g)
    if any(not g for g in out) or seen != list(range(batch)):
        raise ValueError(f"groups={groups!r}: allowed non-empty groups that hold every row index in "
                         f"[0, {batch}) exactly once")
    return out


def check_draft_call(tree: DraftTree, nodes, root: int | None, committed: int | None,
                     host: "HostDraft | None" = None) -> list[int]:
    """Validate a ``node_logits`` call against the draft's state: the tree's root token and
    prefix length must be the draft's, and the nodes must exist. Returns the nodes as ints.
    ``committed=None`` skips the prefix check (models that keep no cache). ``host``: the
    tree as already read on the host (``draft_on_host``), so the check reads nothing more."""
    if root is None:
        raise RuntimeError("node_logits() called before start()")
    if host is None:
        root_tok, prefix, n_created = int(tree.token[0, 0]), int(tree.prefix_len[0]), int(tree.n_nodes[0])
    else:
        root_tok, prefix, n_created = host.token[0], host.prefix_len, host.n_nodes
    if root_tok != root:
        raise ValueError(f"tree root token {root_tok} differs from the draft's root "
                         f"{root}; was commit() called after the last step?")
    if committed is not None and prefix != committed:
        raise ValueError(f"tree.prefix_len[0]={prefix} but the draft has "
                         f"{committed} committed tokens before the root")
    nodes = host.nodes if host is not None else [int(v) for v in nodes]
    bad = [v for v in nodes if not 0 <= v < n_created]
    if bad:
        raise ValueError(f"nodes {bad} are outside the tree's created nodes [0, {n_created})")
    return nodes


def check_emitted(tree: DraftTree, path_nodes: list[int], emitted: list[int], b: int = 0,
                  host: HostDraft | None = None) -> list[int]:
    """Validate ``DraftModel.commit`` arguments for tree ``b`` (default 0; a batched
    ``commit_rows`` checks each row's own); return the path's creation ids as ints.
    ``host``: tree ``b`` as already read (``drafts_on_host``); None reads it here."""
    if host is None:
        host = draft_on_host(tree, [], b)  # one transfer for every check below
    path_nodes = [int(v) for v in path_nodes]
    n = host.n_nodes
    if not path_nodes or path_nodes[0] != 0:
        raise ValueError(f"path_nodes={path_nodes} must start with the root (node 0)")
    for a, c in zip(path_nodes, path_nodes[1:]):
        if not 0 < c < n or host.parent[c] != a:
            raise ValueError(f"path_nodes={path_nodes}: node {c} is not a created child of {a}")
    if len(emitted) != len(path_nodes):
        raise ValueError(f"emitted has {len(emitted)} tokens, expected len(path_nodes)="
                         f"{len(path_nodes)} (accepted drafted tokens then the bonus token)")
    accepted = [host.token[v] for v in path_nodes[1:]]
    if accepted != [int(t) for t in emitted[:-1]]:
        raise ValueError(f"emitted[:-1]={list(emitted[:-1])} differs from the tokens of "
                         f"path_nodes[1:]={accepted}")
    return path_nodes


def check_device_path(path_nodes: list[int], emitted: list[int]) -> list[int]:
    """``check_emitted`` for a step planned on the device: what the host knows without
    reading the tree back (the path and tokens are the walk's own, transferred once by the
    decode loop): the path starts at the root and holds one node per emitted token."""
    path_nodes = [int(v) for v in path_nodes]
    if not path_nodes or path_nodes[0] != 0 or len(emitted) != len(path_nodes):
        raise ValueError(f"path_nodes={path_nodes} must start with the root (node 0) and match "
                         f"emitted ({len(emitted)} tokens: accepted drafted tokens, then the bonus)")
    return path_nodes


# -- what an adapter reads of a tree on the host: one transfer each -------------------------


@dataclass(frozen=True)
class HostTree:
    """Tree 0 of a ``LinearTree`` as an adapter reads it on the host (``linear_on_host``)."""

    n: int  #: real linear nodes (root included)
    position0: int  #: the root's position (= the committed prefix length)
    token: list[int]  #: tokens of the ``n`` real nodes
    parent: list[int]  #: their parents' linear indices (-1 for the root)

    def path(self, i: int) -> list[int]:
        """Linear indices from the root to node ``i`` (both included).

        Example: parents ``[-1, 0, 0, 1]`` and ``i = 3`` -> ``[0, 1, 3]``.
        """
        out = []
        while i >= 0:
            out.append(i)
            i = self.parent[i]
        return out[::-1]


def linear_on_host(linear: LinearTree, b: int = 0) -> HostTree:
    """``n``, the root's position, the tokens and the parents of tree ``b`` (default 0) in
    one device-to-host transfer (a target reads them once per verify forward, not per node)."""
    L = linear.token.shape[1]
    flat = torch.cat([linear.n[b:b + 1], linear.position[b, :1], linear.token[b], linear.parent[b]]).tolist()
    n = int(flat[0])
    return HostTree(n, int(flat[1]), flat[2:2 + n], flat[2 + L:2 + L + n])


def linears_on_host(linear: LinearTree) -> list[HostTree]:
    """``linear_on_host`` of every tree of ``linear`` in one device-to-host transfer (a
    batched target's commit reads all its rows; one read per row cost ~20 us each, a third
    of a millisecond per step at 16 rows on the 2-core CPU)."""
    L = linear.token.shape[1]
    flat = torch.cat([linear.n[:, None], linear.position[:, :1], linear.token, linear.parent], dim=1).tolist()
    return [HostTree(r[0], r[1], r[2:2 + r[0]], r[2 + L:2 + L + r[0]]) for r in flat]


def check_commit_path(tree: HostTree | LinearTree, path: Sequence[int]) -> list[int]:
    """Validate a committed path of linear indices: root first, each the child of the last.
    Read from a ``HostTree`` it costs no device transfer."""
    host = tree if isinstance(tree, HostTree) else linear_on_host(tree)
    path = [int(i) for i in path]
    n = host.n
    if not path or path[0] != 0:
        raise ValueError(f"path={path} must start with the root (linear index 0)")
    for a, c in zip(path, path[1:]):
        if not 0 < c < n:
            raise ValueError(f"path={path}: linear index {c} is outside [1, {n})")
        if host.parent[c] != a:
            raise ValueError(f"path={path}: node {c} is not a child of {a} "
                             f"(its parent is {host.parent[c]})")
    return path


@dataclass(frozen=True)
class HostDraft:
    """Tree 0 of a ``DraftTree`` and a draft call's nodes as read on the host (``draft_on_host``)."""

    n_nodes: int  #: nodes created so far (root included)
    prefix_len: int  #: committed tokens before the root
    token: list[int]  #: tokens of the created nodes
    parent: list[int]  #: their parents' creation ids (-1 for the root)
    nodes: list[int]  #: the call's node ids

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's child down to ``node`` (``DraftTree.path_tokens``)."""
        out = []
        while node > 0:
            out.append(self.token[node])
            node = self.parent[node]
        return out[::-1]


def draft_on_host(tree: DraftTree, nodes, b: int = 0) -> HostDraft:
    """What a draft whose model runs on the host reads of tree ``b`` (default 0) of ``tree``
    for one ``node_logits`` call, in one device-to-host transfer (nodes given as a tensor
    travel with it)."""
    M = tree.token.shape[1]
    nodes_t = torch.as_tensor(nodes, dtype=torch.int64).to(tree.token.device).reshape(-1)
    flat = torch.cat([tree.n_nodes[b:b + 1], tree.prefix_len[b:b + 1], tree.token[b], tree.parent[b],
                      nodes_t]).tolist()
    n = int(flat[0])
    return HostDraft(n, int(flat[1]), flat[2:2 + n], flat[2 + M:2 + M + n], flat[2 + 2 * M:])


def drafts_on_host(tree: DraftTree) -> list[HostDraft]:
    """``draft_on_host(tree, [], b)`` of every tree ``b`` in one device-to-host transfer
    (a batched draft's commit checks every row's path)."""
    M = tree.token.shape[1]
    flat = torch.cat([tree.n_nodes[:, None], tree.prefix_len[:, None], tree.token, tree.parent], dim=1).tolist()
    return [HostDraft(r[0], r[1], r[2:2 + r[0]], r[2 + M:2 + M + r[0]], []) for r in flat]
