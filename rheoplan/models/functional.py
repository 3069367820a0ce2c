"""Models that are pure functions of the full token path, for tests and exact oracles.

A ``FunctionalLM`` maps whole contexts (prompt + emitted + drafted path, up to and
including the token whose next-token distribution is wanted) to logits. Because the
function sees the whole path, context matters at every depth of a draft tree, which is
what the exact oracle of docs/method.md §7 needs. ``FunctionalTarget`` and
``FunctionalDraft`` adapt one to the ``TargetModel`` / ``DraftModel`` interfaces.

Example:
    >>> lm = hashed_context_lm(vocab_size=5, seed=3)
    >>> lm([(1, 2), (1, 2, 4)]).shape
    torch.Size([2, 5])
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Callable, Sequence

import torch

from rheoplan.ir import DraftTree, LinearTree
from rheoplan.models.base import (DraftModel, HostTree, TargetModel, TreeLogits,  # noqa: F401
                                  check_commit_path, check_draft_call, check_emitted, check_prompt_ids,
                                  draft_on_host, linear_on_host)

Path = tuple[int, ...]
LogitsFn = Callable[[list[Path]], torch.Tensor]

STYLES = ("gauss", "flat", "near_onehot", "ties", "neg_inf", "mixed")


class FunctionalLM:
    """A language model given as ``fn(paths) -> logits [len(paths), vocab_size]``.

    Example:
        >>> lm = FunctionalLM(lambda paths: torch.zeros(len(paths), 3), vocab_size=3)
        >>> lm([(0,), (0, 1)]).shape
        torch.Size([2, 3])
    """

    def __init__(self, fn: LogitsFn, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} is out of range: allowed int >= 1")
        self.fn = fn
        self.vocab_size = vocab_size
        self.n_calls = 0  #: paths evaluated so far (tests use it to check laziness)

    def __call__(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        paths = [tuple(int(t) for t in p) for p in paths]
        for p in paths:
            if len(p) == 0:
                raise ValueError("a path must hold at least one token (the one whose next-token "
                                 "distribution is wanted), got an empty path")
        out = self.fn(paths)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(paths), self.vocab_size):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"fn returned {got}, expected a tensor of shape "
                             f"({len(paths)}, {self.vocab_size})")
        self.n_calls += len(paths)
        return out.to(torch.float32)


# --------------------------------------------------------------------------------------
# The hashed-context factory
# --------------------------------------------------------------------------------------

def _path_seed(seed: int, path: Path) -> int:
    """A 63-bit seed from ``(seed, path)``; stable across processes (no Python ``hash``)."""
    h = hashlib.blake2b(struct.pack(f"<q{len(path)}q", seed, *path), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _one_logits(vocab_size: int, seed: int, path: Path, sharpness: float, style: str,
                tie_levels: int, neg_inf_frac: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(_path_seed(seed, path))
    if style == "mixed":
        # The style of each context is itself a function of the context, so one model mixes
        # all the awkward cases at different depths of the same tree.
        style = ("gauss", "flat", "near_onehot", "ties", "neg_inf")[
            int(torch.randint(0, 5, (1,), generator=g))]
    x = torch.randn(vocab_size, generator=g, dtype=torch.float64) * sharpness
    if style == "flat":
        x = torch.zeros(vocab_size, dtype=torch.float64)
    elif style == "near_onehot":
        # One token gets almost all the mass; the others keep distinct tiny probabilities.
        x = x * 0.1
        x[int(torch.randint(0, vocab_size, (1,), generator=g))] += 30.0
    elif style == "ties":
        x = torch.round(x * max(tie_levels, 1) / 3.0)
    elif style == "neg_inf":
        drop = torch.rand(vocab_size, generator=g) < max(neg_inf_frac, 0.3)
        drop[int(torch.argmax(x))] = False  # keep at least one finite logit
        x[drop] = float("-inf")
    if style == "gauss":
        if tie_levels > 0:
            x = torch.round(x * tie_levels / 3.0)
        if neg_inf_frac > 0:
            drop = torch.rand(vocab_size, generator=g) < neg_inf_frac
            drop[int(torch.argmax(x))] = False
            x[drop] = float("-inf")
    return x.to(torch.float32)


def hashed_context_lm(vocab_size: int, seed: int = 0, sharpness: float = 1.0, *,
                      style: str = "gauss", tie_levels: int = 0, neg_inf_frac: float = 0.0,
                      memo: int = 1 << 16) -> FunctionalLM:
    """A deterministic pseudo-random LM: logits are a function of a hash of the whole path.

    Args:
        vocab_size: V >= 1.
        seed: selects the model; two seeds give unrelated models (use one for the target,
            another for the draft).
        sharpness: scale of the Gaussian logits; large -> peaked, 0 -> flat.
        style: 'gauss' (default), 'flat' (all logits 0), 'near_onehot' (one token holds
            almost all mass), 'ties' (logits rounded so several tokens tie), 'neg_inf'
            (about 30 % or ``neg_inf_frac`` of the entries are -inf), or 'mixed' (each
            context picks one of those from its own hash).
        tie_levels: with 'gauss', round logits to steps of ``3 / tie_levels`` (0 = off).
        neg_inf_frac: with 'gauss', probability that an entry is -inf (the argmax never is).
        memo: contexts remembered (oracles revisit the same paths many times).

    Example:
        >>> lm = hashed_context_lm(4, seed=1, style="flat")
        >>> lm([(0, 1)])
        tensor([[0., 0., 0., 0.]])
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} is out of range: allowed int >= 1")
    if style not in STYLES:
        raise ValueError(f"style={style!r} is not one of {STYLES}")
    if not (sharpness >= 0.0) or sharpness == float("inf"):
        raise ValueError(f"sharpness={sharpness!r} is out of range: allowed finite >= 0")
    if tie_levels < 0:
        raise ValueError(f"tie_levels={tie_levels} is out of range: allowed >= 0 (0 = no ties)")
    if not (0.0 <= neg_inf_frac < 1.0):
        raise ValueError(f"neg_inf_frac={neg_inf_frac} is out of range: allowed [0, 1)")

    cache: OrderedDict[Path, torch.Tensor] = OrderedDict()

    def fn(paths: list[Path]) -> torch.Tensor:
        rows = []
        for p in paths:
            row = cache.get(p)
            if row is None:
                row = _one_logits(vocab_size, seed, p, sharpness, style, tie_levels, neg_inf_frac)
                cache[p] = row
                if len(cache) > memo:
                    cache.popitem(last=False)
            rows.append(row)
        return torch.stack(rows).clone()

    return FunctionalLM(fn, vocab_size)


