"""rheoplan.verify: the couplings keep p, the sampler draws the coupling's law, the
closed-form acceptance is right, ot dominates onehot, and the walk behaves."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.distributions import draft_probs, rank_support, tail_law, target_probs
from rheoplan.rng import Purpose, Streams, gumbel_from_uniform
from rheoplan.testing import strategies as rst
from rheoplan.verify import (accept_prob, children_tokens, coupling_law, coupling_sample,
                             gumbel_max, gumbel_max_uniform, walk, walk_roots)

FAST = settings(max_examples=60, deadline=None)


@st.composite
def node_cases(draw):
    """A processed target p, a ranked draft support and (m, K) for one expanded node."""
    V = draw(rst.vocab_sizes())
    s = draw(rst.sampling_configs(V, temperatures=(0.5, 1.0, 1.5)))
    p = target_probs(draw(rst.logit_rows(V)), s)
    q = draft_probs(draw(rst.logit_rows(V)), s)
    S = draw(st.integers(1, V))
    K = draw(st.integers(1, S))
    m = draw(st.integers(0, K))
    tok, sq = rank_support(q.unsqueeze(0), S)
    return p, tok[0], sq[0], S, m, K


def _laws_over_y(p, tok, sq, n, m, K, verifier):
    """[(q~(Y), Y, law of X given Y)] for every Y of the tail."""
    if m >= K:
        return [(1.0, -1, coupling_law(p, tok, sq, n, m, K, -1, verifier))]
    qt = tail_law(sq, m, n)
    return [(float(qt[i]), int(tok[m + i]), coupling_law(p, tok, sq, n, m, K, int(tok[m + i]), verifier))
            for i in range(n - m) if float(qt[i]) > 0]


@FAST
@given(node_cases(), rst.verifiers())
def test_coupling_marginal_is_p(case, verifier):
    p, tok, sq, n, m, K = case
    mix = torch.zeros_like(p)
    for w, _, law in _laws_over_y(p, tok, sq, n, m, K, verifier):
        assert law.dtype == torch.float64
        assert abs(float(law.sum()) - 1.0) < 1e-12 and bool((law >= 0).all())
        mix += w * law
    assert float((mix - p).abs().max()) < 1e-12


@FAST
@given(node_cases(), rst.verifiers(), st.integers(0, 2**31 - 1))
def test_coupling_sample_support_and_accept_rule(case, verifier, seed):
    """The two-stage sampler: the proposal is returned iff u < accept; otherwise the draw
    is the Gumbel-max of the residual, which lies in the law's support."""
    p, tok, sq, n, m, K = case
    g = torch.Generator().manual_seed(seed)
    for _, y, law in _laws_over_y(p, tok, sq, n, m, K, verifier):
        gum = -torch.log(-torch.log(torch.rand(p.numel(), generator=g, dtype=torch.float64)))
        u = float(torch.rand(1, generator=g, dtype=torch.float64))
        x = coupling_sample(p, tok, sq, n, m, K, y, verifier, u, gum)
        assert float(law[x]) > 0
        # u = 0 always accepts a proposal that has positive acceptance
        x0 = coupling_sample(p, tok, sq, n, m, K, y, verifier, 0.0, gum)
        assert float(law[x0]) > 0


def test_coupling_sample_matches_law_monte_carlo():
    V = 5
    p = target_probs(torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0]), SamplingConfig())
    q = draft_probs(torch.tensor([0.1, 1.2, 0.4, -1.0, 0.3]), SamplingConfig())
    tok, sq = rank_support(q.unsqueeze(0), V)
    tok, sq = tok[0], sq[0]
    g = torch.Generator().manual_seed(0)
    n_draws = 20000
    for verifier in ("rheo", "ot"):
        y = int(tok[3])
        law = coupling_law(p, tok, sq, V, 1, 3, y, verifier)
        us = torch.rand(n_draws, generator=g, dtype=torch.float64)
        gs = -torch.log(-torch.log(torch.rand(n_draws, V, generator=g, dtype=torch.float64)))
        counts = torch.zeros(V, dtype=torch.float64)
        for i in range(n_draws):
            counts[coupling_sample(p, tok, sq, V, 1, 3, y, verifier, float(us[i]), gs[i])] += 1
        # 5 sigma per cell
        sd = torch.sqrt(law * (1 - law) / n_draws)
        assert bool(((counts / n_draws - law).abs() <= 5 * sd + 1e-12).all()), (verifier, counts / n_draws, law)


