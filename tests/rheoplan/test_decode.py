"""The real decode loop ``plan_and_decode`` (not the oracle's ``functional_decode``):
statistical losslessness, greedy parity with transformers, KV-cache integrity, EOS and
truncation inside an accepted path, and the power of the statistical test (mutations).

Statistics (docs/method.md §7.3): each case runs ``plan_and_decode`` once per seed
``SEED0 + r`` for ``r < runs`` and compares the law of the first ``n`` emitted tokens
with the exact law by Pearson chi-square. The first token of every decode comes from the
prompt's forward (step 0 has no tree: ``TargetModel.start_and_root``), so ``n`` is one more
than the tokens a case wants from its trees (``rheoplan.testing.chi_square``, cells pooled
to >= 5 expected). A case fails when p < ALPHA = 1e-3: a correct implementation fails
one given case with probability 1e-3 over the choice of seeds. The seeds are fixed, so
the suite is deterministic; a change to any random-number mapping re-draws the seeds at
that same false-alarm rate per case. The exact law is ``target_law`` (the target's own
product law); for FunctionalLM cases ``exact_law`` (the decode's enumerated law) is
checked equal to it first, so a failure points at the loop, not the method.
"""

from __future__ import annotations

import pytest
import torch

from _decode_models import (chain_lm, check_cache_matches_fresh_forward, greedy_reference,
                            hf_as_functional, random_eagle3_head, tiny_llama)
from rheoplan import SamplingConfig, TreeConfig
from rheoplan.decode import plan_and_decode
from rheoplan.models.functional import hashed_context_lm
from rheoplan.models.hf_target import HFTarget
from rheoplan.testing import chi_square, exact_law, mutation, target_law, total_variation

ALPHA = 1e-3
SEED0 = 1000
PREFIX = [0, 1]


# Tiny forwards on a shared 2-core machine: one intra-op thread is ~5x faster than many.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _assert_chi_square(res, mutations, record_property) -> None:
    """A lossless run passes the chi-square at ALPHA (and never emits an impossible
    sequence); a mutated (lossy) run must be caught at p < 1e-6."""
    record_property("pvalue", res.pvalue)
    if mutations:
        assert res.pvalue < 1e-6, res
    else:
        assert res.unexpected == 0, res
        assert res.pvalue >= ALPHA, res


def _sample(target, draft, n, runs, *, tree, sampling, mutations=frozenset(), prefix=PREFIX):
    """``runs`` decodes (seeds SEED0 + r), with the lossy switches ``mutations`` on."""
    with mutation(*mutations):
        return [tuple(plan_and_decode(target, draft, prefix, max_new_tokens=n, sampling=sampling, tree=tree,
                                      seed=SEED0 + r).tokens)
                for r in range(runs)]


# --------------------------------------------------------------------------------------
# Statistical losslessness, FunctionalLM pairs
# --------------------------------------------------------------------------------------

FUNCTIONAL_CASES = {
    # name: (V, target seed, draft seed, sharpness, n tokens, runs, tree, sampling)
    "ot_m1_v4": (4, 3, 4, 2.0, 3, 1000,
                 TreeConfig(depth=2, frontier=2, slots=2, budget=3, rheostat=1, support=4, verifier="ot"),
                 SamplingConfig(temperature=1.0)),
    "rheo_m0_v5_topk": (5, 5, 6, 1.0, 3, 1000,
                        TreeConfig(depth=2, frontier=1, slots=2, budget=3, rheostat=0, support=5, verifier="rheo"),
                        SamplingConfig(temperature=0.8, top_k=4)),
    "ot_m2of3_v5_3tok_topp": (5, 7, 8, 1.5, 4, 1000,
                              TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=2, support=5,
                                         verifier="ot"),
                              SamplingConfig(temperature=1.0, top_p=0.9)),
    "onehot_eagle_v4": (4, 9, 10, 1.5, 3, 1000, TreeConfig.eagle(depth=2, frontier=2, slots=2, budget=3, support=4),
                        SamplingConfig(temperature=1.0)),
}


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("name", sorted(FUNCTIONAL_CASES))
def test_functional_decode_loop_matches_exact_law(name, record_property):
    V, ts, ds, sh, n, runs, cfg, s = FUNCTIONAL_CASES[name]
    tgt, drf = hashed_context_lm(V, seed=ts, sharpness=sh), hashed_context_lm(V, seed=ds, sharpness=sh)
    law = target_law(tgt, PREFIX, n, s)
    assert total_variation(exact_law(tgt, drf, PREFIX, n, tree=cfg, sampling=s), law) <= 1e-9
    res = chi_square(law, _sample(tgt, drf, n, runs, tree=cfg, sampling=s))
    record_property("pvalue", res.pvalue)
    assert res.unexpected == 0, res
    assert res.pvalue >= ALPHA, res


