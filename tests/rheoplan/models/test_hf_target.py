"""HFTarget: tree attention, KV compaction, greedy consistency, lazy logits, features.

Tolerance: fp32 forwards of the same math in a different order (tree block vs plain
causal, compacted vs fresh cache) agree to ~1e-5 on these tiny models; 1e-4 leaves room.
"""

from __future__ import annotations

import random

import pytest
import torch

from _adapter_trees import make_linear, path_of, random_tree
from _adapter_models import full_logits
from rheoplan.models.base import TargetModel
from rheoplan.models.hf_target import HFTarget, eagle3_layers

ATOL = 1e-4


def test_tree_logits_equal_chain_forward(llama):
    target = HFTarget(llama)
    assert isinstance(target, TargetModel)
    prompt = [3, 9, 14, 2, 7]
    target.start(prompt)
    toks, par = random_tree(random.Random(0), 14, 101, root=prompt[-1])
    tl = target.forward_tree(make_linear(toks, par, prefix_len=4, pad=3))
    for i in range(14):
        ref = full_logits(llama, prompt[:-1] + [toks[j] for j in path_of(par, i)])[-1]
        torch.testing.assert_close(tl.logits(i), ref, atol=ATOL, rtol=0)


def test_one_token_prompt_has_empty_prefix(llama):
    target = HFTarget(llama)
    target.start([42])
    assert target.cached_len == 0
    toks, par = [42, 5, 6, 7], [-1, 0, 0, 1]
    tl = target.forward_tree(make_linear(toks, par, prefix_len=0))
    for i in range(4):
        ref = full_logits(llama, [toks[j] for j in path_of(par, i)])[-1]
        torch.testing.assert_close(tl.logits(i), ref, atol=ATOL, rtol=0)
    target.commit([0, 1, 3])
    assert target.cached_len == 3


def test_cache_integrity_after_many_commits(llama):
    rng = random.Random(1)
    target = HFTarget(llama)
    seq = [rng.randrange(101) for _ in range(6)]
    target.start(seq)
    for step in range(10):
        n = rng.randrange(1, 12)
        toks, par = random_tree(rng, n, 101, root=seq[-1])
        tl = target.forward_tree(make_linear(toks, par, prefix_len=len(seq) - 1))
        leaf = rng.randrange(n)
        path = path_of(par, leaf)[: rng.randrange(1, len(path_of(par, leaf)) + 1)]
        i = path[-1]
        torch.testing.assert_close(tl.logits(i), full_logits(llama, seq[:-1] + [toks[j] for j in path])[-1],
                                   atol=ATOL, rtol=0)
        target.commit(path)
        seq = seq + [toks[j] for j in path[1:]] + [rng.randrange(101)]
        assert target.cached_len == len(seq) - 1
    # The compacted cache equals a fresh forward's cache entry by entry.
    fresh = HFTarget(llama)
    fresh.start(seq)
    for a, b in zip(target.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=ATOL, rtol=0)


