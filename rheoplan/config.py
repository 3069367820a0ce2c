"""User-facing configuration: how the draft tree is shaped and how tokens are sampled.

Both dataclasses validate themselves on construction, so a bad value fails before
any model runs, with a message naming the parameter, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

VERIFIERS = ("onehot", "rheo", "ot")
PROXIES = ("default", "next_rank", "true_q")


class ConfigError(ValueError):
    """A configuration value is out of its allowed range."""


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}: allowed an int")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name}={value} is out of range: allowed {allowed}")


def _check_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}: allowed a real number")
    value = float(value)
    if math.isnan(value):
        raise ConfigError(f"{name}=nan is out of range: allowed a real number, not NaN")
    return value


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution is processed before sampling.

    The decode is lossless against exactly this processed distribution:
    ``p = softmax(top_p(top_k(logits / temperature)))``; ``temperature = 0`` is greedy.

    Example:
        >>> SamplingConfig(temperature=0.7, top_p=0.9)
        SamplingConfig(temperature=0.7, top_k=0, top_p=0.9)
    """

    temperature: float = 1.0
    top_k: int = 0  #: 0 disables top-k filtering
    top_p: float = 1.0  #: 1.0 disables nucleus filtering

    def __post_init__(self) -> None:
        t = _check_real("temperature", self.temperature)
        if not (0.0 <= t <= 100.0) or math.isinf(t):
            raise ConfigError(f"temperature={self.temperature} is out of range: allowed [0, 100] (0 = greedy)")
        _check_int("top_k", self.top_k, 0)
        p = _check_real("top_p", self.top_p)
        if not (0.0 < p <= 1.0):
            raise ConfigError(f"top_p={self.top_p} is out of range: allowed (0, 1] (1 = disabled)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def draft_temperature(self) -> float:
        """The draft's softmax temperature: the target's when sampling, 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass(frozen=True)
class TreeConfig:
    """Shape of one draft tree and how it is verified (docs/method.md §3-5).

    Attributes:
        depth: D, number of drafted levels below the root.
        frontier: k, nodes expanded per depth (the best by score).
        slots: K, children created per expanded node.
        budget: N, drafted nodes kept after global pruning (root excluded).
        rheostat: m, deterministic top-ranked children per expanded node;
            ``rheostat == slots`` (or greedy sampling) is EAGLE-2's top-K tree.
        support: S, sparse draft support (the top-S tokens by draft probability).
        verifier: coupling used at verification: 'onehot', 'rheo' or 'ot'.
        proxy: score of the sampled child: 'default', 'next_rank' or 'true_q'.

    Example:
        >>> TreeConfig(depth=6, frontier=8, slots=8, budget=48, rheostat=1)  # doctest: +ELLIPSIS
        TreeConfig(depth=6, frontier=8, slots=8, budget=48, rheostat=1, support=128, verifier='ot', proxy='default')
    """

    depth: int = 6
    frontier: int = 8
    slots: int = 8
    budget: int = 48
    rheostat: int = 1
    support: int = 128
    verifier: str = "ot"
    proxy: str = "default"

    def __post_init__(self) -> None:
        _check_int("depth", self.depth, 1, 64)
        _check_int("frontier", self.frontier, 1, 1024)
        _check_int("slots", self.slots, 1, 1024)
        _check_int("budget", self.budget, 1, 4096)
        _check_int("rheostat", self.rheostat, 0, self.slots)
        _check_int("support", self.support, 1, 1 << 20)
        if self.support < self.slots:
            raise ConfigError(
                f"support={self.support} is out of range: allowed >= slots={self.slots} "
                "(every slot needs a distinct token)")
        if self.verifier not in VERIFIERS:
            raise ConfigError(f"verifier={self.verifier!r} is out of range: allowed one of {VERIFIERS}")
        if self.proxy not in PROXIES:
            raise ConfigError(f"proxy={self.proxy!r} is out of range: allowed one of {PROXIES}")

    @classmethod
    def eagle(cls, depth: int = 6, frontier: int = 8, slots: int = 8, budget: int = 48,
              support: int = 128) -> "TreeConfig":
        """EAGLE-2/3's dynamic top-K tree with one-hot verification (the baseline)."""
        return cls(depth=depth, frontier=frontier, slots=slots, budget=budget, rheostat=slots,
                   support=support, verifier="onehot")

    @classmethod
    def chain(cls, depth: int = 4, support: int = 128) -> "TreeConfig":
        """Chain speculative sampling: one sampled token per depth, standard verification.

        With one slot and ``m = 0`` the only child is drawn from the draft's (sparse
        top-``support``) law and verified with its exact probability; pass ``support``
        = vocabulary size for the textbook algorithm over the full vocabulary.
        """
        return cls(depth=depth, frontier=1, slots=1, budget=depth, rheostat=0, support=support,
                   verifier="rheo")

    def with_(self, **changes) -> "TreeConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def effective_rheostat(self, sampling: SamplingConfig) -> int:
        """m actually used: greedy sampling has no sampled slot (m = K)."""
        return self.slots if sampling.greedy else self.rheostat

    @property
    def capacity(self) -> int:
        """Upper bound on nodes created in one tree, root included."""
        return 1 + self.slots * (1 + self.frontier * (self.depth - 1))

    @property
    def max_expanded(self) -> int:
        """Upper bound on expanded nodes in one tree (root + k per deeper level)."""
        return 1 + self.frontier * (self.depth - 1)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