# --------------------------------------------------------------------------------------
# Statistical losslessness, tiny HF Llama pair through the real adapters
# --------------------------------------------------------------------------------------

HF_CASES = {
    # name: (draft kind, n tokens, runs, tree, sampling)
    "llama_pair_ot_m1": ("llama", 3, 500,
                         TreeConfig(depth=2, frontier=2, slots=2, budget=3, rheostat=1, support=6, verifier="ot"),
                         SamplingConfig(temperature=1.0)),
    "early_exit_rheo_topk": ("early_exit", 3, 500,
                             TreeConfig(depth=3, frontier=1, slots=2, budget=3, rheostat=1, support=6,
                                        verifier="rheo"),
                             SamplingConfig(temperature=0.7, top_k=4)),
}


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_hf_decode_loop_matches_exact_law(name, record_property):
    """Through HFTarget/HFDraft (KV cache, tree masks, compaction) on a vocabulary of 6.

    The exact law comes from a plain full-path forward of the target (``hf_as_functional``),
    so the cache and mask machinery is compared with a computation that has none."""
    from rheoplan.models.early_exit import early_exit_draft

    kind, n, runs, cfg, s = HF_CASES[name]
    target = tiny_llama(0, layers=2)
    draft = tiny_llama(1) if kind == "llama" else early_exit_draft(target, 1)
    law = target_law(hf_as_functional(target), PREFIX, n, s)
    res = chi_square(law, _sample(target, draft, n, runs, tree=cfg, sampling=s))
    record_property("pvalue", res.pvalue)
    assert res.unexpected == 0, res
    assert res.pvalue >= ALPHA, res


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("mutations", [frozenset(), frozenset({"raw_q_ratio"})], ids=["exact", "raw_q_ratio"])
def test_hf_decode_loop_bf16_target_matches_exact_law(mutations, record_property):
    """The CLI's configuration on AMX CPUs: a bfloat16 target with a float32 draft. The
    tree forward's logits may differ from a plain forward's by bf16 rounding; the sampled
    law must still match the plain forward's law within what the test can see, and the
    same test must catch a lossy verifier (control (b)) on this pair."""
    kind, n, runs, cfg, s = HF_CASES["llama_pair_ot_m1"]
    cfg = cfg.with_(verifier="rheo") if mutations else cfg
    target = tiny_llama(0, layers=2, dtype=torch.bfloat16)
    law = target_law(hf_as_functional(target), PREFIX, n, s)
    res = chi_square(law, _sample(target, tiny_llama(1), n, runs, tree=cfg, sampling=s, mutations=mutations))
    _assert_chi_square(res, mutations, record_property)


# --------------------------------------------------------------------------------------
# Power: the same test fails for deliberately lossy variants run through the real loop
# --------------------------------------------------------------------------------------

