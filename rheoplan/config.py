"""User-facing configuration: how the draft tree is shaped and how tokens are sampled.

Both dataclasses validate themselves on construction, so a bad value fails before
any model runs, with a message naming the parameter, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

VERIFIERS = ("onehot", "rheo", "ot")
PROXIES = ("default", "next_rank", "true_q")
#: integer codes the numba and Triton kernels take for a verifier / proxy name (one map each)
VERIFIER_CODES = {name: code for code, name in enumerate(VERIFIERS)}
PROXY_CODES = {name: code for code, name in enumerate(PROXIES)}


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


#: GenerationConfig fields that do not change the law of the sampled tokens: stopping and
#: length (``plan_and_decode`` takes ``max_new_tokens`` and ``eos_token_id`` itself), special
#: token ids, caching, outputs, and knobs of transformers' own (lossless) assisted decoding.
_GENERATION_NEUTRAL = frozenset({
    "max_length", "max_new_tokens", "early_stopping", "use_cache", "cache_implementation",
    "cache_config", "max_cache_len", "output_attentions", "output_hidden_states", "output_scores",
    "output_logits", "return_dict_in_generate", "pad_token_id", "bos_token_id", "eos_token_id",
    "decoder_start_token_id", "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "prompt_lookup_num_tokens", "max_matching_ngram_size",
    "assistant_early_exit", "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight",
    "speculation_type", "compile_config", "disable_compile", "continuous_batching_config",
    "low_memory", "prefill_chunk_size", "transformers_version", "_from_model_config",
    "_commit_hash", "_original_object_hash", "use_mtp", "length_penalty",
    # LogitNormalization is a log_softmax applied last: softmax of it is the same law.
    "renormalize_logits",
})

#: GenerationConfig fields that change the law but that SamplingConfig does not model, with the
#: value (or values) at which ``generate`` adds no processor for them.
_GENERATION_UNSUPPORTED_INACTIVE = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None,), "dola_layers": (None,), "constraints": (None,),
    "force_words_ids": (None,), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "encoder_repetition_penalty": (None, 1.0),
    "bad_words_ids": (None,), "sequence_bias": (None,), "min_length": (None, 0),
    "min_new_tokens": (None, 0), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "remove_invalid_values": (None, False), "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "guidance_scale": (None, 1.0),
    "top_h": (None,), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "watermarking_config": (None,), "token_healing": (None, False), "stop_strings": (None,),
    "max_time": (None,), "num_return_sequences": (None, 1),
}

#: transformers' global defaults for the fields SamplingConfig maps (``generate`` fills a
#: field left at None with these; ``GenerationConfig._get_default_generation_params``).
_GENERATION_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                        "min_p": None, "typical_p": 1.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token scores are processed before sampling: exactly the law
    transformers' ``generate`` samples from with the same settings, ties included.

    The processors run in ``generate``'s order (its ``_get_logits_processor``), each with the
    semantics of its transformers class (``rheoplan.distributions`` implements them):

    1. ``repetition_penalty`` (``RepetitionPenaltyLogitsProcessor``; over prompt + emitted
       + the path to the node, like ``generate``'s ``input_ids``), then any
       ``logits_processors`` passed to ``plan_and_decode``;
    2. when sampling (``temperature > 0``): ``temperature``, ``top_k`` (keeps every token tied
       with the k-th score), ``top_p``, ``min_p``, ``typical_p`` (the ``*LogitsWarper`` classes);
    3. ``p = softmax(scores)``; ``temperature = 0`` is greedy: the argmax of the step-1
       scores (lowest token id among ties, like ``torch.argmax``); the warpers are skipped,
       as ``generate(do_sample=False)`` skips them.

    Example:
        >>> SamplingConfig(temperature=0.7, top_p=0.9)
        SamplingConfig(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)
    """

    temperature: float = 1.0
    top_k: int = 0  #: 0 disables top-k filtering
    top_p: float = 1.0  #: 1.0 disables nucleus filtering
    min_p: float = 0.0  #: 0.0 disables min-p filtering
    typical_p: float = 1.0  #: 1.0 disables typical filtering
    repetition_penalty: float = 1.0  #: 1.0 disables the penalty

    def __post_init__(self) -> None:
        t = _check_real("temperature", self.temperature)
        if not (0.0 <= t <= 100.0) or math.isinf(t):
            raise ConfigError(f"temperature={self.temperature} is out of range: allowed [0, 100] (0 = greedy)")
        _check_int("top_k", self.top_k, 0)
        p = _check_real("top_p", self.top_p)
        if not (0.0 < p <= 1.0):
            raise ConfigError(f"top_p={self.top_p} is out of range: allowed (0, 1] (1 = disabled)")
        mp = _check_real("min_p", self.min_p)
        if not (0.0 <= mp <= 1.0):
            raise ConfigError(f"min_p={self.min_p} is out of range: allowed [0, 1] (0 = disabled)")
        tp = _check_real("typical_p", self.typical_p)
        if not (0.0 < tp <= 1.0):
            raise ConfigError(f"typical_p={self.typical_p} is out of range: allowed (0, 1] (1 = disabled)")
        rp = _check_real("repetition_penalty", self.repetition_penalty)
        if not (0.0 < rp <= 100.0):
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} is out of range: allowed "
                              "(0, 100] (1 = disabled; > 1 penalises repeats, < 1 favours them)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def draft_temperature(self) -> float:
        """The draft's softmax temperature: the target's when sampling, 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def needs_context(self) -> bool:
        """Whether the processed law depends on the tokens before the node (repetition penalty)."""
        return self.repetition_penalty != 1.0

    @classmethod
    def from_generation_config(cls, cfg) -> "SamplingConfig":
        """The ``SamplingConfig`` that samples what ``model.generate(generation_config=cfg)``
        samples (fields left at None take transformers' global defaults, as ``generate`` does:
        ``do_sample=False``, ``top_k=50``).

        Maps ``do_sample`` (False -> ``temperature=0``), ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``typical_p``, ``repetition_penalty``. Fields that change the law but are
        not modelled here (beam search, ``no_repeat_ngram_size``, ``bad_words_ids``,
        ``epsilon_cutoff``, ``suppress_tokens``, ...) raise a ``ConfigError`` naming every one
        that is set; stopping fields (``max_new_tokens``, ``eos_token_id``) are
        ``plan_and_decode``'s own arguments and are not read. Pass other processors to
        ``plan_and_decode(logits_processors=...)``.

        Example:
            >>> from transformers import GenerationConfig
            >>> SamplingConfig.from_generation_config(GenerationConfig(do_sample=True, top_p=0.9))
            SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)
        """
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        unsupported = []
        for name, value in d.items():
            if name in _GENERATION_DEFAULTS or name in _GENERATION_NEUTRAL:
                continue
            inactive = _GENERATION_UNSUPPORTED_INACTIVE.get(name)
            if inactive is not None and any(value is v or value == v for v in inactive):
                continue
            if inactive is None and value is None:
                continue  # an unknown field left unset
            unsupported.append(f"{name}={value!r}")
        if unsupported:
            raise ConfigError(
                f"generation config sets {', '.join(unsupported)}: not supported by SamplingConfig "
                "(supported: do_sample, temperature, top_k, top_p, min_p, typical_p, "
                "repetition_penalty); unset them, or pass an equivalent transformers LogitsProcessor "
                "to plan_and_decode(logits_processors=...)")
        get = {k: (d.get(k) if d.get(k) is not None else v) for k, v in _GENERATION_DEFAULTS.items()}
        temperature = float(get["temperature"]) if get["do_sample"] else 0.0
        return cls(temperature=temperature, top_k=int(get["top_k"]), top_p=float(get["top_p"]),
                   min_p=float(get["min_p"] or 0.0), typical_p=float(get["typical_p"]),
                   repetition_penalty=float(get["repetition_penalty"]))


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
        TreeConfig(depth=6, frontier=8, slots=8, budget=48, rheostat=1, support=128, verifier='rheo', proxy='default')
    """

    depth: int = 6
    frontier: int = 8
    slots: int = 8
    budget: int = 48
    rheostat: int = 1
    support: int = 128
    verifier: str = "rheo"
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
