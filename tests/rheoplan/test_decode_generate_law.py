"""``plan_and_decode`` samples transformers' ``generate`` law through the real adapters:
a chi-square on a tiny bfloat16 Llama with top-k and top-p against the law ``generate``'s
own processors give, and greedy parity with ``generate`` at T = 0 with a repetition
penalty and with caller logits processors (float32: exact parity needs it).

Mutation controls: the chi-square catches a law that skips top-p; the greedy parity
catches a context that misses the node's own token (the path to the node must be in the
processors' input ids).
"""

from __future__ import annotations

import pytest
import torch

from _decode_models import generate_processors, tiny_llama
from rheoplan import SamplingConfig, TreeConfig, distributions, verify
from rheoplan.decode import plan_and_decode
from rheoplan.testing import chi_square

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALPHA = 1e-3
SEED0 = 2000
PREFIX = [0, 1]


def generate_law(model, prefix, n, processors, greedy=False) -> dict:
    """transformers' law of the next ``n`` tokens: a plain full forward per context, logits
    cast to float32 as ``generate`` does, its processors, softmax (float64) or argmax."""
    out: dict = {}

    def rec(ctx, acc, w):
        if len(acc) == n:
            out[acc] = out.get(acc, 0.0) + w
            return
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx])).logits[:, -1].to(torch.float32)
        scores = processors(torch.tensor([ctx]), logits)[0]
        if greedy:
            p = torch.zeros(scores.shape, dtype=torch.float64)
            p[int(torch.argmax(scores))] = 1.0
        else:
            p = torch.softmax(scores.to(torch.float64), -1)
        for x in torch.nonzero(p > 0).flatten().tolist():
            rec(ctx + [x], acc + (x,), w * float(p[x]))

    rec(list(prefix), (), 1.0)
    return out


BF16_SAMPLING = SamplingConfig(temperature=0.9, top_k=5, top_p=0.8)
BF16_TREE = TreeConfig(depth=2, frontier=2, slots=2, budget=3, rheostat=1, support=12, verifier="ot")


@pytest.fixture(scope="module")
def bf16_pair():
    target = tiny_llama(21, vocab=12, hidden=16, layers=2, head_scale=3.0, dtype=torch.bfloat16)
    draft = tiny_llama(22, vocab=12, hidden=16, layers=1, head_scale=3.0)
    return target, draft


@pytest.mark.slow
@pytest.mark.no_ir_lint
@pytest.mark.parametrize("mutated", [False, True], ids=["exact", "top_p_skipped"])
def test_bf16_top_k_top_p_chi_square_against_generates_law(bf16_pair, monkeypatch, mutated, record_property):
    target, draft = bf16_pair
    law = generate_law(target, PREFIX, 2, generate_processors(target, BF16_SAMPLING))
    # the law is not trivial: top-k and top-p both cut tokens somewhere
    assert 3 < len(law) < 12 * 12
    if mutated:
        monkeypatch.setattr(distributions, "_top_p", lambda scores, top_p: scores)
    samples = [tuple(plan_and_decode(target, draft, PREFIX, max_new_tokens=2, sampling=BF16_SAMPLING,
                                     tree=BF16_TREE, seed=SEED0 + r).tokens) for r in range(500)]
    res = chi_square(law, samples)
    record_property("pvalue", res.pvalue)
    if mutated:
        assert res.unexpected > 0 or res.pvalue < 1e-6, res
    else:
        assert res.unexpected == 0, res
        assert res.pvalue >= ALPHA, res


# --------------------------------------------------------------------------------------
# Greedy parity with generate (float32)
# --------------------------------------------------------------------------------------

V = 32
TREES = {
    "rheo": TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=V),
    "eagle": TreeConfig.eagle(depth=3, frontier=2, slots=3, budget=6, support=V),
}


@pytest.fixture(scope="module")
def greedy_pair():
    # head_scale 4: a peaked but not one-hot law, so the penalty changes the greedy path
    return (tiny_llama(2, vocab=V, hidden=32, layers=4, head_scale=4.0),
            tiny_llama(3, vocab=V, hidden=32, layers=2, head_scale=4.0))


