"""The validation matrix of ``plan_and_decode`` (house rule 8): every bad input gets an
error that names the parameter, the value and what is allowed, raised before any model
work. "No model work" is checked by counters: ``FunctionalLM.n_calls`` and a forward
pre-hook on the HF models' decoder stacks.

Not here: NaN / inf logits cannot be seen before the model runs; they get a clear error
from the first step that reads them (``test_broken_logits_*``). Kernel limits: the numba
passes (``kernels/*/cpu_pass.py``) declare none beyond ``TreeConfig``'s own ranges. The
``backend`` checks are in ``test_backends.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from _decode_models import greedy_reference, nan_lm, tiny_llama
from rheoplan import SamplingConfig, TreeConfig
from rheoplan.config import ConfigError
from rheoplan.decode import plan_and_decode
from rheoplan.models.functional import hashed_context_lm
from rheoplan.pipeline import PassError

V = 5
TREE = TreeConfig(depth=2, frontier=2, slots=2, budget=3, support=V)


def _check(exc_info, *parts):
    msg = str(exc_info.value)
    for part in parts:
        assert re.search(part, msg), f"{part!r} not in {msg!r}"
    assert "allowed" in msg, msg


# --------------------------------------------------------------------------------------
# FunctionalLM pair: configs, scalar parameters, prompt, vocabularies
# --------------------------------------------------------------------------------------

def S(**kw):
    return lambda: dict(sampling=SamplingConfig(**kw))


def T(**kw):
    return lambda: dict(tree=TreeConfig(**{**TREE.as_dict(), **kw}))


def K(**kw):
    return lambda: kw


# (id, kwargs factory (called inside pytest.raises), exception, regexes the message must hold)
MATRIX = [
    # SamplingConfig
    ("temperature_negative", S(temperature=-0.5), ConfigError, [r"temperature=-0\.5", r"\[0, 100\]"]),
    ("temperature_inf", S(temperature=float("inf")), ConfigError, [r"temperature=inf"]),
    ("temperature_nan", S(temperature=float("nan")), ConfigError, [r"temperature=nan"]),
    ("temperature_str", S(temperature="1"), ConfigError, [r"temperature='1'", "real number"]),
    ("temperature_none", S(temperature=None), ConfigError, [r"temperature=None"]),
    ("top_k_negative", S(top_k=-1), ConfigError, [r"top_k=-1", ">= 0"]),
    ("top_k_float", S(top_k=1.5), ConfigError, [r"top_k=1\.5", "an int"]),
    ("top_k_bool", S(top_k=True), ConfigError, [r"top_k=True", "an int"]),
    ("top_p_zero", S(top_p=0.0), ConfigError, [r"top_p=0\.0", r"\(0, 1\]"]),
    ("top_p_above_one", S(top_p=1.5), ConfigError, [r"top_p=1\.5", r"\(0, 1\]"]),
    ("top_p_nan", S(top_p=float("nan")), ConfigError, [r"top_p=nan"]),
    ("top_p_str", S(top_p="0.9"), ConfigError, [r"top_p='0\.9'"]),
    # TreeConfig
    ("depth_zero", T(depth=0), ConfigError, [r"depth=0", r"\[1, 64\]"]),
    ("depth_too_large", T(depth=65), ConfigError, [r"depth=65", r"\[1, 64\]"]),
    ("depth_float", T(depth=2.0), ConfigError, [r"depth=2\.0", "an int"]),
    ("frontier_zero", T(frontier=0), ConfigError, [r"frontier=0", r"\[1, 1024\]"]),
    ("frontier_str", T(frontier="2"), ConfigError, [r"frontier='2'", "an int"]),
    ("slots_zero", T(slots=0, rheostat=0), ConfigError, [r"slots=0", r"\[1, 1024\]"]),
    ("slots_too_large", T(slots=1025, support=2000), ConfigError, [r"slots=1025"]),
    ("budget_zero", T(budget=0), ConfigError, [r"budget=0", r"\[1, 4096\]"]),
    ("budget_too_large", T(budget=4097), ConfigError, [r"budget=4097", r"\[1, 4096\]"]),
    ("budget_float", T(budget=3.0), ConfigError, [r"budget=3\.0", "an int"]),
    ("rheostat_negative", T(rheostat=-1), ConfigError, [r"rheostat=-1", r"\[0, 2\]"]),
    ("rheostat_above_slots", T(rheostat=3), ConfigError, [r"rheostat=3", r"\[0, 2\]"]),
    ("support_zero", T(support=0), ConfigError, [r"support=0"]),
    ("support_below_slots", T(slots=3, support=2), ConfigError, [r"support=2", ">= slots=3"]),
    ("verifier_unknown", T(verifier="greedy"), ConfigError, [r"verifier='greedy'", "onehot"]),
    ("verifier_none", T(verifier=None), ConfigError, [r"verifier=None"]),
    ("proxy_unknown", T(proxy="q"), ConfigError, [r"proxy='q'", "next_rank"]),
    ("proxy_int", T(proxy=0), ConfigError, [r"proxy=0"]),
    ("slots_beyond_vocab", T(slots=6, support=8, rheostat=1), ConfigError,
     [r"slots=6", r"min\(support=8, vocab=5\) = 5"]),
    # plan_and_decode's own parameters
    ("max_new_tokens_zero", K(max_new_tokens=0), ValueError, [r"max_new_tokens=0", ">= 1"]),
    ("max_new_tokens_negative", K(max_new_tokens=-3), ValueError, [r"max_new_tokens=-3", ">= 1"]),
    ("max_new_tokens_float", K(max_new_tokens=2.5), TypeError, [r"max_new_tokens=2\.5", "an int"]),
    ("max_new_tokens_str", K(max_new_tokens="4"), TypeError, [r"max_new_tokens='4'"]),
    ("max_new_tokens_bool", K(max_new_tokens=True), TypeError, [r"max_new_tokens=True"]),
    ("max_new_tokens_none", K(max_new_tokens=None), TypeError, [r"max_new_tokens=None"]),
    ("seed_negative", K(seed=-1), ValueError, [r"seed=-1", r"\[0, 2\*\*63\)"]),
    ("seed_too_large", K(seed=2**63), ValueError, [r"seed=9223372036854775808", r"\[0, 2\*\*63\)"]),
    ("seed_float", K(seed=1.5), TypeError, [r"seed=1\.5", "an int"]),
    ("seed_str", K(seed="0"), TypeError, [r"seed='0'"]),
    ("seed_bool", K(seed=True), TypeError, [r"seed=True"]),
    ("sampling_dict", K(sampling={"temperature": 1.0}), TypeError, [r"sampling=\{'temperature'", "SamplingConfig"]),
    ("tree_str", K(tree="eagle"), TypeError, [r"tree='eagle'", "TreeConfig"]),
    ("eos_out_of_vocab", K(eos_token_id=V), ValueError, [r"eos_token_id=5", r"\[0, 5\)"]),
    ("eos_negative", K(eos_token_id=-1), ValueError, [r"eos_token_id=-1", r"\[0, 5\)"]),
    ("eos_str", K(eos_token_id="2"), TypeError, [r"eos_token_id='2'"]),
    ("eos_list_with_bad_id", K(eos_token_id=[1, 9]), ValueError, [r"eos_token_id=\[1, 9\]", r"\[0, 5\)"]),
    ("eos_list_with_float", K(eos_token_id=[1, 2.0]), TypeError, [r"eos_token_id=\[1, 2\.0\]", "int"]),
    ("callback_not_callable", K(callback=5), TypeError, [r"callback=5", "callable"]),
    # prompt
    ("prompt_empty", K(prompt_ids=[]), ValueError, [r"prompt_ids=\[\]", "non-empty"]),
    ("prompt_out_of_vocab", K(prompt_ids=[0, V]), ValueError, [r"prompt_ids holds token ids \[5\]", r"\[0, 5\)"]),
    ("prompt_negative_id", K(prompt_ids=[-1, 2]), ValueError, [r"\[-1\]", r"\[0, 5\)"]),
    ("prompt_float_id", K(prompt_ids=[0, 1.5]), TypeError, [r"\[1\.5\]", "int token ids"]),
    ("prompt_str", K(prompt_ids="01"), TypeError, [r"prompt_ids='01'", "sequence of int"]),
    ("prompt_int", K(prompt_ids=3), TypeError, [r"prompt_ids=3", "sequence of int"]),
    # a [B, n] tensor is a batch (docs/batch.md): its padding must be given
    ("prompt_2d_tensor", K(prompt_ids=torch.zeros(2, 2, dtype=torch.long)), ValueError,
     [r"prompt_ids is a \[2, 2\] tensor without attention_mask"]),
    ("prompt_3d_tensor", K(prompt_ids=torch.zeros(1, 2, 2, dtype=torch.long)), ValueError,
     [r"prompt_ids has shape \(1, 2, 2\)", "1-D"]),
    ("prompt_float_tensor", K(prompt_ids=torch.tensor([0.0, 1.0])), TypeError,
     [r"prompt_ids has dtype torch.float32", "integer tensor"]),
    ("prompt_empty_tensor", K(prompt_ids=torch.zeros(0, dtype=torch.long)), ValueError, [r"prompt_ids=\[\]"]),
    # vocabularies
    ("draft_vocab_larger", K(draft=hashed_context_lm(V + 1, seed=2)), ValueError,
     [r"draft vocab_size=6", r"vocab_size=5"]),
    ("draft_vocab_smaller", K(draft=hashed_context_lm(V - 2, seed=2)), ValueError,
     [r"draft vocab_size=3", r"vocab_size=5"]),
]


@pytest.mark.parametrize("case", MATRIX, ids=[c[0] for c in MATRIX])
def test_bad_input_rejected_before_model_work(case):
    _, make, exc, parts = case
    tgt, drf = hashed_context_lm(V, seed=1), hashed_context_lm(V, seed=2)
    with pytest.raises(exc) as info:
        kw = dict(draft=drf, prompt_ids=[0, 1], max_new_tokens=4, tree=TREE, seed=0)
        kw.update(make())
        draft, prompt = kw.pop("draft"), kw.pop("prompt_ids")
        plan_and_decode(tgt, draft, prompt, **kw)
    _check(info, *parts)
    assert tgt.n_calls == 0 and drf.n_calls == 0


def test_good_edge_values_are_accepted():
    """The matrix's neighbours that are allowed: they run (and nothing is clamped)."""
    tgt, drf = hashed_context_lm(V, seed=1), hashed_context_lm(V, seed=2)
    for kw in (dict(seed=2**63 - 1), dict(seed=0), dict(eos_token_id=[0, 4]), dict(max_new_tokens=1),
               dict(prompt_ids=torch.tensor([[0, 4]])), dict(prompt_ids=(3,)),
               dict(sampling=SamplingConfig(temperature=100.0, top_k=V, top_p=1e-9)),
               dict(tree=TreeConfig(depth=1, frontier=1, slots=V, budget=4096, rheostat=V, support=V))):
        args = dict(prompt_ids=[0, 1], max_new_tokens=3, tree=TREE, seed=1) | kw
        r = plan_and_decode(tgt, drf, args.pop("prompt_ids"), **args)
        assert 1 <= len(r.tokens) <= args["max_new_tokens"]


