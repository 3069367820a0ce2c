"""Hypothesis strategies for property tests of lossless decoding (needs ``hypothesis``).

Everything is sized for the exact oracle: vocabularies of 3-6 tokens, depth <= 3,
frontier <= 2, and tree configs whose number of draft realisations per step stays
under a bound (``max_leaves``). Strategies return small frozen *specs* (printable in a
falsifying example) rather than opaque model objects; call ``.build()`` on them.

Example:
    >>> from hypothesis import given, settings
    >>> from rheoplan.testing import strategies as rst
    >>> @settings(max_examples=3, deadline=None)
    ... @given(rst.oracle_cases())
    ... def test_lossless(case):
    ...     assert case.tv() <= 1e-9
    >>> test_lossless()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from rheoplan.config import PROXIES, VERIFIERS, SamplingConfig, TreeConfig
from rheoplan.costmodel import N_BUCKETS, N_CLASSES, Calibration, CostPlan, Timings
from rheoplan.models.functional import STYLES, FunctionalLM, hashed_context_lm
from rheoplan.mutation import mutation
from rheoplan.testing.oracle import exact_law, target_law, total_variation

TEMPERATURES = (0.0, 0.5, 1.0, 1.5)
NEG_INF = float("-inf")


def vocab_sizes(lo: int = 3, hi: int = 6) -> st.SearchStrategy[int]:
    """Tiny vocabularies (3-6 tokens by default; 4 and 5 drawn most often)."""
    return st.sampled_from(sorted(range(lo, hi + 1), key=lambda v: (abs(v - 4.5), v)))


def verifiers() -> st.SearchStrategy[str]:
    return st.sampled_from(VERIFIERS)


def proxies() -> st.SearchStrategy[str]:
    return st.sampled_from(PROXIES)


@st.composite
def logit_rows(draw, vocab: int | None = None) -> torch.Tensor:
    """One raw logits row ``[V]`` (float32): Gaussian, ties, -inf entries (never all),
    near one-hot, or flat."""
    V = draw(vocab_sizes()) if vocab is None else vocab
    kind = draw(st.sampled_from(("gauss", "ties", "neg_inf", "near_onehot", "flat")))
    if kind == "flat":
        return torch.zeros(V)
    vals = draw(st.lists(st.floats(-4.0, 4.0, allow_nan=False), min_size=V, max_size=V))
    x = torch.tensor(vals, dtype=torch.float32)
    if kind == "ties":
        x = torch.round(x)
    elif kind == "near_onehot":
        x = x * 0.1
        x[draw(st.integers(0, V - 1))] += draw(st.sampled_from((8.0, 20.0, 40.0)))
    elif kind == "neg_inf":
        mask = draw(st.lists(st.booleans(), min_size=V, max_size=V))
        keep = draw(st.integers(0, V - 1))
        for i, d in enumerate(mask):
            if d and i != keep:
                x[i] = NEG_INF
    return x


@dataclass(frozen=True)
class LMSpec:
    """A hashed-context functional model (``hashed_context_lm``) as a printable spec."""

    vocab: int
    seed: int
    style: str = "gauss"
    sharpness: float = 1.0
    tie_levels: int = 0
    neg_inf_frac: float = 0.0

    def build(self) -> FunctionalLM:
        return hashed_context_lm(self.vocab, seed=self.seed, sharpness=self.sharpness, style=self.style,
                                 tie_levels=self.tie_levels, neg_inf_frac=self.neg_inf_frac)


def lm_specs(vocab: int) -> st.SearchStrategy[LMSpec]:
    """Hashed-context models over ``vocab`` tokens: every style (including 'mixed', where
    each context picks its own), sharpness from flat-ish to peaked, ties, -inf entries."""
    return st.builds(LMSpec, vocab=st.just(vocab), seed=st.integers(0, 2**31 - 1),
                     style=st.sampled_from(STYLES), sharpness=st.sampled_from((0.3, 1.0, 2.5, 6.0)),
                     tie_levels=st.sampled_from((0, 0, 2)), neg_inf_frac=st.sampled_from((0.0, 0.0, 0.3)))


@st.composite
def sampling_configs(draw, vocab: int | None = None,
                     temperatures=TEMPERATURES) -> SamplingConfig:
    """Temperature in ``temperatures`` (0 = greedy), optional top-k (<= vocab) and top-p."""
    V = 6 if vocab is None else vocab
    # non-greedy first (hypothesis favours early entries); greedy is the easy case
    t = draw(st.sampled_from(sorted(temperatures, key=lambda x: (x == 0, abs(x - 1.0)))))
    top_k = draw(st.sampled_from([0] + list(range(V, 0, -1))))
    top_p = draw(st.sampled_from((1.0, 1.0, 0.9, 0.6, 0.3)))
    return SamplingConfig(temperature=t, top_k=top_k, top_p=top_p)


def tree_leaves_bound(tree: TreeConfig, vocab: int, sampling: SamplingConfig) -> int:
    """Upper bound on draft realisations of one step: tail size ** expanded nodes."""
    m = tree.effective_rheostat(sampling)
    if m >= tree.slots:
        return 1
    tail = min(tree.support, vocab) - m
    return tail ** (1 + tree.frontier * (tree.depth - 1))


@st.composite
def tree_configs(draw, vocab: int, sampling: SamplingConfig | None = None, max_depth: int = 3,
                 max_frontier: int = 2, max_leaves: int | None = 64,
                 verifier=None, proxy=None) -> TreeConfig:
    """Tree configs valid for ``vocab`` (slots <= support <= vocab) whose enumeration
    stays under ``max_leaves`` realisations per step (depth, then frontier, are reduced
    until it does)."""
    # Hypothesis favours the first entries of sampled_from and small integers, so the lists
    # start with the interesting values: a sampled slot, several expanded nodes, pruning.
    K = draw(st.sampled_from([x for x in (3, 2, 4, 1) if x <= min(vocab, 4)]))
    S = draw(st.sampled_from(list(range(vocab, K - 1, -1))))
    m = draw(st.sampled_from([x for x in (1, 0, 2, 3, 4) if x <= K]))
    D = draw(st.sampled_from([d for d in (2, 3, 1) if d <= max_depth] or [1]))
    k = draw(st.sampled_from([f for f in (2, 1) if f <= max_frontier] or [1]))
    cap = K * (1 + k * (D - 1))
    N = draw(st.sampled_from(sorted(set(range(1, min(cap, 8) + 1)), key=lambda x: (x != max(1, cap // 2), -x))))
    ver = draw(verifiers()) if verifier is None else verifier
    prox = draw(proxies()) if proxy is None else proxy
    cfg = TreeConfig(depth=D, frontier=k, slots=K, budget=N, rheostat=m, support=S, verifier=ver, proxy=prox)
    s = sampling or SamplingConfig()
    while max_leaves is not None and tree_leaves_bound(cfg, vocab, s) > max_leaves:
        if cfg.frontier > 1:
            cfg = cfg.with_(frontier=cfg.frontier - 1)
        elif cfg.depth > 1:
            cfg = cfg.with_(depth=cfg.depth - 1)
        else:
            break  # a single expanded node: at most vocab leaves
    return cfg


@dataclass(frozen=True)
class OracleCase:
    """One exact-oracle comparison: models, prompt, configs, how many tokens."""

    target: LMSpec
    draft: LMSpec
    prefix: tuple[int, ...]
    n_tokens: int
    tree: TreeConfig
    sampling: SamplingConfig
    mutations: frozenset = field(default_factory=frozenset)
    cost_plan: object = None  #: a ``rheoplan.costmodel.CostPlan``: plan with the cost-aware passes

    def laws(self):
        """``(exact decode law, target law)``."""
        tgt, drf = self.target.build(), self.draft.build()
        with mutation(*self.mutations):
            got = exact_law(tgt, drf, self.prefix, self.n_tokens, tree=self.tree, sampling=self.sampling,
                            cost_plan=self.cost_plan)
        return got, target_law(tgt, self.prefix, self.n_tokens, self.sampling)

    def tv(self) -> float:
        """Total variation between the decode's exact law and the target's."""
        return total_variation(*self.laws())


@st.composite
def cost_plans(draw):
    """A random frozen ``CostPlan``: verify latency from flat to steep in the token count,
    draft and overhead costs from negligible to dear, and a calibration with random counts
    (so decisions range from the full tree to a plain autoregressive step)."""
    base = draw(st.floats(1.0, 20.0))
    slope = draw(st.floats(0.0, 10.0))
    grow = draw(st.floats(0.0, 2.0))
    d1 = draw(st.floats(0.0, 10.0))
    tm = Timings((1, 8, 64), (base, base + 7 * slope, base + 63 * slope),
                 (base + grow, base + grow + 7 * slope, base + grow + 63 * slope), 0, 100,
                 (1, 4), (d1, d1 * draw(st.floats(1.0, 3.0))), draw(st.floats(0.0, 5.0)), draw(st.floats(0.0, 5.0)))
    cal = Calibration()
    for c in range(N_CLASSES):
        for b in range(N_BUCKETS):
            t = draw(st.integers(0, 20))
            cal.trials[c][b], cal.accepts[c][b] = float(t), float(draw(st.integers(0, t)))
    for d in range(4):
        t = draw(st.integers(0, 20))
        cal.cont_trials[d], cal.cont_accepts[d] = float(t), float(draw(st.integers(0, t)))
    return CostPlan.from_calibration(tm, cal)


@st.composite
def oracle_cases(draw, vocab=None, max_depth: int = 3, max_leaves: int = 64, n_tokens=(1, 2),
                 verifier=None, proxy=None, temperatures=TEMPERATURES, cost: bool = False) -> OracleCase:
    """Random ``OracleCase``: vocab 3-6, independent target and draft models (sometimes
    the same model, so q == p), a 1-2 token prompt, sampling and tree configs; with
    ``cost``, a random frozen ``CostPlan`` the cost-aware passes plan with."""
    V = draw(vocab_sizes()) if vocab is None else vocab
    tgt = draw(lm_specs(V))
    drf = draw(st.one_of(lm_specs(V), st.just(tgt)))
    prefix = tuple(draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=2)))
    n = draw(st.sampled_from(n_tokens))
    s = draw(sampling_configs(V, temperatures))
    cfg = draw(tree_configs(V, s, max_depth=max_depth, max_leaves=max_leaves, verifier=verifier, proxy=proxy))
    return OracleCase(tgt, drf, prefix, n, cfg, s, cost_plan=draw(cost_plans()) if cost else None)
