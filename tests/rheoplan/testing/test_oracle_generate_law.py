"""The exact oracle against transformers' own sampling law (issue: ties and processors).

``generate_law`` enumerates, in float64, the law ``generate`` samples from: at every
context the scores go through the ``LogitsProcessorList`` transformers builds for the same
settings (its own ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``,
``TypicalLogitsWarper``, ``RepetitionPenaltyLogitsProcessor`` classes, in ``generate``'s
order), then softmax (or argmax when greedy). The whole multi-step decode's exact law
(``exact_law``) must equal it to 1e-9 in total variation, on tie-heavy models (logits
rounded to steps of 1.5, so several tokens tie at the top-k / top-p boundaries) and with
context-dependent processors (each node's context is prompt + emitted + its path).

Mutation controls: the same test with top-k / top-p ties broken the old way (exactly k
tokens by rank, lower id first; nucleus over a descending stable sort), or with the
repetition penalty seeing the prompt only, is off by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from rheoplan import SamplingConfig, TreeConfig, distributions
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing import exact_law, total_variation

TOL = 1e-9
PREFIX = (0, 1)
TREE = TreeConfig(depth=2, frontier=2, slots=2, budget=3, rheostat=1, support=5, verifier="ot")


def generate_law(target, prefix, n_tokens: int, processors, greedy: bool) -> dict:
    """transformers' law of the next ``n_tokens`` tokens, by enumeration (float64)."""
    out: dict = {}

    def rec(ctx, acc, w):
        if len(acc) == n_tokens:
            out[acc] = out.get(acc, 0.0) + w
            return
        scores = processors(torch.tensor([ctx]), target([ctx])[0][None].to(torch.float32).clone())[0]
        if greedy:
            p = torch.zeros(scores.shape, dtype=torch.float64)
            p[int(torch.argmax(scores))] = 1.0
        else:
            p = torch.softmax(scores.to(torch.float64), dim=-1)
        for x in torch.nonzero(p > 0).flatten().tolist():
            rec(ctx + (x,), acc + (x,), w * float(p[x]))

    rec(tuple(prefix), (), 1.0)
    return out


def tie_models(seed: int):
    return (hashed_context_lm(5, seed=seed, sharpness=1.5, tie_levels=2),
            hashed_context_lm(5, seed=seed + 1, sharpness=1.0))


CASES = {
    # name: (sampling, n tokens)
    "top_k_ties": (SamplingConfig(top_k=2), 2),
    "top_k_ties_t0.7": (SamplingConfig(temperature=0.7, top_k=3), 2),
    "top_p_ties": (SamplingConfig(top_p=0.5), 2),
    "top_p_ties_0.3": (SamplingConfig(top_p=0.3, temperature=1.2), 2),
    "min_p": (SamplingConfig(min_p=0.3), 2),
    "typical": (SamplingConfig(typical_p=0.6), 2),
    "repetition_penalty": (SamplingConfig(repetition_penalty=1.8), 2),
    "repetition_penalty_reward": (SamplingConfig(repetition_penalty=0.6, top_k=3), 2),
    "everything": (SamplingConfig(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, typical_p=0.95,
                                  repetition_penalty=1.3), 2),
    "greedy_repetition_penalty": (SamplingConfig(temperature=0, repetition_penalty=2.0), 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [11, 31])
def test_exact_law_equals_generates_law(generate_processors, name, seed):
    sampling, n = CASES[name]
    tgt, drf = tie_models(seed)
    want = generate_law(tgt, PREFIX, n, generate_processors(sampling), sampling.greedy)
    got = exact_law(tgt, drf, PREFIX, n, tree=TREE, sampling=sampling)
    assert total_variation(got, want) <= TOL


@pytest.mark.parametrize("greedy", [False, True])
def test_user_processors_through_the_oracle(generate_processors, greedy):
    """Context-dependent processors of the caller's (n-gram ban, sequence bias), in
    ``generate``'s place for them: after the repetition penalty, before the warpers."""
    from transformers import NoRepeatNGramLogitsProcessor
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    extra = [NoRepeatNGramLogitsProcessor(2), SequenceBiasLogitsProcessor({(1, 3): 2.0, (2,): -1.0})]
    sampling = SamplingConfig(temperature=0 if greedy else 0.9, top_k=3, repetition_penalty=1.3)
    tgt, drf = tie_models(5)
    want = generate_law(tgt, PREFIX, 3, generate_processors(sampling, extra), greedy)
    got = exact_law(tgt, drf, PREFIX, 3, tree=TREE, sampling=sampling, processors=extra)
    assert total_variation(got, want) <= TOL


# --------------------------------------------------------------------------------------
# Mutation controls: the comparison above fails for the old tie rules / a wrong context
# --------------------------------------------------------------------------------------

def _old_top_k(scores, k):
    """rheoplan's rule before transformers' semantics: exactly k tokens, lower id first."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order[..., :k], True)
    return scores.masked_fill(~keep, float("-inf"))


def _old_top_p(scores, top_p):
    """Descending stable sort (lower id first among ties); keep while the mass before < top_p."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranked = torch.gather(scores, -1, order)
    pr = torch.softmax(ranked, dim=-1)
    keep_ranked = (torch.cumsum(pr, dim=-1) - pr) < top_p
    keep = torch.zeros_like(keep_ranked).scatter_(-1, order, keep_ranked)
    return scores.masked_fill(~keep, float("-inf"))


def _prompt_only_penalty(ids, scores, penalty):
    return ORIGINAL_PENALTY(ids[:, :len(PREFIX)], scores, penalty)


ORIGINAL_PENALTY = distributions._repetition_penalty

MUTATIONS = {
    # name: (what is patched, replacement, case)
    "old_top_k_ties": ("_top_k", _old_top_k, "top_k_ties"),
    "old_top_p_ties": ("_top_p", _old_top_p, "top_p_ties"),
    "penalty_sees_prompt_only": ("_repetition_penalty", _prompt_only_penalty, "repetition_penalty"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutation_controls_are_detected(generate_processors, monkeypatch, mutation):
    attr, replacement, case = MUTATIONS[mutation]
    sampling, n = CASES[case]
    tgt, drf = tie_models(11)
    want = generate_law(tgt, PREFIX, n, generate_processors(sampling), sampling.greedy)
    assert total_variation(exact_law(tgt, drf, PREFIX, n, tree=TREE, sampling=sampling), want) <= TOL
    monkeypatch.setattr(distributions, attr, replacement)
    tv = total_variation(exact_law(tgt, drf, PREFIX, n, tree=TREE, sampling=sampling), want)
    assert tv > 1e-2, f"{mutation}: TV {tv} — the oracle comparison would not catch it"