def test_coupling_edge_cases():
    tok = torch.tensor([2, 0, 1])
    sq = torch.tensor([0.6, 0.3, 0.1])
    # p == q~ on the tail: the residual is all zero, acceptance is certain
    qt = tail_law(sq, 1, 3)
    p = torch.zeros(3, dtype=torch.float64)
    p[tok[1:]] = qt
    law = coupling_law(p, tok, sq, 3, 1, 3, 0, "rheo")
    assert law.tolist() == [1.0, 0.0, 0.0]
    assert coupling_sample(p, tok, sq, 3, 1, 3, 0, "rheo", 0.999999, torch.zeros(3)) == 0
    # m == K: X ~ p for every verifier, Y ignored
    p2 = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    for v in ("onehot", "rheo", "ot"):
        assert torch.equal(coupling_law(p2, tok, sq, 3, 3, 3, -1, v), p2)
    # Y outside p's support is never accepted
    p3 = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    assert float(coupling_law(p3, tok, sq, 3, 1, 2, 0, "rheo")[0]) == 0.0
    with pytest.raises(ValueError, match="verifier"):
        coupling_law(p2, tok, sq, 3, 1, 2, 0, "nope")


@FAST
@given(node_cases())
def test_accept_prob_closed_form_equals_enumeration(case):
    p, tok, sq, n, m, K = case
    for verifier in ("onehot", "rheo", "ot"):
        exact = 0.0
        if m >= K:
            exact = float(p[tok[:K]].sum())
        else:
            qt = tail_law(sq, m, n)
            for i in range(n - m):
                if float(qt[i]) > 0:
                    ch = children_tokens(tok, m, K, n, m + i)
                    law = coupling_law(p, tok, sq, n, m, K, ch[m], verifier)
                    exact += float(qt[i]) * float(law[ch].sum())
        assert abs(accept_prob(p, tok, sq, n, m, K, verifier) - exact) < 1e-12, verifier


@FAST
@given(node_cases())
def test_ot_never_below_onehot_and_equals_rheo_without_pad(case):
    p, tok, sq, n, m, K = case
    a_ot = accept_prob(p, tok, sq, n, m, K, "ot")
    a_1h = accept_prob(p, tok, sq, n, m, K, "onehot")
    a_rh = accept_prob(p, tok, sq, n, m, K, "rheo")
    assert a_ot >= a_1h - 1e-12
    assert a_ot >= a_rh - 1e-12  # ot is optimal for this slot structure
    if m == K - 1:
        assert abs(a_ot - a_rh) < 1e-12
        for _, y, law in _laws_over_y(p, tok, sq, n, m, K, "ot"):
            assert float((law - coupling_law(p, tok, sq, n, m, K, y, "rheo")).abs().max()) < 1e-12


def test_accept_prob_monte_carlo():
    """Closed form vs sampling Y ~ q~ and X with coupling_sample."""
    V, m, K = 6, 1, 3
    s = SamplingConfig()
    p = target_probs(torch.tensor([0.5, 1.0, -0.3, 0.2, 0.9, -1.0]), s)
    q = draft_probs(torch.tensor([1.1, 0.7, 0.0, 0.4, 0.2, -0.5]), s)
    tok, sq = rank_support(q.unsqueeze(0), V)
    tok, sq = tok[0], sq[0]
    qt = tail_law(sq, m, V)
    g = torch.Generator().manual_seed(1)
    n_draws = 20000
    ys = torch.multinomial(qt, n_draws, replacement=True, generator=g)
    us = torch.rand(n_draws, generator=g, dtype=torch.float64)
    gs = -torch.log(-torch.log(torch.rand(n_draws, V, generator=g, dtype=torch.float64)))
    for verifier in ("onehot", "rheo", "ot"):
        hits = 0
        for i in range(n_draws):
            ch = children_tokens(tok, m, K, V, m + int(ys[i]))
            x = coupling_sample(p, tok, sq, V, m, K, ch[m], verifier, float(us[i]), gs[i])
            hits += x in ch
        a = accept_prob(p, tok, sq, V, m, K, verifier)
        sd = math.sqrt(a * (1 - a) / n_draws)
        assert abs(hits / n_draws - a) < 5 * sd, (verifier, hits / n_draws, a)


