"""The draft-tree IR: one struct of arrays for B trees, and its linearised form.

Every pass (``planner/*.py``) takes a ``DraftTree`` and returns a new one; nothing
here is mutated in place by a pass. Node ids are *creation order*: the root is 0,
then children in the order they were created (depth by depth; within a depth the
parents in frontier order, best first; within a parent DET by rank, SAMPLED, PAD
by rank). Creation order therefore is also the final tie-breaker of the ranking
"higher score, then shallower, then created earlier" (docs/method.md §3): since
creation is depth-major, ``(-score, node_id)`` sorts exactly by that rule.

Shapes: ``B`` trees, ``M`` node capacity, ``E`` expanded-node capacity, ``S``
sparse support. Unused entries hold -1 (ints), 0 (floats) or False.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum

import numpy as np
import torch


class NodeKind(IntEnum):
    """The four kinds of node. This is the only place they are defined."""

    #: The last emitted token. Its KV is not cached yet; it is never pruned.
    ROOT = 0
    #: One of the ``m`` top-ranked draft tokens of its parent; weight = its q.
    DET = 1
    #: The one child drawn from the parent's tail law q~ (ranks m+1..S);
    #: weight = the proxy score pi, which does not depend on the drawn token.
    SAMPLED = 2
    #: Fills the remaining slots: best tail tokens other than the sampled one; weight = q.
    PAD = 3


@dataclass(frozen=True)
class LinearTree:
    """What the verify forward and the verifier need, in linear order (root = 0).

    Order is depth-major BFS over kept nodes: by depth, then by creation id. This is
    topological (parents before children) and identical to sorting by node id,
    because ids are assigned depth by depth.

    Shapes: ``B`` trees, ``L`` = 1 + budget linear slots, ``W`` = ceil(L / 64)
    words. Trees with fewer kept nodes are padded (``n`` says how many are real).
    """

    n: torch.Tensor  #: [B] int64, number of real linear nodes (root included)
    node: torch.Tensor  #: [B, L] int64, creation id of each linear node
    token: torch.Tensor  #: [B, L] int64
    position: torch.Tensor  #: [B, L] int64, prefix_len + depth
    parent: torch.Tensor  #: [B, L] int64, linear index of the parent (-1 for root)
    depth: torch.Tensor  #: [B, L] int64
    ancestor_mask: torch.Tensor  #: [B, L, L] bool: row i attends to j (j ancestor of i or i itself)
    ancestor_bits: torch.Tensor  #: [B, L, W] int64 bit-words of ancestor_mask (bit j%64 of word j//64)
    paths: torch.Tensor  #: [B, P, D+1] int64 root-to-leaf paths of linear indices, -1 padded
    n_paths: torch.Tensor  #: [B] int64
    first_child: torch.Tensor  #: [B, L] int64, linear index of the first kept child or -1
    n_children: torch.Tensor  #: [B, L] int64, number of kept children
    exp_row: torch.Tensor  #: [B, L] int64, row in the DraftTree expansion tables or -1


@dataclass(frozen=True)
class DraftTree:
    """B draft trees as a struct of arrays (see the module docstring for ids)."""

    # -- per tree -----------------------------------------------------------------
    prefix_len: torch.Tensor  #: [B] int64, cached tokens before the root
    n_nodes: torch.Tensor  #: [B] int64, nodes created so far (root included)
    n_expanded: torch.Tensor  #: [B] int64, rows used in the expansion tables
    cur_depth: int  #: deepest level created so far (0 = only the root)
    rheostat: int  #: m actually used (slots when greedy)
    slots: int  #: K

    # -- per node [B, M] ---------------------------------------------------------------
    parent: torch.Tensor  #: int64, node id of the parent, -1 for root / unused
    depth: torch.Tensor  #: int64, 0 for root
    token: torch.Tensor  #: int64, -1 for unused
    kind: torch.Tensor  #: int8, a NodeKind, -1 for unused
    slot: torch.Tensor  #: int64, slot index 0..K-1 in the parent's expansion, -1 for root
    q: torch.Tensor  #: float32, true draft probability of token under the parent's q
    weight: torch.Tensor  #: float32, shaping weight (q, or the proxy for SAMPLED)
    score: torch.Tensor  #: float32, cumulative log weight; 0 for root
    expanded: torch.Tensor  #: bool, has an expansion row (children were created)
    kept: torch.Tensor  #: bool, survives global pruning (root always)
    exp_row: torch.Tensor  #: int64, row in the expansion tables, -1 if not expanded

    # -- per expanded node [B, E] / [B, E, S] ---------------------------------------------
    exp_node: torch.Tensor  #: [B, E] int64, node id of the expanded node
    sup_token: torch.Tensor  #: [B, E, S] int64, sparse support ranked by q desc (ties: lower id)
    sup_q: torch.Tensor  #: [B, E, S] float32, draft q of each support token
    sup_n: torch.Tensor  #: [B, E] int64, valid support entries (min(S, V))
    z: torch.Tensor  #: [B, E] float32, tail mass: sum of sup_q over ranks m+1..sup_n
    y_token: torch.Tensor  #: [B, E] int64, realised sampled token (-1: no sampled slot / not drawn yet)
    y_qtilde: torch.Tensor  #: [B, E] float32, q~(Y), its tail-law probability
    y_node: torch.Tensor  #: [B, E] int64, node id of the sampled child (-1 if none)

    # -- filled by linearize --------------------------------------------------------------
    linear: LinearTree | None = field(default=None)
    #: S' = min(support, V), the valid support entries of every expansion row (0 before the
    #: first expand). A host-side int: the device planner slices by it without asking the device.
    sup_width: int = 0

    # ---------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.parent.shape[0]

    @property
    def capacity(self) -> int:
        return self.parent.shape[1]

    def replace(self, **changes) -> "DraftTree":
        """A new tree with ``changes`` (field name -> value), sharing every other field.

        ``dataclasses.replace`` without its per-field ``__init__`` (9 us for these 27
        fields, and every pass calls it): the class validates nothing on construction, so
        copying the instance's fields builds what ``__init__`` would."""
        known = self.__dataclass_fields__
        unknown = changes.keys() - known.keys()
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}: allowed {sorted(known)}")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def clone(self) -> "DraftTree":
        """Deep copy of every tensor (passes clone what they change, then edit the clone)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.clone() if isinstance(v, torch.Tensor) else v
        return DraftTree(**out)

    def to(self, device: torch.device | str) -> "DraftTree":
        """The same tree with every tensor (the linear form's too) on ``device``: the tree
        itself when they all are there already (the CPU walk asks every step)."""
        dev = torch.device(device)
        values = list(self.__dict__.values())
        if self.linear is not None:
            values += self.linear.__dict__.values()
        if all(v.device == dev for v in values if isinstance(v, torch.Tensor)):
            return self
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.to(device)
            elif isinstance(v, LinearTree):
                v = LinearTree(**{g.name: getattr(v, g.name).to(device) for g in fields(v)})
            out[f.name] = v
        return DraftTree(**out)

    def rows(self, rows) -> "DraftTree":
        """Trees ``rows`` of the batch (in that order) as a batch of their own, the linear
        form included: what a batch-1 adapter sees of row ``b`` is ``tree.rows([b])``.

        Example: ``tree.rows([2]).token[0]`` is ``tree.token[2]``.
        """
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=self.parent.device)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.index_select(0, idx)
            elif isinstance(v, LinearTree):
                v = LinearTree(**{g.name: getattr(v, g.name).index_select(0, idx.to(getattr(v, g.name).device))
                                  for g in fields(v)})
            out[f.name] = v
        return DraftTree(**out)

    def children(self, b: int, node: int) -> list[int]:
        """Node ids of all created children of ``node`` in tree ``b`` (kept or not)."""
        n = int(self.n_nodes[b])
        return [int(i) for i in torch.nonzero(self.parent[b, :n] == node).flatten()]

    def path_tokens(self, b: int, node: int) -> list[int]:
        """Tokens from the root's child down to ``node`` (root token excluded)."""
        out = []
        while node > 0:
            out.append(int(self.token[b, node]))
            node = int(self.parent[b, node])
        return out[::-1]


#: the last few root-only templates by shape (``empty_tree`` clones one instead of
#: building 25 tensors and writing the root into each: a decode plans one tree per step)
_TEMPLATES: dict[tuple, "DraftTree"] = {}


def _root_template(B: int, M: int, E: int, S: int, rheostat: int, slots: int, dev: torch.device) -> DraftTree:
    """A root-only tree of this shape with root token -1 and prefix 0 (never handed out:
    ``empty_tree`` clones it)."""
    key = (B, M, E, S, rheostat, slots, str(dev))
    t = _TEMPLATES.get(key)
    if t is not None:
        return t
    ilong = lambda *s: torch.full(s, -1, dtype=torch.int64, device=dev)  # noqa: E731
    f32 = lambda *s: torch.zeros(s, dtype=torch.float32, device=dev)  # noqa: E731
    t = DraftTree(
        prefix_len=torch.zeros(B, dtype=torch.int64, device=dev),
        n_nodes=torch.ones(B, dtype=torch.int64, device=dev),
        n_expanded=torch.zeros(B, dtype=torch.int64, device=dev),
        cur_depth=0,
        rheostat=rheostat,
        slots=slots,
        parent=ilong(B, M),
        depth=ilong(B, M),
        token=ilong(B, M),
        kind=torch.full((B, M), -1, dtype=torch.int8, device=dev),
        slot=ilong(B, M),
        q=f32(B, M),
        weight=f32(B, M),
        score=f32(B, M),
        expanded=torch.zeros(B, M, dtype=torch.bool, device=dev),
        kept=torch.zeros(B, M, dtype=torch.bool, device=dev),
        exp_row=ilong(B, M),
        exp_node=ilong(B, E),
        sup_token=ilong(B, E, S),
        sup_q=f32(B, E, S),
        sup_n=torch.zeros(B, E, dtype=torch.int64, device=dev),
        z=f32(B, E),
        y_token=ilong(B, E),
        y_qtilde=f32(B, E),
        y_node=ilong(B, E),
    )
    t.depth[:, 0] = 0
    t.kind[:, 0] = int(NodeKind.ROOT)
    t.q[:, 0] = 1.0
    t.weight[:, 0] = 1.0
    t.kept[:, 0] = True
    if len(_TEMPLATES) >= 8:  # a few shapes at a time (batch sizes of a continuous batch)
        _TEMPLATES.pop(next(iter(_TEMPLATES)))
    _TEMPLATES[key] = t
    return t


#: per CPU template: its tables packed by dtype, ``[(buffer, [(name, start, end, shape)])]``
_PACKS: dict[tuple, list[tuple[np.ndarray, list[tuple[str, int, int, tuple[int, ...]]]]]] = {}


def _host_pack(B: int, M: int, E: int, S: int, rheostat: int, slots: int):
    """The CPU root-only template's tables as one flat numpy buffer per dtype."""
    key = (B, M, E, S, rheostat, slots)
    pack = _PACKS.get(key)
    if pack is not None:
        return pack
    tpl = _root_template(B, M, E, S, rheostat, slots, torch.device("cpu"))
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, v in tpl.__dict__.items():
        if isinstance(v, torch.Tensor):
            by_dtype.setdefault(v.dtype, []).append(name)
    pack = []
    for names in by_dtype.values():
        arrays = [getattr(tpl, n).numpy().reshape(-1) for n in names]
        ends = np.cumsum([a.size for a in arrays]).tolist()
        pack.append((np.concatenate(arrays), [(n, e - a.size, e, tuple(getattr(tpl, n).shape))
                                              for n, a, e in zip(names, arrays, ends)]))
    if len(_PACKS) >= 8:
        _PACKS.pop(next(iter(_PACKS)))
    _PACKS[key] = pack
    return pack


def _host_tables(B: int, M: int, E: int, S: int, rheostat: int, slots: int):
    """A root-only CPU tree's fields (fresh tables, ``_host_pack``'s buffers copied), their
    numpy views, and ``(buffer, template buffer)`` pairs to reset them from."""
    tpl = _root_template(B, M, E, S, rheostat, slots, torch.device("cpu"))
    fields_ = dict(tpl.__dict__)
    views: dict[str, np.ndarray] = {}
    bufs = []
    for buf, spans in _host_pack(B, M, E, S, rheostat, slots):
        fresh = buf.copy()
        bufs.append((fresh, buf))
        for name, start, end, shape in spans:
            views[name] = a = fresh[start:end].reshape(shape)
            fields_[name] = torch.from_numpy(a)
    return fields_, views, bufs


def _host_root(fields_: dict, views: dict[str, np.ndarray], root_tokens: torch.Tensor,
               prefix_len: torch.Tensor) -> "DraftTree":
    """A new tree object over ``fields_`` (an empty tree's tables) with its roots and prefix."""
    views["prefix_len"][:] = prefix_len.to(device="cpu", dtype=torch.int64).numpy()
    views["token"][:, 0] = root_tokens.to(device="cpu", dtype=torch.int64).numpy()
    t = object.__new__(DraftTree)  # as DraftTree.replace: the fields as built, no __init__
    t.__dict__.update(fields_)
    return t


def empty_host_tree(batch: int, capacity: int, max_expanded: int, support: int, root_tokens: torch.Tensor,
                    prefix_len: torch.Tensor, rheostat: int, slots: int) -> tuple["DraftTree", dict[str, np.ndarray]]:
    """``empty_tree`` on the CPU (the same tables), and numpy views of its tables (field
    name -> an array over that tensor's memory).

    A run that owns its tree and writes it in place (``PassContext.in_place``: the fused
    plan of ``rheoplan.kernels.plan.cpu_pipeline``) hands these views to its kernels
    instead of calling ``.numpy()`` on some thirty tensors a depth: ~2 us each in a decode,
    where the interpreter comes back to them cold after each forward. The views stay valid
    while the tree's fields are these tensors (an in-place pass keeps them; a copying pass
    or ``replace`` with a new table does not). The tables of one dtype share one buffer:
    one copy of the template's per dtype instead of one clone per table."""
    fields_, views, _ = _host_tables(batch, capacity, max_expanded, support, rheostat, slots)
    return _host_root(fields_, views, root_tokens, prefix_len), views


class HostTreeArena:
    """The tables of one caller's host trees, reused: each ``tree`` call resets the same
    buffers to an empty tree's (one copy per dtype) and returns a new tree object over
    them with their numpy views, where ``empty_host_tree`` would make some twenty tensors
    and views again (~0.1 ms of a decode step's plan on the 2-core Zen 4 EPYC).

    So a tree it handed out is overwritten by the next ``tree`` call: for a caller that is
    done with each tree before it plans the next (the decode loop, whose step verifies,
    walks and commits its tree before the next step plans). Each decode owns its own
    arena; two decodes never share one."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._tables: tuple | None = None

    def tree(self, batch: int, capacity: int, max_expanded: int, support: int, root_tokens: torch.Tensor,
             prefix_len: torch.Tensor, rheostat: int, slots: int) -> tuple["DraftTree", dict[str, np.ndarray]]:
        """``empty_host_tree(...)``'s tree and views, over this arena's tables."""
        key = (batch, capacity, max_expanded, support, rheostat, slots)
        if key != self._key:
            self._key, self._tables = key, _host_tables(*key)
        else:
            for fresh, tpl in self._tables[2]:
                np.copyto(fresh, tpl)
        fields_, views, _ = self._tables
        return _host_root(fields_, views, root_tokens, prefix_len), views


def host_table(tree: "DraftTree", name: str, views: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The numpy view of CPU tree ``tree``'s table ``name``: from ``views``
    (``empty_host_tree``) when the caller has them, else ``.numpy()``."""
    return views[name] if views is not None else getattr(tree, name).numpy()


def empty_tree(batch: int, capacity: int, max_expanded: int, support: int,
               root_tokens: torch.Tensor, prefix_len: torch.Tensor,
               rheostat: int, slots: int, device: torch.device | str | None = None) -> DraftTree:
    """A tree holding only its root (node 0, depth 0, score 0, kept), on ``device``
    (default CPU; the Triton planner keeps its trees on the target's device): fresh
    tensors, cloned from a cached root-only tree of the same shape."""
    dev = torch.device(device if device is not None else "cpu")
    tpl = _root_template(batch, capacity, max_expanded, support, rheostat, slots, dev)
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in tpl.__dict__.items()}
    out["prefix_len"] = prefix_len.to(device=dev, dtype=torch.int64).clone()
    t = object.__new__(DraftTree)  # as DraftTree.replace: the fields as built, no __init__
    t.__dict__.update(out)
    t.token[:, 0] = root_tokens.to(device=dev, dtype=torch.int64)
    return t


def rank_key_order(score: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Order of ``ids`` by the global ranking: higher score first, then lower id.

    Lower id means shallower or created earlier (ids are depth-major), which is the
    tie rule of docs/method.md §3. ``-inf`` scores sort last, ties among them by id.

    Example: scores [-1, -0.5, -1] for ids [4, 5, 6] -> order [1, 0, 2] (ids 5, 4, 6).
    """
    # Stable sort by id first, then stable sort by descending score keeps id order on ties.
    by_id = torch.argsort(ids, stable=True)
    by_score = torch.argsort(-score[by_id].to(torch.float64), stable=True)
    return by_id[by_score]