#: docs/method.md §7.4 (b): exact TV of raw_q_ratio on this case is 0.147 (test_mutation_controls).
RAW_Q_CASE = (4, 0, 50, 1.5, 3, TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=1, support=4,
                                           verifier="rheo"), SamplingConfig(temperature=1.0))


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("mutations", [frozenset(), frozenset({"raw_q_ratio"})], ids=["exact", "raw_q_ratio"])
def test_mutation_b_raw_q_ratio_detected_through_the_loop(mutations, record_property):
    V, ts, ds, sh, n, cfg, s = RAW_Q_CASE
    tgt, drf = hashed_context_lm(V, seed=ts, sharpness=sh), hashed_context_lm(V, seed=ds, sharpness=sh)
    law = target_law(tgt, PREFIX, n, s)
    res = chi_square(law, _sample(tgt, drf, n, 800, tree=cfg, sampling=s, mutations=mutations))
    record_property("pvalue", res.pvalue)
    if mutations:
        assert res.pvalue < 1e-9, res  # detected, far below ALPHA
    else:
        assert res.pvalue >= ALPHA, res  # control of the control: same case, same seeds


@pytest.mark.no_ir_lint
def test_mutation_c_reused_draft_stream_detected_through_the_loop(record_property):
    """Control (c): verification reading the draft stream (``mutation('reuse_draft_stream')``)."""
    V, ts, ds, sh, n, runs, cfg, s = FUNCTIONAL_CASES["ot_m1_v4"]
    tgt, drf = hashed_context_lm(V, seed=ts, sharpness=sh), hashed_context_lm(V, seed=ds, sharpness=sh)
    law = target_law(tgt, PREFIX, n, s)
    res = chi_square(law, _sample(tgt, drf, n, runs, tree=cfg, sampling=s, mutations={"reuse_draft_stream"}))
    record_property("pvalue", res.pvalue)
    assert res.pvalue < 1e-9, res


# --------------------------------------------------------------------------------------
# Greedy parity with transformers' generate
# --------------------------------------------------------------------------------------

GREEDY = SamplingConfig(temperature=0.0)
V_GREEDY = 32
TREES = {
    "rheo": TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=V_GREEDY),
    "eagle": TreeConfig.eagle(depth=3, frontier=2, slots=3, budget=6, support=V_GREEDY),
    "chain": TreeConfig.chain(depth=3, support=V_GREEDY),
}


@pytest.fixture(scope="module")
def greedy_models():
    """A 4-layer target (EAGLE-3 capture needs >= 4 layers), an unrelated 2-layer draft,
    and a random EAGLE-3 head with a reduced draft vocabulary (24 of 32 ids)."""
    target = tiny_llama(2, vocab=V_GREEDY, hidden=32, layers=4, head_scale=20.0)
    draft = tiny_llama(3, vocab=V_GREEDY, hidden=32, layers=2, head_scale=20.0)
    return target, draft, random_eagle3_head(V_GREEDY, 24, seed=5)


def _draft(kind, models):
    from rheoplan.models.eagle3 import Eagle3Draft
    from rheoplan.models.early_exit import early_exit_draft

    target, draft, head = models
    if kind == "llama":
        return draft
    if kind == "early_exit":
        return early_exit_draft(target, 1)
    return Eagle3Draft(head, target.get_input_embeddings(), features_from=target)


@pytest.mark.parametrize("tree_name", sorted(TREES))
@pytest.mark.parametrize("draft_kind", ["llama", "early_exit", "eagle3"])
def test_greedy_parity_with_generate(greedy_models, draft_kind, tree_name):
    target = greedy_models[0]
    prompt, n = [1, 2, 3, 4], 16
    want = greedy_reference(target, prompt, n)
    r = plan_and_decode(target, _draft(draft_kind, greedy_models), prompt, max_new_tokens=n,
                        sampling=GREEDY, tree=TREES[tree_name], seed=0)
    assert r.tokens == want
    assert r.stopped_by == "max_new_tokens"
    # the adapter built inside the loop removed its EAGLE-3 capture hooks from the model
    assert sum(len(layer._forward_pre_hooks) for layer in target.model.layers) == 0