def _tree_and_logits(V=5, seed=0, T=1.0, **cfg):
    from rheoplan.models.functional import hashed_context_lm
    from rheoplan.testing.oracle import functional_draft_fn

    tgt, drf = hashed_context_lm(V, seed=seed), hashed_context_lm(V, seed=seed + 100)
    ctx = (0, 1)
    s = SamplingConfig(temperature=T)
    tc = TreeConfig(**{"depth": 3, "frontier": 2, "slots": 3, "budget": 6, "support": V, **cfg})
    t = plan_tree(functional_draft_fn(drf, ctx), [ctx[-1]], tree=tc, sampling=s, seed=seed)
    calls = []

    def logits_at(i):
        calls.append(i)
        toks, j = [], i
        while j > 0:
            toks.append(int(t.linear.token[0, j]))
            j = int(t.linear.parent[0, j])
        return tgt([ctx + tuple(toks[::-1])])[0]

    return t, logits_at, calls, s, tc, tgt


@pytest.mark.parametrize("verifier", ["onehot", "rheo", "ot"])
def test_walk_is_a_kept_path_and_lazy(verifier):
    for seed in range(5):
        t, logits_at, calls, s, tc, _ = _tree_and_logits(seed=seed, verifier=verifier)
        r = walk(t, 0, logits_at, s, verifier, Streams(seed), 0)
        lin = t.linear
        assert r.path[0] == 0 and r.nodes[0] == 0
        assert calls == r.path and r.visited == len(r.path)
        for a, c in zip(r.path, r.path[1:]):
            assert int(lin.parent[0, c]) == a
        assert r.nodes == [int(lin.node[0, i]) for i in r.path]
        assert r.emitted[:-1] == [int(lin.token[0, i]) for i in r.path[1:]]
        assert len(r.emitted) == len(r.path)
        # the extra token is not a kept child of the last node
        last = r.path[-1]
        f, k = int(lin.first_child[0, last]), int(lin.n_children[0, last])
        assert r.emitted[-1] not in [int(lin.token[0, c]) for c in range(f, f + k)] if f >= 0 else True
        # reproducible from the seed
        assert walk(t, 0, logits_at, s, verifier, Streams(seed), 0).emitted == r.emitted


def test_walk_greedy_parity_one_step():
    for seed in range(5):
        t, logits_at, _, s, _, tgt = _tree_and_logits(seed=seed, T=0.0)
        r = walk(t, 0, logits_at, s, "ot", Streams(seed), 0)
        ctx = (0, 1)
        for x in r.emitted:
            assert x == int(torch.argmax(tgt([ctx])[0]))
            ctx = ctx + (x,)