# --------------------------------------------------------------------------------------
# HF models: context length, device, dtype; EAGLE-3 vocabulary maps
# --------------------------------------------------------------------------------------

class _Calls:
    """Counts forwards of models' decoder stacks (any forward = model work)."""

    def __init__(self, *models):
        self.n = 0
        self._h = [m.model.register_forward_pre_hook(self._hook) for m in models]

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        for h in self._h:
            h.remove()


@pytest.fixture(scope="module")
def hf_pair():
    return tiny_llama(0, vocab=6, max_pos=32, layers=4), tiny_llama(1, vocab=6, max_pos=32)


def _rejects(models, call, exc, *parts):
    calls = _Calls(*models)
    try:
        with pytest.raises(exc) as info:
            call()
    finally:
        calls.remove()
    _check(info, *parts)
    assert calls.n == 0, f"{calls.n} forwards ran before the error"


def test_context_overflow_with_draft(hf_pair):
    target, draft = hf_pair
    cfg = TreeConfig(depth=2, frontier=2, slots=2, budget=12, support=6)
    _rejects(hf_pair, lambda: plan_and_decode(target, draft, list(range(6)) * 2, max_new_tokens=8, tree=cfg),
             ValueError, r"prompt \+ max_new_tokens \+ budget \+ 1 = 12 \+ 8 \+ 12 \+ 1 = 33",
             r"max_context=32")
    # one token less fits: it runs
    r = plan_and_decode(target, draft, list(range(6)) * 2, max_new_tokens=7, tree=cfg, seed=0)
    assert len(r.tokens) == 7