@pytest.mark.parametrize("tree_name", sorted(TREES))
def test_greedy_parity_bf16_target_fp32_head(greedy_models, tree_name):
    """What ``rheoplan generate --dtype bfloat16`` runs: bf16 target, float32 EAGLE-3 head
    (its inputs, the target's bf16 features, are cast to the head's dtype)."""
    import copy

    target = copy.deepcopy(greedy_models[0]).to(torch.bfloat16)
    prompt, n = [1, 2, 3, 4], 16
    want = greedy_reference(target, prompt, n)
    r = plan_and_decode(target, _draft("eagle3", (target,) + tuple(greedy_models[1:])), prompt,
                        max_new_tokens=n, sampling=GREEDY, tree=TREES[tree_name], seed=0)
    assert r.tokens == want


def test_eagle3_prompt_features_come_from_the_target_prefill(greedy_models, monkeypatch):
    """A head told to read features from the target model reuses the target adapter's
    capturing prefill instead of running a second prompt forward (and stays exact)."""
    from rheoplan.models import hf_target

    target = greedy_models[0]
    starts = []
    original = hf_target.HFTarget._prefill

    def counting_start(self, ids, with_root):
        starts.append(len(ids))
        return original(self, ids, with_root)

    monkeypatch.setattr(hf_target.HFTarget, "_prefill", counting_start)
    prompt = [1, 2, 3, 4]
    r = plan_and_decode(target, _draft("eagle3", greedy_models), prompt, max_new_tokens=10,
                        sampling=GREEDY, tree=TREES[sorted(TREES)[0]], seed=0)
    assert starts == [len(prompt)], "the draft ran its own prompt prefill"
    assert r.tokens == greedy_reference(target, prompt, 10)


@pytest.mark.parametrize("with_draft", [False, True], ids=["autoregressive", "tree"])
def test_first_token_comes_from_the_prompts_forward(greedy_models, monkeypatch, with_draft):
    """Step 0 draws the first token from the prefill's last position (as ``generate`` does):
    one model forward for the prompt, then one verify forward per later step, and the
    same greedy tokens."""
    calls = []
    original = HFTarget.forward_tree

    def counting(self, linear):
        calls.append(int(linear.n[0]))
        return original(self, linear)

    monkeypatch.setattr(HFTarget, "forward_tree", counting)
    target, prompt, n = greedy_models[0], [3, 1, 4], 9
    draft = _draft("llama", greedy_models) if with_draft else None
    r = plan_and_decode(target, draft, prompt, max_new_tokens=n, sampling=GREEDY, seed=0,
                        tree=TREES[sorted(TREES)[0]])
    assert r.tokens == greedy_reference(target, prompt, n)
    assert len(calls) == len(r.steps) - 1  # step 0 ran no verify forward
    assert (r.steps[0].tree_size, r.steps[0].emitted, r.steps[0].drafted) == (0, 1, False)


@pytest.mark.no_ir_lint
def test_served_first_token_off_by_one_is_detected_through_the_loop(record_property):
    """Control of the served step (``served_root_stale``): the first token drawn from the
    output at the prompt's second-to-last token, through the HF adapters (a total variation
    of 0.15 from the right law on this case). The law of the first token sees it; the exact
    case above passes the same statistic on its own samples."""
    kind, n, runs, cfg, s = HF_CASES["llama_pair_ot_m1"]
    target = tiny_llama(0, layers=2)
    fn = hf_as_functional(target)
    pvals = []
    for mutations in ((), ("served_root_stale",)):
        got = _sample(target, tiny_llama(1), n, runs, tree=cfg, sampling=s, mutations=mutations)
        pvals.append(chi_square(target_law(fn, PREFIX, 1, s), [x[:1] for x in got]).pvalue)
    record_property("pvalue", pvals)
    assert pvals[0] >= ALPHA and pvals[1] < 1e-6, pvals


def test_greedy_parity_autoregressive(greedy_models):
    target = greedy_models[0]
    prompt = [7]
    r = plan_and_decode(target, None, prompt, max_new_tokens=12, sampling=GREEDY, seed=0)
    assert r.tokens == greedy_reference(target, prompt, 12)
    assert len(r.steps) == 12 and all(s.tree_size == 0 for s in r.steps)