def test_walk_draws_residual_noise_only_where_used():
    """An accepted proposal draws no residual noise, and the walk's tokens are those of
    ``coupling_sample`` with the dense noise at every node (the path the walk took before
    it drew lazily)."""
    class Counting(Streams):
        def __init__(self, seed):
            super().__init__(seed)
            self.residual = 0

        def uniform(self, step, tree, node, purpose, n):
            self.residual += purpose == Purpose.VERIFY_RESIDUAL
            return super().uniform(step, tree, node, purpose, n)

    saw_accept = False
    for seed in range(8):
        for verifier in ("rheo", "ot"):
            t, logits_at, _, s, _, _ = _tree_and_logits(seed=seed, verifier=verifier)
            st_ = Counting(seed)
            r = walk(t, 0, logits_at, s, verifier, st_, 0)
            # dense replay: the old walk, noise at every node
            lin, out, i = t.linear, [], 0
            while True:
                p = target_probs(logits_at(i), s)
                v, row = int(lin.node[0, i]), int(lin.exp_row[0, i])
                g = Streams(seed).gumbel(0, 0, v, Purpose.VERIFY_RESIDUAL, p.shape[-1])
                if row < 0:
                    x = int(torch.argmax(torch.log(p) + g))
                else:
                    u = float(Streams(seed).uniform(0, 0, v, Purpose.VERIFY_ACCEPT, 1)[0])
                    x = coupling_sample(p, t.sup_token[0, row], t.sup_q[0, row], int(t.sup_n[0, row]),
                                        t.rheostat, t.slots, int(t.y_token[0, row]), verifier, u, g)
                out.append(x)
                kids = {int(lin.token[0, c]): c for c in range(int(lin.first_child[0, i]),
                                                               int(lin.first_child[0, i]) + int(lin.n_children[0, i]))}
                if x not in kids:
                    break
                i = kids[x]
            assert r.emitted == out
            assert st_.residual <= len(r.path)
            saw_accept |= st_.residual < len(r.path)
    assert saw_accept


def _draw_cases(scales=(0.1, 1.0, 3.0, 10.0, 30.0), V=4096, R=8, per_scale=6):
    """(p, u) pairs [R, V]: flat to peaked target laws, half of them truncated (zeros, as
    top-k / top-p leave them), with the uniforms of the residual streams."""
    gen = torch.Generator().manual_seed(0)
    s = Streams(11)
    for i, scale in enumerate(scales):
        for j in range(per_scale):
            p = torch.softmax(torch.randn(R, V, generator=gen, dtype=torch.float64) * scale, -1)
            if j % 2:
                p[:, torch.randperm(V, generator=gen)[: V // 2]] = 0.0
                p = p / p.sum(-1, keepdim=True)
            u = torch.stack([s.uniform(i, j, r, Purpose.VERIFY_RESIDUAL, V) for r in range(R)])
            yield p, u


def _mismatches() -> int:
    return sum(int((gumbel_max_uniform(p, u) != gumbel_max(p, gumbel_from_uniform(u))).sum())
               for p, u in _draw_cases())


def test_gumbel_max_uniform_equals_gumbel_max():
    """The filtered draw is the dense Gumbel-max, token for token (240 rows, flat to peaked,
    with and without zeros); and the test sees a filter that is too strict."""
    assert _mismatches() == 0


def test_gumbel_max_uniform_test_catches_a_too_strict_filter(monkeypatch):
    import rheoplan.verify as verify

    monkeypatch.setattr(verify, "FILTER_SLACK", -0.9)  # keeps only tokens with 1 - u <= p e^-B / 10
    assert _mismatches() > 0


@FAST
@given(rst.vocab_sizes(), st.integers(1, 4), st.integers(0, 2**32), st.data())
def test_gumbel_max_uniform_equals_gumbel_max_any_law(V, R, seed, data):
    s = data.draw(rst.sampling_configs(V, temperatures=(0.5, 1.0, 1.5)))
    p = torch.stack([target_probs(data.draw(rst.logit_rows(V)), s) for _ in range(R)])
    u = torch.stack([Streams(seed).uniform(0, r, 0, Purpose.VERIFY_RESIDUAL, V) for r in range(R)])
    assert torch.equal(gumbel_max_uniform(p, u), gumbel_max(p, gumbel_from_uniform(u)))


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0, top_k=2),
                                      SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)],
                         ids=["greedy", "greedy-topk", "T1", "T0.7-topp"])
def test_walk_roots_draws_each_rows_walk_token(sampling):
    """``walk_roots`` (a batch's draft-free rows in one call; greedy rows take the argmax of
    the processed scores without building the one-hot law) emits, row by row, the token
    ``walk`` emits at the same root: ties to the lowest id included."""
    from rheoplan.decode import root_only_rows

    g = torch.Generator().manual_seed(5)
    R, V = 6, 50
    logits = 3 * torch.randn(R, V, generator=g)
    logits[1, [7, 3]] = logits[1].max() + 1.0  # a tie for the best token: the lowest id wins
    logits[2, :] = 0.0  # every token tied
    tree = root_only_rows(list(range(R)), [4] * R, TreeConfig(depth=1, frontier=1, slots=2, budget=1))
    s, steps, keys = Streams(11), [3, 4, 5, 6, 7, 8], [9, 2, 0, 5, 1, 3]
    nodes = tree.linear.node[:, 0].tolist()
    got = walk_roots(logits, sampling, s, steps, keys, nodes)
    want = [walk(tree, b, lambda i, b=b: logits[b], sampling, "ot", s, steps[b], key=keys[b]).emitted[0]
            for b in range(R)]
    assert got == want
    if sampling.greedy:
        assert got[1] == 3 and got[2] == 0