def test_context_overflow_autoregressive(hf_pair):
    target, _ = hf_pair
    _rejects(hf_pair, lambda: plan_and_decode(target, None, [1] * 20, max_new_tokens=12), ValueError,
             r"prompt \+ max_new_tokens \+ 1 = 20 \+ 12 \+ 1 = 33", r"max_context=32")
    # the budget of an unused tree does not count without a draft
    assert len(plan_and_decode(target, None, [1] * 20, max_new_tokens=11, seed=0).tokens) == 11


def test_device_mismatch(hf_pair):
    target, _ = hf_pair
    draft = tiny_llama(1, vocab=6, max_pos=32).to("meta")
    _rejects((target,), lambda: plan_and_decode(target, draft, [0, 1], max_new_tokens=4, tree=TREE.with_(support=6)),
             ValueError, r"draft device=meta", r"device=cpu")


def test_dtype_mismatch_is_allowed_and_lossless(hf_pair):
    """A draft in another dtype is a legitimate choice (its logits are cast to float32 and
    it keeps its own cache), so it is not rejected: greedy output still equals the target's."""
    target, _ = hf_pair
    draft = tiny_llama(1, vocab=6, max_pos=32, dtype=torch.bfloat16)
    prompt = [0, 1, 2]
    r = plan_and_decode(target, draft, prompt, max_new_tokens=10, sampling=SamplingConfig(temperature=0),
                        tree=TreeConfig(depth=3, frontier=2, slots=2, budget=5, support=6), seed=0)
    assert r.tokens == greedy_reference(target, prompt, 10)