# --------------------------------------------------------------------------------------
# KV-cache integrity after many sampled steps
# --------------------------------------------------------------------------------------

def test_compacted_cache_equals_fresh_forward():
    model = tiny_llama(11, vocab=16, hidden=32, layers=2, head_scale=3.0)
    draft = tiny_llama(12, vocab=16, hidden=32, layers=1, head_scale=3.0)
    prompt = [1, 5, 9]
    adapter = HFTarget(model)  # passed as is, so its cache can be inspected afterwards
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=16)
    r = plan_and_decode(adapter, draft, prompt, max_new_tokens=40, tree=cfg, seed=3,
                        sampling=SamplingConfig(temperature=1.0))
    assert len(r.tokens) == 40 and len(r.steps) > 5
    assert sum(s.accepted for s in r.steps) > 0, "no drafted token was ever accepted: a weak test"
    assert adapter.cached_len > len(prompt) + 20
    check_cache_matches_fresh_forward(adapter, model, prompt + r.tokens)


def test_compacted_cache_every_step():
    """Same check after every step (the decode is re-run with max_new_tokens = t)."""
    model = tiny_llama(13, vocab=8, hidden=16, layers=2, head_scale=3.0)
    draft = tiny_llama(14, vocab=8, hidden=16, layers=1, head_scale=3.0)
    prompt = [2, 3]
    cfg = TreeConfig(depth=3, frontier=2, slots=2, budget=5, rheostat=1, support=8, verifier="rheo")
    full = plan_and_decode(model, draft, prompt, max_new_tokens=24, tree=cfg, seed=9).tokens
    for t in range(2, 25, 3):
        adapter = HFTarget(model)
        r = plan_and_decode(adapter, draft, prompt, max_new_tokens=t, tree=cfg, seed=9)
        assert r.tokens == full[:t]  # a prefix of the longer decode: same seed, same draws
        check_cache_matches_fresh_forward(adapter, model, prompt + r.tokens)


# --------------------------------------------------------------------------------------
# EOS inside an accepted path; max_new_tokens truncation mid-path
# --------------------------------------------------------------------------------------

CHAIN_TREE = TreeConfig(depth=6, frontier=1, slots=2, budget=6, rheostat=1, support=8)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_inside_accepted_path_stops_there(temperature):
    lm = chain_lm(8)  # draft == target: next = last + 1, so the whole chain is accepted
    r = plan_and_decode(lm, lm, [0], max_new_tokens=20, tree=CHAIN_TREE, eos_token_id=3, seed=1,
                        sampling=SamplingConfig(temperature=temperature))
    assert r.tokens == [1, 2, 3]
    assert r.stopped_by == "eos"
    assert len(r.steps) == 2
    # step 0: token 1 from the prompt's forward (no tree); step 1: the chain from root 1
    assert (r.steps[0].tree_size, r.steps[0].emitted, r.steps[0].drafted) == (0, 1, False)
    assert r.steps[1].accepted == 6  # the walk went past EOS; the output did not
    assert r.steps[1].emitted == 2


def test_first_of_several_eos_stops():
    lm = chain_lm(8)
    r = plan_and_decode(lm, lm, [0], max_new_tokens=20, tree=CHAIN_TREE, eos_token_id={5, 2}, seed=1)
    assert r.tokens == [1, 2] and r.stopped_by == "eos"


def test_eos_in_a_later_step_and_in_the_prompt():
    lm = chain_lm(8)
    # EOS 3 is in the prompt (ignored) and first emitted in step 2 (after 7 tokens: 4..7,0,1,2,3)
    r = plan_and_decode(lm, lm, [3], max_new_tokens=20, tree=CHAIN_TREE, eos_token_id=3, seed=1)
    assert r.tokens == [4, 5, 6, 7, 0, 1, 2, 3]
    assert r.stopped_by == "eos" and len(r.steps) == 2


