"""Shared helpers for the planner / IR tests: synthetic drafts, hypothesis strategies,
and brute-force versions of the tree facts the passes compute.

Drafts here are pure functions of the token path (hashed context), like the oracle's
models, so context matters at every depth.
"""

from __future__ import annotations

import math
from dataclasses import fields

import torch
from hypothesis import strategies as st

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree

NEG_INF = float("-inf")


#: (tree config kwargs, temperature, V) the lowering tests plan with: every proxy, rheostats
#: 0 to K, greedy, V below the support, a budget above the nodes
LOWERING_CASES = [
    (dict(depth=3, frontier=3, slots=4, budget=10, rheostat=1, support=16), 1.0, 40),
    (dict(depth=4, frontier=2, slots=3, budget=9, rheostat=0, support=8, proxy="next_rank"), 0.8, 30),
    (dict(depth=3, frontier=3, slots=5, budget=12, rheostat=2, support=32, proxy="true_q"), 1.2, 50),
    (dict(depth=3, frontier=2, slots=4, budget=8, rheostat=1, support=128), 1.0, 9),  # V < S
    (dict(depth=3, frontier=3, slots=4, budget=10, rheostat=1, support=16), 0.0, 40),  # greedy
    (dict(depth=2, frontier=4, slots=3, budget=70, rheostat=1, support=8), 1.0, 20),  # budget > nodes
    (dict(depth=4, frontier=4, slots=6, budget=40, rheostat=1, support=128), 1.0, 300),
    (dict(depth=3, frontier=3, slots=4, budget=10, rheostat=4, support=16), 1.0, 40),  # m = K
]


def path_hash_draft(V: int, seed: int, calls: list | None = None):
    """Logits that are a pure function of the path tokens (so two pipelines see the same
    inputs only if they built the same tree), with ties, -inf and near one-hot rows;
    ``calls`` (optional) collects the node ids of every call."""

    def draft(tree, nodes):
        if calls is not None:
            calls.append(nodes.tolist())
        B, n = nodes.shape
        out = torch.zeros(B, n, V)
        for b in range(B):
            for j in range(n):
                v = int(nodes[b, j])
                if v < 0:
                    out[b, j] = float("nan")  # padding rows must never be read
                    continue
                h = hash((seed, b, tuple(tree.path_tokens(b, v)))) % (2**31)
                g = torch.Generator().manual_seed(h)
                x = torch.randn(V, generator=g) * 2.5
                kind = h % 4
                if kind == 1:
                    x = torch.round(x)
                elif kind == 2:
                    x[torch.rand(V, generator=g) < 0.4] = float("-inf")
                    x[h % V] = 1.0
                elif kind == 3:
                    x[:] = 0.0
                    x[h % V] = 60.0
                out[b, j] = x
        return out

    return draft