def test_hf_vocab_mismatch(hf_pair):
    target, _ = hf_pair
    draft = tiny_llama(1, vocab=7, max_pos=32)
    _rejects((target, draft), lambda: plan_and_decode(target, draft, [0, 1], max_new_tokens=4, tree=TREE),
             ValueError, r"draft vocab_size=7", r"vocab_size=6")


def test_hf_prompt_out_of_vocab(hf_pair):
    target, draft = hf_pair
    _rejects(hf_pair, lambda: plan_and_decode(target, draft, [0, 6], max_new_tokens=4, tree=TREE),
             ValueError, r"\[6\]", r"\[0, 6\)")


def _eagle3(target, vocab=6, draft_vocab=4):
    from rheoplan.models.eagle3 import Eagle3Config, Eagle3Draft, Eagle3Head

    cfg = Eagle3Config(vocab_size=vocab, draft_vocab_size=draft_vocab, hidden_size=16, intermediate_size=32,
                       num_attention_heads=2, num_key_value_heads=1)
    head = Eagle3Head(cfg).eval()
    if draft_vocab < vocab:
        head.set_vocab_map(torch.tensor([0, 2, 3, 5][:draft_vocab]))
    embed = target.get_input_embeddings() if vocab == target.config.vocab_size else torch.zeros(vocab, 16)
    return head, Eagle3Draft(head, embed, features_from=target)


