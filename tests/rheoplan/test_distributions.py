"""The processed target law is transformers' ``generate`` law, bit for bit.

``process_scores`` is compared with the ``LogitsProcessorList`` that ``generate`` itself
builds (``GenerationMixin._get_logits_processor`` on a tiny Llama) on tie-heavy logits
(scores drawn from a handful of values, so many tokens tie at the top-k / top-p / min-p /
typical boundaries) and on random contexts for the repetition penalty. ``torch.equal``
on the processed scores means the kept sets and the kept values are identical.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rheoplan import SamplingConfig
from _decode_models import generate_processors
from rheoplan.distributions import process_scores, target_probs

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gen_model():
    from _decode_models import tiny_llama

    return tiny_llama(0, vocab=12)


def tie_heavy_logits(gen: torch.Generator, V: int, levels=(-2.0, -1.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0)):
    """Scores from a few values: ties at every boundary; sometimes a -inf (an earlier filter)."""
    lv = torch.tensor(levels)
    x = lv[torch.randint(len(levels), (V,), generator=gen)]
    if torch.rand(1, generator=gen) < 0.3:
        x[torch.randint(V, (1,), generator=gen)] = float("-inf")
    if torch.rand(1, generator=gen) < 0.5:  # sometimes also non-round scales (softmax masses differ)
        x = x * float(torch.rand(1, generator=gen) * 3 + 0.2)
    return x


SETTINGS = [
    SamplingConfig(top_k=1), SamplingConfig(top_k=3), SamplingConfig(top_k=5, temperature=0.7),
    SamplingConfig(top_p=0.3), SamplingConfig(top_p=0.5), SamplingConfig(top_p=0.9, temperature=1.3),
    SamplingConfig(min_p=0.3), SamplingConfig(min_p=0.6, temperature=0.5),
    SamplingConfig(typical_p=0.5), SamplingConfig(typical_p=0.9),
    SamplingConfig(repetition_penalty=1.3), SamplingConfig(repetition_penalty=0.7, top_k=4),
    SamplingConfig(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05, typical_p=0.95, repetition_penalty=1.2),
    SamplingConfig(temperature=0, repetition_penalty=1.5, top_k=2),  # greedy: warpers skipped
]


@pytest.mark.parametrize("sampling", SETTINGS, ids=repr)
def test_process_scores_equals_generates_processors_bitwise(gen_model, sampling):
    V = gen_model.config.vocab_size
    procs = generate_processors(gen_model, sampling)
    gen = torch.Generator().manual_seed(7)
    for _ in range(150):
        logits = tie_heavy_logits(gen, V)
        ids = torch.randint(V, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
        want = procs(ids[None], logits[None].clone())[0]
        got = process_scores(logits, sampling, ids)
        assert torch.equal(got, want), (logits, ids, got, want)
        p = target_probs(logits, sampling, ids)
        if sampling.greedy:
            assert int(p.argmax()) == int(torch.argmax(want)) and float(p.max()) == 1.0
        else:
            torch.testing.assert_close(p, torch.softmax(want.double(), -1), rtol=0, atol=0)


def test_the_issues_tie_examples():
    """top-p on [1, 2, 2, 0] with 0.3 keeps token 2 (transformers'), not token 1; top-k keeps
    every token tied with the k-th score; greedy takes the lowest id among ties."""
    x = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert target_probs(x, SamplingConfig(top_p=0.3)).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert torch.isfinite(process_scores(x, SamplingConfig(top_k=1))).tolist() == [False, True, True, False]
    assert target_probs(x, SamplingConfig(temperature=0)).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert int(torch.argmax(x)) == 1  # the rule generate's torch.argmax follows


def test_user_processors_run_where_generate_runs_them(gen_model):
    """A caller's processors run after the repetition penalty and before the warpers; a
    caller's RepetitionPenaltyLogitsProcessor takes the built-in one's place."""
    from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    V = gen_model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    cases = [
        (SamplingConfig(temperature=0.5, top_k=3, repetition_penalty=1.4),
         [NoRepeatNGramLogitsProcessor(2), SequenceBiasLogitsProcessor({(4,): 3.0, (1, 2): -2.0})]),
        (SamplingConfig(top_p=0.6, repetition_penalty=1.4), [RepetitionPenaltyLogitsProcessor(0.5)]),
        (SamplingConfig(temperature=0), [NoRepeatNGramLogitsProcessor(1)]),
    ]
    for sampling, extra in cases:
        procs = generate_processors(gen_model, sampling, extra)
        for _ in range(60):
            logits = tie_heavy_logits(gen, V)
            ids = torch.randint(V, (5,), generator=gen)
            assert torch.equal(process_scores(logits, sampling, ids, extra), procs(ids[None], logits[None].clone())[0])


def test_processors_do_not_write_into_the_callers_logits():
    def in_place(ids, scores):
        scores[:, 0] = -5.0
        return scores

    x = torch.tensor([1.0, 2.0, 3.0])
    got = process_scores(x, SamplingConfig(), [0], [in_place])
    assert x.tolist() == [1.0, 2.0, 3.0] and got.tolist() == [-5.0, 2.0, 3.0]


def test_rows_are_independent():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    s = SamplingConfig(top_k=1, temperature=0.5)
    both = target_probs(x, s)
    for r in range(2):
        assert torch.equal(both[r], target_probs(x[r], s))
    assert target_probs(x[None], s).shape == (1, 2, 4)


@pytest.mark.parametrize("call,parts", [
    (lambda: process_scores(torch.zeros(3), SamplingConfig(repetition_penalty=1.2)),
     ["input_ids is None", "repetition_penalty"]),
    (lambda: process_scores(torch.zeros(3), SamplingConfig(), None, [lambda i, s: s]), ["input_ids is None"]),
    (lambda: process_scores(torch.zeros(3), SamplingConfig(repetition_penalty=1.2), [0, 3]), [r"\[3\]", r"\[0, 3\)"]),
    (lambda: process_scores(torch.zeros(3), SamplingConfig(), [0], [lambda i, s: s[:, :2]]), ["returned", r"\(1, 3\)"]),
    (lambda: process_scores(torch.zeros(3), SamplingConfig(), [0], [lambda i, s: s - float("inf")]),
     ["no token is left", "<lambda>"]),
    (lambda: process_scores(torch.tensor([0.0, float("nan")]), SamplingConfig()), ["NaN"]),
])
def test_bad_input_is_named(call, parts):
    import re

    with pytest.raises(ValueError) as err:
        call()
    for part in parts:
        assert re.search(part, str(err.value)), (part, str(err.value))


def test_greedy_tokens_of_some_rows_pick_and_check_those_rows_only():
    """``greedy_tokens(rows=)`` is ``greedy_tokens`` of those rows, in that order, with or
    without the fast scan and a context rule; a broken row it does not read is left alone,
    one it reads is refused."""
    from rheoplan.distributions import greedy_tokens
    from rheoplan.kernels.argmax import first_max

    g = torch.Generator().manual_seed(5)
    x = torch.round(torch.randn(6, 300, generator=g) * 2)  # ties
    ids = torch.randint(0, 300, (3, 4), generator=g)
    at = [4, 0, 4]
    for fm in (None, first_max):
        greedy = SamplingConfig(temperature=0)
        assert torch.equal(greedy_tokens(x, greedy, first_max=fm, rows=at), greedy_tokens(x[at], greedy))
        pen = SamplingConfig(temperature=0, repetition_penalty=1.3)
        assert torch.equal(greedy_tokens(x, pen, ids, first_max=fm, rows=at), greedy_tokens(x[at], pen, ids))
        y = x.clone()
        y[2, 7] = float("nan")
        assert torch.equal(greedy_tokens(y, greedy, first_max=fm, rows=at), greedy_tokens(x[at], greedy))
        with pytest.raises(ValueError, match="NaN"):
            greedy_tokens(y, greedy, first_max=fm, rows=[0, 2])


def test_no_filter_no_sort_fast_path_is_the_softmax():
    x = torch.randn(2, 50)
    assert torch.equal(target_probs(x, SamplingConfig()), torch.softmax(x.float().double(), -1))


@pytest.mark.parametrize("k,p", list(itertools.product([0, 2], [1.0, 0.5])))
def test_greedy_ignores_the_warpers_like_generate(k, p):
    x = torch.tensor([0.5, 3.0, 3.0, 1.0])
    assert target_probs(x, SamplingConfig(temperature=0, top_k=k, top_p=p)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_greedy_tokens_is_where_the_greedy_law_puts_its_mass():
    from rheoplan.distributions import greedy_tokens

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=g)
    x[1, [9, 4]] = x[1].max() + 1.0  # a tie: the lowest id
    x[2] = 0.0  # every token tied
    ids = torch.randint(0, 40, (5, 6), generator=g)
    for s in (SamplingConfig(temperature=0), SamplingConfig(temperature=0, top_k=3, repetition_penalty=1.3)):
        got = greedy_tokens(x, s, ids if s.needs_context else None)
        assert got.tolist() == target_probs(x, s, ids if s.needs_context else None).argmax(-1).tolist()
        assert got[1] == 4 and got[2] == 0
    assert greedy_tokens(x[0], SamplingConfig(temperature=0)).shape == ()
    with pytest.raises(ValueError, match="temperature=1.0: allowed 0"):
        greedy_tokens(x, SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="NaN"):
        greedy_tokens(torch.full((2, 4), float("nan")), SamplingConfig(temperature=0))
    # one broken entry in one row of many (the check and the token come from one pass)
    for row, bad in ((3, [float("nan")]), (0, [float("inf")]), (4, [float("-inf")] * 40)):
        y = x.clone()
        y[row, :len(bad)] = torch.tensor(bad)
        with pytest.raises(ValueError, match="NaN or \\+inf, or a row with no finite entry"):
            greedy_tokens(y, SamplingConfig(temperature=0))


def _broken(V: int, pos: int, kind: str) -> torch.Tensor:
    """Three random rows of ``V`` logits, the middle one broken at column ``pos``: a NaN, a
    +inf, no finite entry at all ('no_finite'), or 3e38 ('overflow': finite, +inf once
    divided by a temperature below 1)."""
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(pos))
    if kind == "no_finite":
        x[1] = float("-inf")
    else:
        x[1, pos] = {"nan": float("nan"), "inf": float("inf"), "overflow": 3e38}[kind]
    return x


@pytest.mark.parametrize("V", [1, 17, 49152])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.5), SamplingConfig(top_k=5)],
                         ids=["unprocessed", "T0.5", "top_k"])
@pytest.mark.parametrize("kind", ["nan", "inf", "no_finite"])
def test_target_probs_refuses_a_broken_row_wherever_it_breaks(V, sampling, kind):
    """Unprocessed scores (T = 1, nothing else) are checked on the law's first column, the
    others on the logits: either way a NaN, a +inf or a row with no finite entry, at the
    first, a middle or the last column of the middle row of three, is refused with the
    broken-target message, and a valid row is not."""
    for pos in sorted({0, V // 2, V - 1}):
        x = _broken(V, pos, kind)
        with pytest.raises(ValueError, match="target logits contain NaN or \\+inf"):
            target_probs(x, sampling)
        with pytest.raises(ValueError, match="target logits contain NaN or \\+inf"):
            target_probs(x[1], sampling)  # one row, [V]
    ok = torch.randn(3, V)
    ok[:, 1:] = float("-inf")  # one finite entry per row is a valid (one-hot) law
    assert torch.equal(target_probs(ok, sampling)[:, 0], torch.ones(3, dtype=torch.float64))
    assert torch.equal(target_probs(ok, sampling, check=False)[:, 0], torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("V", [1, 17, 8192])
@pytest.mark.parametrize("T", [1.0, 0.5])
@pytest.mark.parametrize("kind", ["nan", "inf", "no_finite", "overflow"])
def test_draft_probs_refuses_a_broken_row_wherever_it_breaks(V, T, kind):
    """The draft law's check reads only the softmax's first column: a broken row is NaN in
    every entry. Checked with the break at the first, a middle and the last column, in the
    middle row of three, and for logits that overflow only once divided by T < 1."""
    from rheoplan.distributions import draft_probs

    s = SamplingConfig(temperature=T)
    for pos in sorted({0, V // 2, V - 1}):
        x = _broken(V, pos, kind)
        if kind == "overflow" and T == 1.0:
            assert torch.isfinite(draft_probs(x, s)).all()  # finite at T = 1: a valid law
            continue
        with pytest.raises(ValueError, match="draft logits contain NaN or \\+inf"):
            draft_probs(x, s)
    ok = torch.randn(3, V)
    ok[:, 1:] = float("-inf")  # one finite entry per row is a valid (one-hot) law
    assert torch.equal(draft_probs(ok, s)[:, 0], torch.ones(3))
