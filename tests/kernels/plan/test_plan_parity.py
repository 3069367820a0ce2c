"""Parity of the planner bookkeeping kernels (frontier top-k, global top-N, linearise):
reference (the planner's torch code) vs numba vs Triton. All outputs are integers or
bools: equal exactly. Trees come from the real pipeline (ragged batch) with scores
overwritten to force ties and -inf, so the tie rule (lower id first) is exercised."""

from __future__ import annotations

import pytest
import torch

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.kernels.plan import cpu, reference


def _tree(budget, depth=3, frontier=3, slots=4, seed=0):
    V = 30
    g = torch.Generator().manual_seed(seed)
    bank = torch.round(torch.randn(50, V, generator=g) * 2)  # rounded: many equal scores
    rows = torch.arange(3)[:, None]
    draft = lambda t, nodes: bank[(nodes.clamp(min=0) * 3 + t.cur_depth + 7 * rows) % 50]  # noqa: E731
    cfg = TreeConfig(depth=depth, frontier=frontier, slots=slots, budget=budget, support=16)
    return plan_tree(draft, [1, 2, 3], tree=cfg, sampling=SamplingConfig(), prefix_len=[0, 5, 9], seed=seed)


def _equal(a, b):
    for name, x, y in zip(getattr(a, "_fields", range(len(a))), a, b):
        assert torch.equal(x.cpu(), y.cpu()), name


@pytest.mark.parametrize("budget,seed", [(10, 0), (30, 1), (70, 2)])
def test_numba_matches_reference(budget, seed):
    t = _tree(budget, depth=4, frontier=4, slots=5, seed=seed)
    score = t.score.clone()
    score[:, 5::7] = float("-inf")
    for level in range(t.cur_depth + 1):
        _equal(reference.frontier_topk(score, t.depth, t.n_nodes, level, 3),
               cpu.frontier_topk(score, t.depth, t.n_nodes, level, 3))
    assert torch.equal(reference.prune_topn(score, t.n_nodes, budget), cpu.prune_topn(score, t.n_nodes, budget))
    # linearise a real (ancestor-closed) kept set: the -inf edits above break that property
    args = (t.kept, t.n_nodes, t.parent, t.token, t.depth, t.exp_row, t.prefix_len, budget, 4)
    _equal(reference.linearize(*args), cpu.linearize(*args))


def test_pack_bits_sign_word():
    """More than 64 linear nodes: bit 63 of word 0 is the sign bit, as pack_bits has it."""
    t = _tree(80, depth=4, frontier=4, slots=5, seed=3)
    assert int(t.linear.n.max()) > 64
    lin = cpu.linearize(t.kept, t.n_nodes, t.parent, t.token, t.depth, t.exp_row, t.prefix_len, 80, 4)
    assert torch.equal(lin.ancestor_bits, t.linear.ancestor_bits)


@pytest.mark.interpreter
def test_triton_matches_reference(device):
    from rheoplan.kernels.plan import triton as tk

    budget = 12
    t = _tree(budget, depth=3, frontier=2, slots=3, seed=4)
    score = t.score.clone()
    score[:, 4::5] = float("-inf")
    d = lambda x: x.to(device)  # noqa: E731
    for level in range(t.cur_depth + 1):
        _equal(reference.frontier_topk(score, t.depth, t.n_nodes, level, 2),
               tk.frontier_topk(d(score), d(t.depth), d(t.n_nodes), level, 2))
    kept = reference.prune_topn(score, t.n_nodes, budget)
    assert torch.equal(kept, tk.prune_topn(d(score), d(t.n_nodes), budget).cpu())
    args = (t.kept, t.n_nodes, t.parent, t.token, t.depth, t.exp_row, t.prefix_len)
    _equal(reference.linearize(*args, budget, 3), tk.linearize(*(d(x) for x in args), budget, 3))


@pytest.mark.interpreter
def test_triton_frontier_ranks_the_level_only(device):
    """The frontier kernel ranks only the level's id range (ids are depth-major, readiness
    item 12): with levels that straddle the kernel's 64-node blocks, every level's frontier
    equals the reference's."""
    from rheoplan.kernels.plan import triton as tk

    t = _tree(70, depth=4, frontier=4, slots=5, seed=2)
    assert int(t.n_nodes.min()) > 64 and t.score.shape[1] > 64
    d = lambda x: x.to(device)  # noqa: E731
    for level in range(t.cur_depth + 1):
        _equal(reference.frontier_topk(t.score, t.depth, t.n_nodes, level, 4),
               tk.frontier_topk(d(t.score), d(t.depth), d(t.n_nodes), level, 4))


@pytest.mark.interpreter
def test_triton_linearize_untrimmed_paths(device):
    """trim_paths=False: no host sync; the first n_paths rows equal the trimmed paths, the
    rest are -1 (readiness item 14)."""
    from rheoplan.kernels.plan import triton as tk

    budget = 12
    t = _tree(budget, depth=3, frontier=2, slots=3, seed=6)
    args = [x.to(device) for x in (t.kept, t.n_nodes, t.parent, t.token, t.depth, t.exp_row, t.prefix_len)]
    trimmed = tk.linearize(*args, budget, 3)
    full = tk.linearize(*args, budget, 3, trim_paths=False)
    P = trimmed.paths.shape[1]
    assert full.paths.shape == (3, 1 + budget, 4)
    assert torch.equal(full.paths[:, :P].cpu(), trimmed.paths.cpu())
    assert (full.paths[:, P:] == -1).all()


@pytest.mark.interpreter
def test_triton_linearize_two_words(device):
    """More than 64 linear nodes: two bit-words and two 64-wide column tiles of the mask."""
    from rheoplan.kernels.plan import triton as tk

    t = _tree(80, depth=4, frontier=4, slots=5, seed=3)
    assert int(t.linear.n.max()) > 64
    args = (t.kept, t.n_nodes, t.parent, t.token, t.depth, t.exp_row, t.prefix_len)
    _equal(reference.linearize(*args, 80, 4), tk.linearize(*(x.to(device) for x in args), 80, 4))
    kept = reference.prune_topn(t.score, t.n_nodes, 80)
    assert torch.equal(kept, tk.prune_topn(t.score.to(device), t.n_nodes.to(device), 80).cpu())