@pytest.mark.parametrize("breakage,parts", [
    ("d2t_out_of_range", [r"d2t maps draft ids to target ids \[7\]", r"\[0, 6\)"]),
    ("d2t_duplicate", [r"d2t", "one-to-one"]),
    ("t2d_inconsistent", [r"d2t maps to target ids \[5\] that t2d does not flag"]),
    ("t2d_wrong_shape", [r"t2d has shape \(5,\)", r"\(6,\)"]),
    ("head_vocab", [r"draft vocab_size=8", r"vocab_size=6"]),
])
def test_eagle3_vocab_maps_that_do_not_fit(hf_pair, breakage, parts):
    target, _ = hf_pair
    if breakage == "head_vocab":
        head, draft = _eagle3(target, vocab=8)
    else:
        head, draft = _eagle3(target)
        with torch.no_grad():
            if breakage == "d2t_out_of_range":
                head.d2t[3] = 7 - 3  # draft id 3 -> target id 7
            elif breakage == "d2t_duplicate":
                head.d2t[1] = 0 - 1  # draft id 1 -> target id 0, like draft id 0
            elif breakage == "t2d_inconsistent":
                head.t2d[5] = False
            else:
                head.t2d = torch.ones(5, dtype=torch.bool)
    _rejects((target,), lambda: plan_and_decode(target, draft, [0, 1, 2], max_new_tokens=4,
                                                tree=TREE.with_(support=6)), ValueError, *parts)


def test_eagle3_valid_map_runs(hf_pair):
    target, _ = hf_pair
    _, draft = _eagle3(target)
    r = plan_and_decode(target, draft, [0, 1, 2], max_new_tokens=6, tree=TREE.with_(support=6), seed=0,
                        sampling=SamplingConfig(temperature=0))
    assert r.tokens == greedy_reference(target, [0, 1, 2], 6)


# --------------------------------------------------------------------------------------
# Broken model outputs: a clear error from the step that reads them
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("who", ["target", "draft"])
def test_broken_logits(who, value):
    good = hashed_context_lm(V, seed=1)
    bad = nan_lm(V, value)
    tgt, drf = (bad, good) if who == "target" else (good, bad)
    # a draft error surfaces through the planner as PassError naming the pass (expand@1)
    exc = ValueError if who == "target" else PassError
    with pytest.raises(exc, match=rf"{who} logits contain NaN or \+inf.*{who} model's output is broken"):
        plan_and_decode(tgt, drf, [0, 1], max_new_tokens=4, tree=TREE, seed=0)
    assert bad.n_calls >= 1  # necessarily after model work: the values exist only then


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("who", ["target", "draft"])
def test_finite_logits_that_overflow_at_the_temperature(who, backend):
    """Finite logits of 3e38 are +inf once divided by T = 0.5: the law would be NaN (the
    numba planner's top-S crashed the process on it). Both sides say so before using it."""
    from rheoplan.models.functional import FunctionalLM

    def huge(paths):
        x = torch.zeros(len(paths), V)
        x[:, 2] = 3e38
        return x

    good, bad = hashed_context_lm(V, seed=1), FunctionalLM(huge, V)
    tgt, drf = (bad, good) if who == "target" else (good, bad)
    exc = ValueError if who == "target" else PassError
    msg = (r"processed target scores contain NaN or \+inf.*after temperature=0.5 \(finite logits overflow"
           if who == "target" else r"draft logits contain NaN or \+inf \(or overflow to \+inf when divided by the temperature")
    with pytest.raises(exc, match=msg):
        plan_and_decode(tgt, drf, [0, 1], max_new_tokens=4, tree=TREE, seed=0, backend=backend,
                        sampling=SamplingConfig(temperature=0.5))
    # at T = 1 the same logits are a valid (one-hot) law
    r = plan_and_decode(tgt, drf, [0, 1], max_new_tokens=4, tree=TREE, seed=0, backend=backend,
                        sampling=SamplingConfig(temperature=1.0))
    assert len(r.tokens) == 4


def test_a_logits_processor_that_breaks_the_scores_is_named():
    lm = hashed_context_lm(V, seed=1)
    with pytest.raises(ValueError, match=r"processed target scores contain NaN.*after logits processor nan_out$"):
        def nan_out(ids, scores):
            return scores * float("nan")

        plan_and_decode(lm, None, [0, 1], max_new_tokens=2, seed=0, logits_processors=[nan_out])


def test_target_row_of_all_minus_inf():
    bad = nan_lm(V, float("-inf"))
    with pytest.raises(ValueError, match="no finite entry"):
        plan_and_decode(bad, None, [0, 1], max_new_tokens=2, seed=0)
