"""Goodness of fit of sampled decodes against an exact law."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

Law = dict[tuple[int, ...], float]


def empirical_law(samples: Iterable[tuple[int, ...]]) -> Law:
    """Relative frequencies of the sampled outcomes."""
    c = Counter(tuple(s) for s in samples)
    n = sum(c.values())
    return {k: v / n for k, v in c.items()}


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    pvalue: float
    n: int
    cells: int  #: cells after pooling
    unexpected: int  #: samples on outcomes the exact law gives probability 0


def chi_square(law: Law, samples: Iterable[tuple[int, ...]], min_expected: float = 5.0) -> ChiSquare:
    """Pearson chi-square of ``samples`` against ``law``.

    Cells are pooled (smallest expected counts first) until each expects at least
    ``min_expected`` samples. A sample on an outcome of probability 0 makes the p-value 0.
    Reject at false-alarm rate ``alpha`` when ``pvalue < alpha``.

    Example:
        >>> chi_square({(0,): 0.5, (1,): 0.5}, [(0,)] * 50 + [(1,)] * 50).pvalue
        1.0
    """
    from scipy import stats

    samples = [tuple(s) for s in samples]
    n = len(samples)
    if n == 0:
        raise ValueError("no samples")
    counts = Counter(samples)
    unexpected = sum(v for k, v in counts.items() if law.get(k, 0.0) <= 0.0)
    keys = sorted((k for k in law if law[k] > 0), key=lambda k: law[k])
    exp, obs = [], []
    ae = ao = 0.0
    for k in keys:
        ae += law[k] * n
        ao += counts.get(k, 0)
        if ae >= min_expected:
            exp.append(ae)
            obs.append(ao)
            ae = ao = 0.0
    if ae > 0 or ao > 0:
        if exp:
            exp[-1] += ae
            obs[-1] += ao
        else:
            exp.append(ae)
            obs.append(ao)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(exp) - 1
    p = float(stats.chi2.sf(stat, dof)) if dof > 0 else 1.0
    if unexpected:
        p, stat = 0.0, math.inf
    return ChiSquare(stat, dof, p, n, len(exp), unexpected)