def assert_trees_equal(a: DraftTree, b: DraftTree) -> None:
    """Every tensor equal (NaN == NaN), the linear form's too (``None`` on both or on
    neither), every other field equal. ``linear.paths`` of the device planner keeps its
    capacity (rows past ``n_paths`` are -1) where the others trim it, so ``b``'s may be
    longer than ``a``'s, by -1 rows."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "linear":
            assert (x is None) == (y is None), "linear"
            if x is None:
                continue
            for g in fields(x):
                u, w = getattr(x, g.name), getattr(y, g.name)
                if g.name == "paths" and w.shape[1] > u.shape[1]:
                    assert (w[:, u.shape[1]:] == -1).all()
                    w = w[:, :u.shape[1]]
                assert torch.equal(u, w), f"linear.{g.name}"
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert torch.equal(x, y) or (x.dtype.is_floating_point and torch.allclose(
                x, y, rtol=0, atol=0, equal_nan=True)), f"{f.name}:\n{x}\n{y}"
        else:
            assert x == y, f.name


class PathDraft:
    """``draft(tree, nodes)`` whose logits are ``rows[hash(root, path) % len(rows)]``."""

    def __init__(self, rows: list[list[float]]):
        self.rows = torch.tensor(rows, dtype=torch.float32)
        self.calls = 0

    def logits_for_path(self, path: tuple[int, ...]) -> torch.Tensor:
        return self.rows[hash(path) % self.rows.shape[0]]

    def __call__(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        B, n = nodes.shape
        out = torch.zeros(B, n, self.rows.shape[1])
        for b in range(B):
            for j in range(n):
                v = int(nodes[b, j])
                if v >= 0:
                    out[b, j] = self.logits_for_path((int(tree.token[b, 0]), *tree.path_tokens(b, v)))
        return out


class NodeIdDraft(PathDraft):
    """Logits depend on the node id only (not on tokens): the same draft for every draw of Y."""

    def __call__(self, tree, nodes):
        idx = nodes.clamp(min=0) % self.rows.shape[0]
        return self.rows[idx]


# A small menu of logit values: integers give exact ties, -inf gives zero-probability
# tokens, 30 makes rows near-one-hot.
LOGIT_VALUES = st.sampled_from([0.0, 0.0, 1.0, 1.0, 2.0, -1.5, 0.25, 30.0, NEG_INF, NEG_INF])


@st.composite
def logit_rows(draw, V: int, n_rows: int):
    rows = []
    for _ in range(n_rows):
        row = draw(st.one_of(
            st.lists(LOGIT_VALUES, min_size=V, max_size=V),
            st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=V, max_size=V),
        ))
        if all(math.isinf(x) for x in row):
            row[draw(st.integers(0, V - 1))] = 0.0
        rows.append(row)
    return rows


@st.composite
def tree_configs(draw, V: int, max_depth: int = 4, proxies=("default", "next_rank", "true_q")):
    slots = draw(st.integers(1, min(V, 5)))
    return TreeConfig(
        depth=draw(st.integers(1, max_depth)),
        frontier=draw(st.integers(1, 4)),
        slots=slots,
        budget=draw(st.integers(1, 24)),
        rheostat=draw(st.integers(0, slots)),
        support=draw(st.integers(slots, V + 2)),
        proxy=draw(st.sampled_from(proxies)),
    )


SAMPLINGS = st.sampled_from([SamplingConfig(temperature=t) for t in (0.0, 0.5, 1.0, 2.0)])


@st.composite
def planning_problems(draw, max_depth: int = 4, proxies=("default", "next_rank", "true_q")):
    """(draft, cfg, sampling, roots, seed) for plan_tree."""
    V = draw(st.integers(2, 9))
    cfg = draw(tree_configs(V, max_depth, proxies))
    rows = draw(logit_rows(V, draw(st.integers(1, 6))))
    B = draw(st.integers(1, 2))
    roots = draw(st.lists(st.integers(0, V - 1), min_size=B, max_size=B))
    return PathDraft(rows), cfg, draw(SAMPLINGS), roots, draw(st.integers(0, 2**32))


def rank_key(tree: DraftTree, b: int, v: int) -> tuple[float, int, int]:
    """The global ranking key written out: higher score, shallower, created earlier."""
    return (-float(tree.score[b, v]), int(tree.depth[b, v]), v)


def ancestors(tree: DraftTree, b: int, v: int) -> list[int]:
    out = []
    while v >= 0:
        out.append(v)
        v = int(tree.parent[b, v])
    return out


def shape_of(tree: DraftTree) -> dict:
    """What 'tree shape' means in the rank-invariance tests (tokens excluded)."""
    n = int(tree.n_nodes.max())
    return {
        "parent": tree.parent[:, :n].tolist(),
        "kind": tree.kind[:, :n].tolist(),
        "kept": tree.kept[:, :n].tolist(),
        "expanded": tree.expanded[:, :n].tolist(),
        "position": tree.linear.position.tolist() if tree.linear is not None else None,
        "linear_node": tree.linear.node.tolist() if tree.linear is not None else None,
    }


class Words:
    """A toy tokenizer whose texts need quoting and escaping (quotes, newlines, ``%``, ``=``)."""

    words = ["the", "a", 'say "hi"', "cat\n", "é", "=x", "%1", "  "]

    def decode(self, ids):
        return "".join(self.words[i % len(self.words)] for i in ids)