def test_max_new_tokens_truncates_mid_path():
    lm = chain_lm(8)
    r = plan_and_decode(lm, lm, [0], max_new_tokens=3, tree=CHAIN_TREE, eos_token_id=4, seed=1)
    assert r.tokens == [1, 2, 3]
    assert r.stopped_by == "max_new_tokens"
    assert len(r.steps) == 2 and r.steps[1].accepted == 6 and r.steps[1].emitted == 2


def test_eos_exactly_at_the_limit_counts_as_eos():
    lm = chain_lm(8)
    r = plan_and_decode(lm, lm, [0], max_new_tokens=3, tree=CHAIN_TREE, eos_token_id=3, seed=1)
    assert r.tokens == [1, 2, 3] and r.stopped_by == "eos"


def test_eos_inside_accepted_path_hf():
    """The same through the HF adapters: target == draft at T=0 accepts the whole greedy chain."""
    model = tiny_llama(2, vocab=V_GREEDY, hidden=32, layers=2, head_scale=20.0)
    prompt = [1, 2, 3]
    ref = greedy_reference(model, prompt, 8)
    eos = ref[3]
    cut = ref.index(eos) + 1
    r = plan_and_decode(model, model, prompt, max_new_tokens=8, sampling=GREEDY, eos_token_id=eos, seed=0,
                        tree=TreeConfig(depth=6, frontier=1, slots=2, budget=6, support=V_GREEDY))
    assert r.tokens == ref[:cut] and r.stopped_by == "eos"
    assert r.steps[0].emitted == 1 and not r.steps[0].drafted  # served by the prompt's forward
    assert r.steps[1].accepted >= cut - 1  # EOS was accepted mid-path (draft == target)


# --------------------------------------------------------------------------------------
# The cost model plans the trees (online calibration, drafting schedule)
# --------------------------------------------------------------------------------------


def _cost(slope: float, draft_ms: float = 0.5, overhead: float = 0.5):
    from rheoplan.costmodel import CostModel, Timings

    return CostModel(Timings((1, 64), (10.0, 10.0 + 63 * slope), (12.0, 12.0 + 63 * slope), 0, 1000,
                             (1, 4), (draft_ms, 2 * draft_ms), overhead, overhead))


def _optimistic_priors(cost):
    """``cost`` with a prior (T = 1) that believes every drafted node is accepted: big trees."""
    from rheoplan.costmodel import Calibration, CostModel

    sure = Calibration()
    for c in range(len(sure.trials)):
        sure.trials[c] = [40.0] * len(sure.trials[c])
        sure.accepts[c] = [40.0] * len(sure.accepts[c])
    sure.cont_trials = [40.0] * len(sure.cont_trials)
    sure.cont_accepts = [40.0] * len(sure.cont_accepts)
    return CostModel(cost.timings, priors=((1.0, sure),)), sure


@pytest.mark.no_ir_lint
@pytest.mark.parametrize("slope,mutations,prior", [(1.0, (), False), (5.0, (), False), (5.0, (), True),
                                                   (1.0, ("reuse_draft_stream",), False),
                                                   (5.0, ("reuse_draft_stream",), True)],
                         ids=["exact-slope1", "exact-slope5", "exact-prior", "reuse_draft_stream",
                              "reuse_draft_stream-prior"])
def test_cost_model_decode_loop_matches_target_law(slope, mutations, prior, record_property):
    """Trees that change step to step with the online calibration (and AR steps when no
    tree pays) keep the output law: chi-square against the exact target law, also when the
    decode starts from a head's prior (an optimistic one: bigger trees). The same test
    catches a lossy loop (control (c): verification reading the draft stream)."""
    tgt, drf = hashed_context_lm(4, seed=3, sharpness=2.0), hashed_context_lm(4, seed=4, sharpness=2.0)
    s = SamplingConfig(temperature=1.0)
    cfg = TreeConfig(depth=3, frontier=2, slots=2, budget=6, rheostat=1, support=4, verifier="ot")
    n = 3
    law = target_law(tgt, PREFIX, n, s)
    cost = _optimistic_priors(_cost(slope))[0] if prior else _cost(slope)
    samples, sizes, drafted = [], set(), set()
    with mutation(*mutations):
        for r in range(800):
            res = plan_and_decode(tgt, drf, PREFIX, max_new_tokens=n, sampling=s, tree=cfg, seed=SEED0 + r,
                                  cost_model=cost)
            samples.append(tuple(res.tokens))
            sizes |= {st.tree_size for st in res.steps}
            drafted |= {st.drafted for st in res.steps}
    # the cost model really chose different trees; the sure prior, the whole budget
    assert len(sizes) >= 2 if not prior else cfg.budget in sizes
    res = chi_square(law, samples)
    _assert_chi_square(res, mutations, record_property)