# --------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------

def linear_path_indices(linear: LinearTree, i: int, b: int = 0) -> list[int]:
    """Linear indices from the root to node ``i`` (both included), following ``parent``.

    Example: parents ``[-1, 0, 0, 1]`` and ``i = 3`` -> ``[0, 1, 3]``.
    """
    out = []
    while i >= 0:
        out.append(i)
        i = int(linear.parent[b, i])
    return out[::-1]


class _FunctionalTreeLogits(TreeLogits):
    """Lazy per-node logits of one verify forward (the fn runs only at visited nodes).
    The tree's tokens and parents were read in one transfer (``HostTree``): a path costs
    no device read."""

    def __init__(self, lm: FunctionalLM, context: list[int], host: HostTree) -> None:
        self._lm, self._context, self._host = lm, context, host
        self._n = host.n
        self._memo: dict[int, torch.Tensor] = {}

    def path(self, i: int) -> tuple[int, ...]:
        """The full token path of linear node ``i`` (context + root .. node)."""
        return tuple(self._context + [self._host.token[j] for j in self._host.path(i)])

    def logits(self, i: int) -> torch.Tensor:
        if not 0 <= i < self._n:
            raise IndexError(f"linear node {i} is outside [0, {self._n})")
        if i not in self._memo:
            self._memo[i] = self._lm([self.path(i)])[0]
        return self._memo[i]

    def all_logits(self) -> torch.Tensor:
        """Logits ``[n, V]`` at every real linear node (what the device walk reads)."""
        todo = [i for i in range(self._n) if i not in self._memo]
        if todo:
            for i, row in zip(todo, self._lm([self.path(i) for i in todo])):
                self._memo[i] = row
        return torch.stack([self._memo[i] for i in range(self._n)])