def _greedy_reference(model, prompt: list[int], n_new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n_new):
        seq.append(int(full_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def test_greedy_walk_matches_plain_greedy(llama):
    """Trees that contain the greedy continuation at random depths; the greedy walk must
    emit exactly plain greedy decoding, whatever was accepted in each step."""
    rng = random.Random(2)
    prompt = [11, 12, 13]
    want = _greedy_reference(llama, prompt, 24)
    target = HFTarget(llama)
    target.start(prompt)
    emitted: list[int] = []
    while len(emitted) < 24:
        root = (prompt + emitted)[-1]
        # A chain following the true greedy tokens for a random length, plus decoys.
        k = rng.randrange(0, 4)
        gold = want[len(emitted): len(emitted) + k]
        toks = [root] + gold
        par = [-1] + list(range(len(gold)))
        for _ in range(3):
            p = rng.randrange(len(toks))
            decoy = (want[len(emitted) + p] + 1 + rng.randrange(99)) % 101 if len(emitted) + p < 24 else 0
            par.append(p)
            toks.append(decoy)
        order = sorted(range(len(toks)), key=lambda i: (_depth(par, i), i))
        new = {o: j for j, o in enumerate(order)}
        toks = [toks[o] for o in order]
        par = [-1 if par[o] < 0 else new[par[o]] for o in order]
        tl = target.forward_tree(make_linear(toks, par, prefix_len=len(prompt) + len(emitted) - 1))
        node, path = 0, [0]
        while True:
            x = int(tl.logits(node).argmax())
            emitted.append(x)
            kids = [c for c in range(len(toks)) if par[c] == node and toks[c] == x]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        target.commit(path)
    assert emitted[:24] == want


def _depth(par: list[int], i: int) -> int:
    return len(path_of(par, i)) - 1


def test_logits_are_lazy(llama):
    target = HFTarget(llama)
    target.start([1, 2, 3])
    toks, par = random_tree(random.Random(3), 20, 101, root=3)
    tl = target.forward_tree(make_linear(toks, par, prefix_len=2))
    tl.logits(0), tl.logits(5), tl.logits(5)
    assert tl.n_projected == 2
    all_ = tl.all_logits()
    assert all_.shape == (20, 101)
    torch.testing.assert_close(all_[5], tl.logits(5), atol=1e-5, rtol=0)


def test_features_are_layer_inputs(llama6):
    target = HFTarget(llama6, capture_layers="eagle3")
    assert target.capture_layers == eagle3_layers(6) == [2, 3, 3]
    prompt = [4, 8, 15, 16]
    target.start(prompt)
    toks, par = [16, 23, 42, 7], [-1, 0, 0, 2]
    tl = target.forward_tree(make_linear(toks, par, prefix_len=3))
    with torch.no_grad():
        hs = llama6(input_ids=torch.tensor([prompt[:-1] + [16, 42, 7]]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i][0] for i in (2, 3, 3)], dim=-1)  # [6, 3H]
    torch.testing.assert_close(target.prompt_features(), ref[:3], atol=ATOL, rtol=0)
    torch.testing.assert_close(tl.features(0), ref[3], atol=ATOL, rtol=0)
    torch.testing.assert_close(tl.features(3), ref[5], atol=ATOL, rtol=0)
    assert tl.features(1).shape == (3 * 64,)
    target.close()
    assert not any(layer._forward_pre_hooks for layer in llama6.model.layers)


@pytest.mark.parametrize("prompt", [[4, 8, 15, 16], [42]], ids=["four", "one"])
def test_start_and_root_serves_the_roots_output(llama6, prompt):
    """``start_and_root`` caches the whole prompt and returns what ``start`` + a root-only
    verify forward gives at the root (logits, features); its prompt features are
    ``start``'s and the root's (one per prompt token); the next tree's root then sits at
    ``len(prompt)``."""
    ref = HFTarget(llama6, capture_layers="eagle3")
    ref.start(prompt)
    ref_tl = ref.forward_tree(make_linear([prompt[-1]], [-1], prefix_len=len(prompt) - 1))
    ref_prompt = ref.prompt_features().clone()
    ref.close()
    target = HFTarget(llama6, capture_layers="eagle3")
    tl = target.start_and_root(prompt)
    assert tl.n == 1 and target.cached_len == len(prompt)
    torch.testing.assert_close(tl.logits(0), ref_tl.logits(0), atol=ATOL, rtol=0)
    torch.testing.assert_close(tl.logits(0), full_logits(llama6, prompt)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(tl.features(0), ref_tl.features(0), atol=ATOL, rtol=0)
    torch.testing.assert_close(target.prompt_features(), torch.cat([ref_prompt, ref_tl.features(0)[None]]),
                               atol=ATOL, rtol=0)
    toks, par = [7, 23, 42], [-1, 0, 1]
    nxt = target.forward_tree(make_linear(toks, par, prefix_len=len(prompt)))
    torch.testing.assert_close(nxt.logits(2), full_logits(llama6, prompt + [7, 23, 42])[-1], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="caches"):
        target.forward_tree(make_linear(toks, par, prefix_len=len(prompt) - 1))  # the old root position
    target.close()


def test_start_rows_and_roots_serve_each_rows_root(llama6):
    """The batched prefill of whole prompts (left padding) serves each row's root as the
    batch-1 ``start_and_root`` does, with one prompt feature per prompt token; rows added
    with ``add_rows_and_roots`` are served the same way."""
    prompts = [[4, 8, 15, 16, 23], [42], [9, 9, 3]]
    target = HFTarget(llama6, capture_layers="eagle3")
    served = target.start_rows_and_roots(prompts)
    feats = target.prompt_features_rows_for(llama6)
    for b, p in enumerate(prompts):
        one = HFTarget(llama6, capture_layers="eagle3")
        tl = one.start_and_root(p)
        torch.testing.assert_close(served[b].logits(0), tl.logits(0), atol=ATOL, rtol=0)
        torch.testing.assert_close(served[b].features(0), tl.features(0), atol=ATOL, rtol=0)
        assert feats[b].shape[0] == len(p)
        torch.testing.assert_close(feats[b], one.prompt_features(), atol=ATOL, rtol=0)
        one.close()
    target.keep_rows([0, 2])
    joined = [[5, 6, 7, 8, 9, 10, 11], [3]]
    added = target.add_rows_and_roots(joined)
    for b, p in enumerate(joined):
        torch.testing.assert_close(added[b].logits(0), full_logits(llama6, p)[-1], atol=ATOL, rtol=0)
    prompts = [prompts[0], prompts[2]] + joined
    # the next step's roots sit at len(prompt) in every row
    rows = target.forward_trees(_stack_rows([make_linear([1], [-1], prefix_len=len(p)) for p in prompts]))
    for b, p in enumerate(prompts):
        torch.testing.assert_close(rows[b].logits(0), full_logits(llama6, p + [1])[-1], atol=ATOL, rtol=0)
    target.close()


@pytest.mark.parametrize("groups", [[[1, 2], [0, 3]], [[0, 2], [3, 1]], [[3], [1], [0, 2]]])
def test_prefill_in_groups_equals_one_padded_forward(llama6, groups):
    """Rows prefilled one forward per group (``prefills_in_groups``) are served, cached and
    verified as in one left-padded forward of every row: the served roots, their features,
    the prompt features and the next step's logits match, row by row, in the caller's order.
    ``start_rows`` (last token not cached) with a group whose rows cache nothing ([7]) too."""
    prompts = [[4, 8, 15, 16, 23], [7], [9, 9, 3], [5, 6, 7, 8, 9, 10, 11]]
    one, grouped = HFTarget(llama6, capture_layers="eagle3"), HFTarget(llama6, capture_layers="eagle3")
    assert grouped.prefills_in_groups
    a = one.start_rows_and_roots(prompts)
    b = grouped.start_rows_and_roots(prompts, groups=groups)
    for b_, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(y.logits(0), x.logits(0), atol=ATOL, rtol=0)
        torch.testing.assert_close(y.features(0), x.features(0), atol=ATOL, rtol=0)
        torch.testing.assert_close(y.logits(0), full_logits(llama6, prompts[b_])[-1], atol=ATOL, rtol=0)
    for x, y in zip(one.prompt_features_rows_for(llama6), grouped.prompt_features_rows_for(llama6)):
        torch.testing.assert_close(y, x, atol=ATOL, rtol=0)
    lin = _stack_rows([make_linear([1, 2], [-1, 0], prefix_len=len(p)) for p in prompts])
    for b_, (x, y) in enumerate(zip(one.forward_trees(lin), grouped.forward_trees(lin))):
        torch.testing.assert_close(y.logits(1), x.logits(1), atol=ATOL, rtol=0)
        torch.testing.assert_close(y.logits(1), full_logits(llama6, prompts[b_] + [1, 2])[-1], atol=ATOL, rtol=0)
    # rows joining in groups; then the prompts' last token not cached (a row of one token caches nothing)
    grouped.commit_rows([[0, 1]] * len(prompts))
    joined = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    added = grouped.add_rows_and_roots(joined, groups=[[1], [0]])
    for p, y in zip(joined, added):
        torch.testing.assert_close(y.logits(0), full_logits(llama6, p)[-1], atol=ATOL, rtol=0)
    plain = HFTarget(llama6)
    plain.start_rows(prompts, groups=groups)
    lin = _stack_rows([make_linear([p[-1], 3], [-1, 0], prefix_len=len(p) - 1) for p in prompts])
    for p, y in zip(prompts, plain.forward_trees(lin)):
        torch.testing.assert_close(y.logits(1), full_logits(llama6, p + [3])[-1], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="groups="):
        plain.start_rows(prompts, groups=[[0, 1], [1, 2, 3]])
    for t in (one, grouped, plain):
        t.close()


def _stack_rows(linears):
    """One ``LinearTree`` holding the given one-tree linears as its rows."""
    from dataclasses import fields

    first = linears[0]
    return type(first)(**{f.name: torch.cat([getattr(x, f.name) for x in linears]) for f in fields(first)})


def test_refresh_forward_without_commit(llama):
    target = HFTarget(llama)
    target.start([1, 2, 3])
    lin = make_linear([3, 4, 5], [-1, 0, 1], prefix_len=2)
    target.forward_tree(lin)
    tl = target.forward_tree(lin)  # re-verify the same step: replaces the first tree
    torch.testing.assert_close(tl.logits(2), full_logits(llama, [1, 2, 3, 4, 5])[-1], atol=ATOL, rtol=0)
    target.commit([0, 1, 2])
    assert target.cached_len == 5


def test_errors(llama):
    target = HFTarget(llama)
    with pytest.raises(RuntimeError, match="before start"):
        target.forward_tree(make_linear([3], [-1], prefix_len=0))
    with pytest.raises(ValueError, match="empty"):
        target.start([])
    with pytest.raises(ValueError, match=r"outside \[0, 101\)"):
        target.start([1, 500])
    target.start([1, 2, 3])
    with pytest.raises(RuntimeError, match="before forward_tree"):
        target.commit([0])
    with pytest.raises(ValueError, match="prefix_len"):
        target.forward_tree(make_linear([3, 4], [-1, 0], prefix_len=5))
    target.forward_tree(make_linear([3, 4, 5], [-1, 0, 0], prefix_len=2))
    with pytest.raises(ValueError, match="not a child"):
        target.commit([0, 1, 2])
    with pytest.raises(ValueError, match="capture_layers"):
        HFTarget(llama, capture_layers=[7])
    with pytest.raises(ValueError, match="num_layers"):
        HFTarget(llama, capture_layers="eagle3")  # 2 layers: too few for EAGLE-3
    with pytest.raises(RuntimeError, match="capture_layers"):
        HFTarget(llama).prompt_features()


def test_prefetch_batches_projection(llama):
    target = HFTarget(llama)
    target.start([1, 2, 3])
    tl = target.forward_tree(make_linear([3, 4, 5, 6], [-1, 0, 1, 0], prefix_len=2))
    tl.prefetch([0, 1, 1, 2])
    assert tl.n_projected == 3
    torch.testing.assert_close(tl.logits(2), full_logits(llama, [1, 2, 3, 4, 5])[-1], atol=ATOL, rtol=0)
    assert tl.n_projected == 3
    with pytest.raises(IndexError):
        tl.prefetch([9])


def _decode_projections(llama, projection, timings=None):
    """Tokens of a short tree decode and (rows, rows projected) of every verify forward."""
    from rheoplan import SamplingConfig, TreeConfig, plan_and_decode

    target = HFTarget(llama)
    target.projection = projection
    target._projection_timings = timings
    seen = []
    forward = target.forward_tree

    def recording(linear):
        tl = forward(linear)
        seen.append(tl)
        return tl

    target.forward_tree = recording
    r = plan_and_decode(target, llama, [1, 2, 3], max_new_tokens=16, seed=5, sampling=SamplingConfig(temperature=1.0),
                        tree=TreeConfig(depth=3, frontier=2, slots=2, budget=6, support=8), backend="numba")
    return r.tokens, [(tl.n, tl.n_projected) for tl in seen]


def test_walk_projects_all_rows_when_measured_cheaper(llama):
    from rheoplan.costmodel import ProjectionTimings

    tok_all, proj_all = _decode_projections(llama, "all")
    tok_lazy, proj_lazy = _decode_projections(llama, "lazy")
    assert all(p == n for n, p in proj_all)  # one projection of every row
    assert any(p < n for n, p in proj_lazy)  # the likely path and the visited nodes only
    assert tok_all == tok_lazy  # the same logits up to a batched product's rounding
    # 'auto' follows the measured costs (injected here): flat -> all rows, steep -> lazy
    _, proj = _decode_projections(llama, "auto", ProjectionTimings((1, 64), (1.0, 1.0)))
    assert all(p == n for n, p in proj)
    _, proj = _decode_projections(llama, "auto", ProjectionTimings((1, 64), (1.0, 64.0)))
    assert proj == proj_lazy


def test_projection_choice_is_checked_before_the_forward(llama):
    target = HFTarget(llama)
    target.start([1, 2, 3])
    target.projection = "sometimes"
    with pytest.raises(ValueError, match=r"projection='sometimes': allowed one of \('auto', 'all', 'lazy'\)"):
        target.forward_tree(make_linear([3, 4], [-1, 0], prefix_len=2))
    assert target.cache is not None and target.cached_len == 2


def _two_rows(target):
    """A started two-row batch (prompts [1, 2, 3] and [5, 6]) and its verify forward:
    row 0 a root with two children, row 1 a root alone; returns the rows' TreeLogits."""
    from dataclasses import fields

    from rheoplan.ir import LinearTree

    target.start_rows([[1, 2, 3], [5, 6]])
    a = make_linear([3, 4, 5], [-1, 0, 0], prefix_len=2)
    b = make_linear([6], [-1], prefix_len=1, pad=2)

    def cat(x, y):
        if x.dim() == 3 and x.shape[1:] != y.shape[1:]:  # paths [1, P, D+1]: pad to one shape
            P, D = max(x.shape[1], y.shape[1]), max(x.shape[2], y.shape[2])
            x, y = (torch.nn.functional.pad(t, (0, D - t.shape[2], 0, P - t.shape[1]), value=-1) for t in (x, y))
        return torch.cat([x, y])

    linear = LinearTree(**{f.name: cat(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)})
    return target.forward_trees(linear)


def _count_head_calls(target):
    calls = []
    target.head.register_forward_hook(lambda mod, args, out: calls.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    return calls


def test_prefetch_rows_projects_every_row_in_one_call(llama):
    from rheoplan.costmodel import ProjectionTimings

    target = HFTarget(llama)
    target.projection = "lazy"
    want0, want1 = full_logits(llama, [1, 2, 3, 4])[-1], full_logits(llama, [5, 6])[-1]
    fws = _two_rows(target)
    calls = _count_head_calls(target)
    target.prefetch_rows(fws, [[0, 1], [0]])
    assert calls == [3]  # both rows' likely paths, one lm_head call
    assert [fw.n_projected for fw in fws] == [2, 1]
    got0, got1 = fws[0].logits(1), fws[1].logits(0)
    assert calls == [3]  # memoised
    torch.testing.assert_close(got0, want0, atol=ATOL, rtol=0)
    torch.testing.assert_close(got1, want1, atol=ATOL, rtol=0)
    fws[0].logits(2)  # off the likely path: one more single-row projection
    assert calls == [3, 1]
    # measured costs decide between the paths and every node: flat -> every node of every row
    for projection, want in [(ProjectionTimings((1, 64), (1.0, 1.0)), [3, 1]),
                             (ProjectionTimings((1, 64), (1.0, 640.0)), [2, 1]), ("all", [3, 1])]:
        target = HFTarget(llama)
        target.projection = "auto" if isinstance(projection, ProjectionTimings) else projection
        target._projection_timings = projection if isinstance(projection, ProjectionTimings) else None
        fws = _two_rows(target)
        calls = _count_head_calls(target)
        target.prefetch_rows(fws, [[0, 1], [0]])
        assert calls == [sum(want)] and [fw.n_projected for fw in fws] == want


def test_prefetch_rows_errors(llama):
    target = HFTarget(llama)
    fws = _two_rows(target)
    with pytest.raises(ValueError, match="paths holds 1 paths for 2 rows"):
        target.prefetch_rows(fws, [[0]])
    with pytest.raises(IndexError, match=r"linear node 3 is outside \[0, 3\)"):
        target.prefetch_rows(fws, [[0, 3], [0]])
    other = HFTarget(llama)
    other.head = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="TreeLogits of this target"):
        other.prefetch_rows(fws, [[0], [0]])