@pytest.mark.parametrize("slope", [0.0, 0.5, 50.0])
@pytest.mark.parametrize("draft_kind", ["llama", "eagle3"])
def test_cost_model_greedy_parity_and_determinism(greedy_models, draft_kind, slope):
    target = greedy_models[0]
    prompt, n = [1, 2, 3, 4], 20
    cost = _cost(slope)
    before = cost.fresh_calibration()
    tree = TreeConfig(depth=5, frontier=2, slots=3, budget=16, rheostat=1, support=V_GREEDY)
    runs = [plan_and_decode(target, _draft(draft_kind, greedy_models), prompt, max_new_tokens=n,
                            sampling=GREEDY, tree=tree, seed=0, cost_model=cost) for _ in range(2)]
    assert runs[0].tokens == greedy_reference(target, prompt, n)
    assert [st.tree_size for st in runs[0].steps] == [st.tree_size for st in runs[1].steps]
    assert cost.fresh_calibration() == before  # each decode calibrates its own copy
    if slope == 50.0:  # verify tokens are dear: no tree pays, yet every step asks again (no back-off)
        later = runs[0].steps[1:]  # (step 0 is served by the prompt's forward)
        assert all(st.drafted and st.tree_size == 0 for st in later), [(st.drafted, st.tree_size) for st in later]
    for st in runs[0].steps:
        assert st.predicted_tokens is not None and st.predicted_tokens >= 1.0


def test_a_head_prior_is_the_decodes_starting_calibration():
    """``CostModel(priors=...)`` at T = 1 decodes exactly as the same calibration passed
    explicitly; the prior changes the trees (it believes every node is accepted)."""
    from rheoplan.costmodel import CostModel

    tgt, drf = hashed_context_lm(6, seed=1, sharpness=1.5), hashed_context_lm(6, seed=2, sharpness=1.5)
    cfg = TreeConfig(depth=4, frontier=2, slots=3, budget=10, rheostat=1, support=6)
    with_priors, sure = _optimistic_priors(_cost(2.0))
    runs = [plan_and_decode(tgt, drf, PREFIX, max_new_tokens=30, tree=cfg, seed=7, cost_model=c)
            for c in (with_priors, CostModel(with_priors.timings, sure), _cost(2.0))]
    assert runs[0].tokens == runs[1].tokens
    assert [st.tree_size for st in runs[0].steps] == [st.tree_size for st in runs[1].steps]
    assert [st.tree_size for st in runs[0].steps] != [st.tree_size for st in runs[2].steps]
    assert with_priors.fresh_calibration(1.0) == sure  # each decode calibrated its own copy