class FunctionalTarget(TargetModel):
    """``TargetModel`` over a ``FunctionalLM``; the "cache" is the committed token list.

    Example:
        >>> t = FunctionalTarget(hashed_context_lm(5, seed=0)); t.start([1, 2, 3])
        >>> t.context
        [1, 2]
    """

    def __init__(self, lm: FunctionalLM) -> None:
        self.lm = lm
        self.vocab_size = lm.vocab_size
        self.context: list[int] = []  #: committed tokens before the current root
        self._linear: HostTree | None = None  #: the last verified tree, as read on the host

    def start(self, prompt_ids: list[int]) -> None:
        ids = check_prompt_ids(prompt_ids, self.vocab_size)
        self.context = ids[:-1]
        self._linear = None

    def start_and_root(self, prompt_ids: list[int]) -> _FunctionalTreeLogits:
        """Commit the whole prompt; its last token, as a one-node tree, serves the first new
        token (``TargetModel.start_and_root``)."""
        ids = check_prompt_ids(prompt_ids, self.vocab_size)
        self.context = ids
        self._linear = None
        return _FunctionalTreeLogits(self.lm, ids[:-1], HostTree(1, len(ids) - 1, [ids[-1]], [-1]))

    def forward_tree(self, linear: LinearTree) -> _FunctionalTreeLogits:
        # the model is a host function of token paths: one transfer per verify, not per node
        host = linear_on_host(linear)
        if host.position0 != len(self.context):
            raise ValueError(f"linear.position[0, 0]={host.position0} but {len(self.context)} tokens are "
                             "committed before the root; was commit() called after the last step?")
        self._linear = host
        return _FunctionalTreeLogits(self.lm, list(self.context), host)

    def commit(self, path: list[int]) -> None:
        if self._linear is None:
            raise RuntimeError("commit() called before forward_tree()")
        path = check_commit_path(self._linear, path)
        self.context += [self._linear.token[j] for j in path]
        self._linear = None


class FunctionalDraft(DraftModel):
    """``DraftModel`` over a ``FunctionalLM``: context of a node = committed + root + path.

    Example:
        >>> d = FunctionalDraft(hashed_context_lm(5, seed=1)); d.start([1, 2, 3])
        >>> d.context, d.root
        ([1, 2], 3)
    """

    def __init__(self, lm: FunctionalLM) -> None:
        self.lm = lm
        self.vocab_size = lm.vocab_size
        self.context: list[int] = []  #: committed tokens before the root
        self.root: int | None = None  #: the current root token (last emitted)

    def start(self, prompt_ids: list[int]) -> None:
        ids = check_prompt_ids(prompt_ids, self.vocab_size)
        self.context, self.root = ids[:-1], ids[-1]

    def node_path(self, tree: DraftTree, node: int) -> tuple[int, ...]:
        """Full token path of creation id ``node`` of tree 0."""
        n = int(tree.n_nodes[0])
        if not 0 <= node < n:
            raise IndexError(f"node {node} is outside the tree's created nodes [0, {n})")
        return tuple(self.context + [int(tree.token[0, 0])] + tree.path_tokens(0, node))

    def node_logits(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        # the model is a host function of token paths: the call's tokens come over in one
        # transfer (``draft_on_host``), not node by node
        host = draft_on_host(tree, nodes)
        nodes = check_draft_call(tree, nodes, self.root, None, host=host)
        prefix = self.context + [host.token[0]]
        return self.lm([tuple(prefix + host.path_tokens(v)) for v in nodes])

    def node_logits_rows(self, tree: DraftTree, nodes: list[list[int]]) -> list[torch.Tensor]:
        """Every row's nodes in one call of the function (rows are copies made by
        ``start_rows``; row ``b``'s context is its own)."""
        rows = self._rows_started("node_logits_rows")
        paths, counts = [], []
        for b, (row, nb) in enumerate(zip(rows, nodes)):
            if int(tree.token[b, 0]) != row.root:
                raise ValueError(f"row {b}: tree root token {int(tree.token[b, 0])} differs from the "
                                 f"draft's root {row.root}")
            n = int(tree.n_nodes[b])
            nb = [int(v) for v in nb]
            bad = [v for v in nb if not 0 <= v < n]
            if bad:
                raise ValueError(f"row {b}: nodes {bad} are outside the tree's created nodes [0, {n})")
            paths += [tuple(row.context + [row.root] + tree.path_tokens(b, v)) for v in nb]
            counts.append(len(nb))
        out = self.lm(paths) if paths else torch.zeros(0, self.vocab_size)
        return list(torch.split(out, counts))

    def commit(self, tree: DraftTree, path_nodes: list[int], emitted: list[int],
               features: list[torch.Tensor | None]) -> None:
        path_nodes = check_emitted(tree, path_nodes, emitted)
        # check_emitted made sure emitted[:-1] are the tokens of path_nodes[1:]
        self.context += [self.root] + [int(t) for t in emitted[:-1]]
        self.root = int(emitted[-1])