@pytest.mark.parametrize("verifier", ["onehot", "rheo", "ot"])
def test_greedy_walk_is_the_couplings_walk(verifier):
    """A greedy walk reads only the argmax at each node and draws nothing. It must take the
    path and emit the tokens that the couplings give with the one-hot law, whatever the
    noise: the reference couplings and the numba node draws, run with a sampled law that
    is exactly that one-hot (every other logit 1e4 below). On trees planned greedy (no
    sampled slot) and sampled (a proposal Y at every expanded node, which the coupling
    accepts or rejects)."""
    from rheoplan.kernels.verify.cpu import NodeDrawer

    greedy, sampled = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
    accepted = rejected = proposals = 0
    for seed in range(12):
        for planned in (0.0, 1.0):
            t, logits_at, _, _, _, _ = _tree_and_logits(V=6, seed=seed, T=planned, verifier=verifier)
            got = walk(t, 0, logits_at, greedy, verifier, Streams(seed), 3)

            def one_hot_at(i):
                x = logits_at(i)
                return torch.where(torch.arange(x.shape[-1]) == int(torch.argmax(x)), 0.0, -1e4)

            for noise_seed in (seed, seed + 1000):
                want = walk(t, 0, one_hot_at, sampled, verifier, Streams(noise_seed), 3)
                drawer = NodeDrawer(t, 0, verifier, noise_seed, 3, 0, int(Purpose.VERIFY_ACCEPT),
                                    int(Purpose.VERIFY_RESIDUAL))
                lowered = walk(t, 0, one_hot_at, sampled, verifier, Streams(noise_seed), 3, node_draw=drawer)
                assert (got.path, got.emitted, got.visited) == (want.path, want.emitted, want.visited)
                assert (lowered.path, lowered.emitted) == (want.path, want.emitted)
            accepted += len(got.path) > 1
            rejected += int(t.linear.n_children[0, got.path[-1]]) > 0  # a drafted node whose children all lost
            rows = [int(t.linear.exp_row[0, i]) for i in got.path]
            proposals += sum(1 for r in rows if r >= 0 and int(t.y_token[0, r]) >= 0)
    assert accepted and rejected and proposals


def test_greedy_walk_takes_the_callers_greedy_tokens():
    """``greedy_at``: a greedy walk uses the tokens the caller computed (the batched loop's
    one pass over every row's prefetched nodes) and reads the logits only where it gave
    None; with the true greedy tokens it walks exactly as without them. Wrong tokens are
    followed (the walk trusts its caller), which shows they are read at all."""
    greedy = SamplingConfig(temperature=0.0)
    for seed in range(8):
        t, logits_at, _, _, _, _ = _tree_and_logits(V=6, seed=seed, T=1.0, verifier="rheo")
        want = walk(t, 0, logits_at, greedy, "rheo", Streams(seed), 3)
        known = {i: int(torch.argmax(logits_at(i))) for i in want.path[:1]}  # the root, as a caller would
        read = []

        def counting(i):
            read.append(i)
            return logits_at(i)

        got = walk(t, 0, counting, greedy, "rheo", Streams(seed), 3, greedy_at=known.get)
        assert (got.path, got.emitted, got.visited) == (want.path, want.emitted, want.visited)
        assert 0 not in read and read == want.path[1:]
        wrong = (known[0] + 1) % 6
        off = walk(t, 0, logits_at, greedy, "rheo", Streams(seed), 3, greedy_at={0: wrong}.get)
        assert off.emitted[0] == wrong