def generate_greedy(model, prompt, n, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


PROMPT, N = [1, 2, 3, 4, 1, 2], 24


@pytest.mark.parametrize("tree_name", sorted(TREES))
@pytest.mark.parametrize("draft_kind", ["other", "self"])
def test_greedy_parity_with_generate_repetition_penalty(greedy_pair, tree_name, draft_kind):
    target, other = greedy_pair
    draft = target if draft_kind == "self" else other  # self: long accepted paths
    want = generate_greedy(target, PROMPT, N, repetition_penalty=1.5)
    assert want != generate_greedy(target, PROMPT, N)  # the penalty matters on this model
    r = plan_and_decode(target, draft, PROMPT, max_new_tokens=N, tree=TREES[tree_name], seed=0,
                        sampling=SamplingConfig(temperature=0, repetition_penalty=1.5))
    assert r.tokens == want
    if draft_kind == "self":
        assert max(s.accepted for s in r.steps) >= 2  # contexts inside accepted paths were used


def test_greedy_parity_with_generate_caller_processors(greedy_pair):
    from transformers import NoRepeatNGramLogitsProcessor
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    target, draft = greedy_pair
    procs = [NoRepeatNGramLogitsProcessor(2), SequenceBiasLogitsProcessor({(5,): 2.0, (7, 9): 1.5})]
    want = generate_greedy(target, PROMPT, N, repetition_penalty=1.2, logits_processor=procs)
    assert want != generate_greedy(target, PROMPT, N, repetition_penalty=1.2)
    r = plan_and_decode(target, target, PROMPT, max_new_tokens=N, tree=TREES["rheo"], seed=0,
                        sampling=SamplingConfig(temperature=0, repetition_penalty=1.2), logits_processors=procs)
    assert r.tokens == want


def test_mutation_context_without_the_nodes_own_token_is_caught(greedy_pair, monkeypatch):
    """Control: a law that sees the context up to the node's parent only (off by one) breaks
    the parity above."""
    target, _ = greedy_pair

    def off_by_one(original):
        def law(logits, sampling, ids=None, processors=()):
            return original(logits, sampling, None if ids is None else ids[:-1], processors)
        return law

    # the walk reads the law through these two (a greedy walk only the greedy token)
    for name in ("target_probs", "greedy_tokens"):
        monkeypatch.setattr(verify, name, off_by_one(getattr(verify, name)))
    r = plan_and_decode(target, target, PROMPT, max_new_tokens=N, tree=TREES["rheo"], seed=0,
                        sampling=SamplingConfig(temperature=0, repetition_penalty=1.5))
    assert r.tokens != generate_greedy(target, PROMPT, N, repetition_penalty=1.5)


def test_sampling_from_generation_config_matches_generate(greedy_pair):
    from transformers import GenerationConfig

    target, draft = greedy_pair
    gc = GenerationConfig(do_sample=False, repetition_penalty=1.5, max_new_tokens=N)
    r = plan_and_decode(target, draft, PROMPT, max_new_tokens=N, tree=TREES["rheo"], seed=0,
                        sampling=SamplingConfig.from_generation_config(gc))
    assert r.tokens == generate_greedy(target, PROMPT, N, repetition_penalty=1.5)


@pytest.mark.parametrize("bad,kind,parts", [
    ("nope", TypeError, ["logits_processors='nope'", "list of transformers LogitsProcessor"]),
    ([1], TypeError, ["holds 1", "not callable"]),
])
def test_bad_logits_processors_are_named_before_any_work(greedy_pair, bad, kind, parts):
    import re

    target, draft = greedy_pair
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(kind) as err:
            plan_and_decode(target, draft, PROMPT, max_new_tokens=2, logits_processors=bad)
    finally:
        handle.remove()
    for part in parts:
        assert re.search(re.escape(part), str(err.value)), (part, str(err.value))
    assert calls == []