def test_cost_model_sampled_tokens_repeat_with_the_same_seed():
    tgt, drf = hashed_context_lm(6, seed=1, sharpness=1.5), hashed_context_lm(6, seed=2, sharpness=1.5)
    cfg = TreeConfig(depth=4, frontier=2, slots=3, budget=10, rheostat=1, support=6)
    a, b = (plan_and_decode(tgt, drf, PREFIX, max_new_tokens=30, tree=cfg, seed=7, cost_model=_cost(0.3)).tokens
            for _ in range(2))
    assert a == b
    with pytest.raises(TypeError, match="cost_model=.*allowed None or a rheoplan.costmodel.CostModel"):
        plan_and_decode(tgt, drf, PREFIX, max_new_tokens=3, tree=cfg, cost_model="auto")


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("slope", [0.3, 2.0])
def test_cost_model_fused_plan_decodes_as_the_pass_list(monkeypatch, temperature, slope):
    """The decode's own plan runs the cost pipeline fused (``kernels/plan/cpu_pipeline``);
    the same decode through the pass list (``passes=DEFAULT_PIPELINE``, which a decode
    never fuses) gives the same tokens, trees and predictions, step by step."""
    from rheoplan.kernels.plan import cpu_pipeline
    from rheoplan.planner.default import DEFAULT_PIPELINE

    fused = []
    real = cpu_pipeline.plan_cost_tree
    monkeypatch.setattr("rheoplan.decode.plan_cost_tree", lambda *a, **k: fused.append(1) or real(*a, **k))
    tgt, drf = hashed_context_lm(6, seed=1, sharpness=1.5), hashed_context_lm(6, seed=2, sharpness=1.5)
    cfg = TreeConfig(depth=4, frontier=2, slots=3, budget=10, rheostat=1, support=6)
    s = SamplingConfig(temperature=temperature)
    runs = [plan_and_decode(tgt, drf, PREFIX, max_new_tokens=40, sampling=s, tree=cfg, seed=7, cost_model=_cost(slope),
                            passes=p) for p in (None, DEFAULT_PIPELINE)]
    assert len(fused) == len(runs[0].steps) - 1  # every step but the served first one, and only the default
    assert runs[0].tokens == runs[1].tokens
    stats = [[(st.tree_size, st.drafted, st.predicted_tokens, st.predicted_ms) for st in r.steps] for r in runs]
    assert stats[0] == stats[1] and len({st[0] for st in stats[0]}) >= 2


@pytest.mark.parametrize("root,prefix_len", [(5, 100), (7, 3), (0, 0)])
def test_root_only_tree_equals_a_freshly_linearised_one(root, prefix_len):
    """The autoregressive step's tree is a re-stamped template; it must equal linearising."""
    from dataclasses import fields

    from rheoplan.decode import _root_only
    from rheoplan.ir import empty_tree
    from rheoplan.pipeline import PassContext
    from rheoplan.planner.linearize import linearize

    tr = TreeConfig()
    t = empty_tree(1, 1, 1, 1, torch.tensor([root]), torch.tensor([prefix_len]), tr.slots, tr.slots)
    ref = linearize(t, PassContext(tree_cfg=tr.with_(budget=1), sampling=SamplingConfig()))
    _root_only(9, 9, tr)  # the template is built once and must not keep an earlier root
    new = _root_only(root, prefix_len, tr)
    for f in fields(ref):
        a, b = getattr(ref, f.name), getattr(new, f.name)
        if f.name == "linear":
            assert all(torch.equal(getattr(a, g.name), getattr(b, g.name)) for g in fields(a))
        else:
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name


def test_output_projection_time_is_reported_as_part_of_the_walk(greedy_models):
    """``StepStats.t_project``: the walk's output projections (HFTarget projects on demand),
    within ``t_walk``, at one row and in a batch; zero for logits that cost nothing."""
    target, draft, _ = greedy_models
    tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=V_GREEDY)
    one = plan_and_decode(target, draft, [1, 2, 3], max_new_tokens=6, sampling=SamplingConfig(), tree=tree, seed=0)
    rows = plan_and_decode(target, draft, [[1, 2, 3], [4, 5]], max_new_tokens=6, sampling=SamplingConfig(),
                           tree=tree, seed=0)
    for res in [one] + rows:
        assert all(0 < st.t_project <= st.t_walk for st in res.steps)
        assert res.phase_totals()["project"] == pytest.approx(sum(st.t_project for st in res.steps))
    assert "output projection" in one.summary()
    lm = hashed_context_lm(vocab_size=6, seed=1)
    res = plan_and_decode(lm, lm, [0, 1], max_new_tokens=4, seed=0, tree=TreeConfig(depth=2, frontier=2, slots=2,
                                                                                      budget=4, support=6))
    assert all(st.t_project == 0.0 for st in res.steps) and "output projection" not in res.summary()
