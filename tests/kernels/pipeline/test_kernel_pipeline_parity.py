"""The kernel pipeline builds exactly the reference pipeline's DraftTree (every tensor
equal, NaN == NaN) for the same seed: batch > 1, all proxies, rheostats, greedy, a
custom (injected) sampler, and vocabularies smaller than the support."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.kernels.pipeline import kernel_pipeline
from rheoplan.pipeline import flatten, PassContext
from rheoplan.planner.default import DEFAULT_PIPELINE


def make_draft(V: int, seed: int):
    """Logits that are a pure function of the path tokens (so both pipelines see the same
    inputs only if they built the same tree), with ties, -inf and near one-hot rows."""

    def draft(tree, nodes):
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


def assert_trees_equal(a, b):
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "linear":
            for g in fields(x):
                assert torch.equal(getattr(x, g.name), getattr(y, g.name)), f"linear.{g.name}"
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert torch.equal(x, y) or (x.dtype.is_floating_point and torch.allclose(
                x, y, rtol=0, atol=0, equal_nan=True)), f"{f.name}:\n{x}\n{y}"
        else:
            assert x == y, f.name


CASES = [  # (tree config kwargs, temperature, V)
    (dict(depth=3, frontier=3, slots=4, budget=10, rheostat=1, support=16), 1.0, 40),
    (dict(depth=4, frontier=2, slots=3, budget=9, rheostat=0, support=8, proxy="next_rank"), 0.8, 30),
    (dict(depth=3, frontier=3, slots=5, budget=12, rheostat=2, support=32, proxy="true_q"), 1.2, 50),
    (dict(depth=3, frontier=2, slots=4, budget=8, rheostat=1, support=128), 1.0, 9),  # V < S
    (dict(depth=3, frontier=3, slots=4, budget=10, rheostat=1, support=16), 0.0, 40),  # greedy
    (dict(depth=2, frontier=4, slots=3, budget=70, rheostat=1, support=8), 1.0, 20),  # budget > nodes
    (dict(depth=4, frontier=4, slots=6, budget=40, rheostat=1, support=128), 1.0, 300),
    (dict(depth=3, frontier=3, slots=4, budget=10, rheostat=4, support=16), 1.0, 40),  # m = K
]


@pytest.mark.parametrize("cfg,T,V", CASES)
def test_kernel_pipeline_equals_reference(cfg, T, V):
    tree, sampling = TreeConfig(**cfg), SamplingConfig(temperature=T)
    draft = make_draft(V, seed=V)
    kw = dict(tree=tree, sampling=sampling, prefix_len=[3, 0, 7], seed=11, step=2)
    ref = plan_tree(draft, [1, 2, 3], **kw)
    ker = plan_tree(draft, [1, 2, 3], passes=kernel_pipeline(), **kw)
    assert_trees_equal(ref, ker)


def test_injected_sampler_path():
    """A non-default sampler (the oracle's injection) goes through ctx.sampler per row."""
    tree, sampling = TreeConfig(depth=3, frontier=2, slots=4, budget=8, support=12), SamplingConfig()
    draft = make_draft(25, seed=1)
    calls = []

    def sampler(b, node, qt):
        calls.append((b, node))
        return int(torch.argmin(qt))  # deterministic and unlike Gumbel-max

    ref = plan_tree(draft, [4, 5], tree=tree, sampling=sampling, sampler=sampler)
    n_ref = len(calls)
    ker = plan_tree(draft, [4, 5], tree=tree, sampling=sampling, sampler=sampler, passes=kernel_pipeline())
    assert len(calls) == 2 * n_ref
    assert_trees_equal(ref, ker)


def test_same_pass_names():
    ctx = PassContext(tree_cfg=TreeConfig(depth=3), sampling=SamplingConfig())
    assert [n for n, _ in flatten(kernel_pipeline(), ctx)] == [n for n, _ in flatten(DEFAULT_PIPELINE, ctx)]
    with pytest.raises(ValueError, match="cpu"):
        kernel_pipeline("cuda")
