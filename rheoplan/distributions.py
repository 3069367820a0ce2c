"""Processed target and draft distributions (docs/method.md §2).

The target law is transformers' sampling law (``generate``), defined here once: the
verifier (``rheoplan.verify``) and the exact oracle (``rheoplan.testing``) both call
``target_probs``. Each step below repeats the tensor operations of the transformers class
it names, in the same order and dtype (float32 scores, as ``generate`` casts the logits),
so the kept set is the same bit for bit, ties included:

==================  ============================================  ===========================
step                transformers                                  when
==================  ============================================  ===========================
repetition penalty  ``RepetitionPenaltyLogitsProcessor``          ``repetition_penalty != 1``
caller processors   any ``LogitsProcessor``, in the given order   always
temperature         ``TemperatureLogitsWarper``                   sampling
top-k               ``TopKLogitsWarper`` (keeps k-th-score ties)  sampling, ``top_k > 0``
top-p               ``TopPLogitsWarper``                          sampling, ``top_p < 1``
min-p               ``MinPLogitsWarper``                          sampling, ``min_p > 0``
typical             ``TypicalLogitsWarper``                       sampling, ``typical_p < 1``
==================  ============================================  ===========================

The order is ``GenerationMixin._get_logits_processor``'s: processors (repetition penalty,
then the caller's list, where a caller's ``RepetitionPenaltyLogitsProcessor`` takes the
built-in one's place), then the warpers. Greedy (``temperature == 0``) skips the warpers and
takes the argmax (first index among ties), like ``generate(do_sample=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rheoplan.config import SamplingConfig

#: a transformers ``LogitsProcessor`` or any callable ``(input_ids [1, n] int64, scores [1, V]
#: float32) -> scores [1, V]``
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_NEG_INF = -float("inf")

#: the message of a broken target output (raised at once, or after the walk on a device)
BROKEN_TARGET = ("target logits contain NaN or +inf, or a row with no finite entry: "
                 "the target model's output is broken")
#: the message of a broken draft output (raised at once, or after planning on a device)
BROKEN_DRAFT = ("draft logits contain NaN or +inf (or overflow to +inf when divided by the temperature), "
                "or a row with no finite entry: the draft model's output is broken")

#: residual mass at or below this is treated as zero (acceptance is then certain); every
#: verifier implementation (torch, numba, Triton) imports it from here
RESIDUAL_EPS = 1e-300


def broken_rows(x: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: some row of ``x [..., V]`` has NaN or +inf, or no finite entry.
    A tensor, not a bool, so a device caller can defer the host sync."""
    return broken_maxima(x.amax(dim=-1))


def broken_maxima(top: torch.Tensor) -> torch.Tensor:
    """``broken_rows`` from the rows' maxima (a caller that takes the max anyway, as the
    greedy pick does, checks with no second pass over V)."""
    # one reduction instead of three passes over V: a row's max is NaN when it holds a NaN
    # (torch's max propagates NaN), +inf when it holds +inf, -inf when nothing is finite
    return ~torch.isfinite(top).all()


def _repetition_penalty(ids: torch.Tensor, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """``RepetitionPenaltyLogitsProcessor``: each token in ``ids`` once, negative scores
    multiplied by the penalty, the others divided."""
    score = torch.gather(scores, 1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter(1, ids, score)


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``TopKLogitsWarper``: drop scores below the k-th largest, so every tie with it stays."""
    k = min(k, scores.size(-1))
    return scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], _NEG_INF)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``TopPLogitsWarper``: ascending sort, drop the prefix whose cumulative mass is at most
    ``1 - top_p``, keep the top one. Among tied scores the sort order decides which stay
    (the last in ascending order, i.e. what ``torch.sort`` puts last)."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative_probs <= (1 - top_p)
    sorted_remove[..., -1:] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, _NEG_INF)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """``MinPLogitsWarper``: drop tokens whose probability is below ``min_p`` times the top one."""
    probs = torch.softmax(scores, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, _NEG_INF)


def _typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """``TypicalLogitsWarper``: keep the tokens whose surprisal is closest to the entropy
    until their mass reaches ``mass`` (ties with the last kept distance stay)."""
    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    ent = -(normalized * p).nansum(-1, keepdim=True)
    shifted = torch.abs((-normalized) - ent)
    sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
    cumulative_probs = scores.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
    last_ind = (cumulative_probs < mass).sum(dim=1)
    last_ind.clamp_(max=sorted_scores.shape[-1] - 1)
    sorted_remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
    sorted_remove[..., :1] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, _NEG_INF)


def _name(proc) -> str:
    return getattr(proc, "__name__", None) or type(proc).__name__


def _is_repetition_penalty(proc) -> bool:
    return type(proc).__name__ == "RepetitionPenaltyLogitsProcessor"


def _as_ids(input_ids, rows: int, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.int64, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != rows or ids.shape[1] == 0:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}: allowed a non-empty sequence of "
                         f"token ids (or [{rows}, n]), the context the scores predict the next token of")
    return ids


def process_scores(logits: torch.Tensor, sampling: SamplingConfig, input_ids=None,
                   processors: Sequence[LogitsProcessor] = (), check: bool = True) -> torch.Tensor:
    """The processed scores (float32, filtered tokens ``-inf``) whose softmax is the target law.

    Args:
        logits: raw next-token logits ``[..., V]`` (rows are independent).
        sampling: the settings (see ``SamplingConfig``).
        input_ids: the context the logits predict the next token of (prompt + emitted + path),
            ``[L]`` for one row or ``[n, L]`` for ``n`` rows; needed when
            ``sampling.needs_context`` or ``processors``.
        processors: transformers ``LogitsProcessor`` objects (or callables of that signature),
            applied after the repetition penalty and before the warpers, like ``generate``.
        check: ``False`` skips the broken-logits checks (host syncs); the caller checks
            ``broken_rows`` itself (the device walk sends the flag with its tokens).

    Example (top-k keeps all ties with the k-th score, like ``TopKLogitsWarper``):
        >>> process_scores(torch.tensor([1., 2., 2., 0.]), SamplingConfig(top_k=1)).tolist()
        [-inf, 2.0, 2.0, -inf]
    """
    x = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
    processors = list(processors)
    if x.numel() == 0:
        raise ValueError("target logits are empty: allowed [V] or [n, V] with V >= 1")
    if check and bool(broken_rows(x)):
        raise ValueError(BROKEN_TARGET)
    checked = x
    ids = None
    if sampling.needs_context or processors:
        if input_ids is None:
            raise ValueError("input_ids is None but the target law depends on the context "
                             "(repetition_penalty != 1 or logits_processors): pass the token ids "
                             "before the node (prompt + emitted + path)")
        ids = _as_ids(input_ids, x.shape[0], x.device)
        bad = ids[(ids < 0) | (ids >= x.shape[-1])]
        if bad.numel():
            raise ValueError(f"input_ids holds token ids {bad.tolist()[:5]} outside [0, {x.shape[-1]})")
    if processors:
        x = x.clone()  # a processor may write into its scores in place; the caller's logits stay
    custom_penalty = [p for p in processors if _is_repetition_penalty(p)]
    if custom_penalty:
        # generate: a caller's processor of a built-in's type replaces it at its place (first).
        x = custom_penalty[0](ids, x)
        processors = [p for p in processors if p is not custom_penalty[0]]
    elif sampling.repetition_penalty != 1.0:
        x = _repetition_penalty(ids, x, sampling.repetition_penalty)
    for proc in processors:
        x = proc(ids, x)
        if not isinstance(x, torch.Tensor) or x.shape[-1] != logits.shape[-1]:
            raise ValueError(f"logits processor {_name(proc)} returned "
                             f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}: allowed scores of "
                             f"shape {tuple(ids.shape[:1]) + (logits.shape[-1],)}")
    if not sampling.greedy:
        if sampling.temperature != 1.0:
            x = x / sampling.temperature
        if sampling.top_k != 0:
            x = _top_k(x, sampling.top_k)
        if sampling.top_p < 1.0:
            x = _top_p(x, sampling.top_p)
        if sampling.min_p > 0.0:
            x = _min_p(x, sampling.min_p)
        if sampling.typical_p < 1.0:
            x = _typical(x, sampling.typical_p)
    x = x.to(torch.float32)
    # nothing processed the checked scores (no processor, no warper: T = 1 sampling or
    # greedy with no context rule): they are still the checked tensor, no second pass over V
    if check and x is not checked and bool(broken_rows(x)):
        raise ValueError("the processed target scores contain NaN or +inf, or no token is left, after "
                         + ", ".join(_processing_steps(sampling, custom_penalty[:1] + processors))
                         + (" (finite logits overflow to +inf when divided by a temperature below 1)"
                            if not sampling.greedy and sampling.temperature < 1.0 else ""))
    return x.reshape(logits.shape)


def _processing_steps(sampling: SamplingConfig, processors: Sequence[LogitsProcessor]) -> list[str]:
    """What ``process_scores`` applied to the checked logits, in its order (for its error)."""
    steps = [] if processors and _is_repetition_penalty(processors[0]) else (
        [f"repetition_penalty={sampling.repetition_penalty}"] if sampling.repetition_penalty != 1.0 else [])
    steps += [f"logits processor {_name(p)}" for p in processors]
    if not sampling.greedy:
        steps += [f"{k}={v}" for k, v, off in (("temperature", sampling.temperature, 1.0), ("top_k", sampling.top_k, 0),
                                                ("top_p", sampling.top_p, 1.0), ("min_p", sampling.min_p, 0.0),
                                                ("typical_p", sampling.typical_p, 1.0)) if v != off]
    return steps


def target_probs(logits: torch.Tensor, sampling: SamplingConfig, input_ids=None,
                 processors: Sequence[LogitsProcessor] = (), check: bool = True) -> torch.Tensor:
    """The processed target law (float64): ``softmax(process_scores(...))``, or, when
    greedy, a one-hot on its argmax (lowest token id among ties, like ``torch.argmax`` in
    ``generate``). Works on ``[..., V]``; see ``process_scores`` for the arguments.

    Example:
        >>> target_probs(torch.tensor([0., 1., 1.]), SamplingConfig(temperature=0)).tolist()
        [0.0, 1.0, 0.0]
        >>> [round(v, 3) for v in target_probs(torch.tensor([1., 2., 2., 0.]), SamplingConfig(top_p=0.3)).tolist()]
        [0.0, 0.0, 1.0, 0.0]
    """
    # Unprocessed scores (T = 1 sampling with no warper, processor or context rule: every
    # walk node of a default decode) are checked on the law instead of on the logits, as
    # ``draft_probs`` checks: a broken row's softmax is NaN in every entry, so its first
    # column tells, with no second pass over V (33 of the ~250 us a visited node cost in
    # batched walks on the 2-core Zen 5 EPYC).
    on_law = check and not sampling.greedy and _unprocessed(sampling, processors)
    x = process_scores(logits, sampling, input_ids, processors, check and not on_law)
    if sampling.greedy:
        out = torch.zeros_like(x, dtype=torch.float64)
        out.scatter_(-1, _greedy(x)[..., None], 1.0)
        return out
    p = torch.softmax(x.to(torch.float64), dim=-1)
    if on_law and bool(torch.isnan(p[..., 0]).any()):
        raise ValueError(BROKEN_TARGET)
    return p


def _unprocessed(sampling: SamplingConfig, processors: Sequence) -> bool:
    """Whether ``process_scores`` returns its logits unchanged (but for the float32 cast)."""
    return (not processors and not sampling.needs_context and sampling.temperature == 1.0
            and sampling.top_k == 0 and sampling.top_p >= 1.0 and sampling.min_p <= 0.0
            and sampling.typical_p >= 1.0)


def _greedy(scores: torch.Tensor) -> torch.Tensor:
    # the first index of the maximum: the lowest token id among ties, as ``generate``'s
    # ``torch.argmax`` picks it
    return scores.argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor, sampling: SamplingConfig, input_ids=None,
                  processors: Sequence[LogitsProcessor] = (), check: bool = True,
                  first_max: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                  rows: Sequence[int] | None = None) -> torch.Tensor:
    """The token ``target_probs`` puts all its mass on when greedy, one per row (shape
    ``logits.shape[:-1]``; arguments as ``process_scores``), without building the one-hot
    law: the greedy walks (``rheoplan.verify``) read only this.

    ``first_max(x) -> (top, index)``: a faster implementation of ``x.max(dim=-1)`` for the
    context-free case (the numba scan ``rheoplan.kernels.argmax.first_max``, which the
    walks of the numba backend pass); default: that torch call. ``rows``: the rows of a
    2-D ``logits`` to pick and check, in that order (default: every row; ``input_ids``
    then holds one row per picked row); a caller whose rows lie in a larger tensor (the
    batched walk's projected block) passes it as it is, with no copy of the rows it wants
    (the others are read, not checked).

    Example:
        >>> greedy_tokens(torch.tensor([[0., 2., 2.], [5., 0., 1.]]), SamplingConfig(temperature=0)).tolist()
        [1, 0]
    """
    if not sampling.greedy:
        raise ValueError(f"greedy_tokens: sampling.temperature={sampling.temperature}: allowed 0 (greedy)")
    if rows is not None and (sampling.needs_context or processors or logits.numel() == 0):
        logits, rows = logits[list(rows)], None
    if sampling.needs_context or processors or logits.numel() == 0:
        return _greedy(process_scores(logits, sampling, input_ids, processors, check))
    # Nothing processes greedy scores without a context rule: one pass over V gives both the
    # check (``broken_maxima``) and the token (``max`` returns the first index of the
    # maximum, as ``_greedy``'s argmax), where ``process_scores`` then ``_greedy`` made two
    # (16 rows x 49k on the 2-core CPU: 0.56 -> 0.47 ms on their own, 0.87 -> 0.75 ms
    # inside batched decodes).
    x = logits.to(torch.float32)
    top, token = x.max(dim=-1) if first_max is None else first_max(x)
    if rows is not None:
        at = torch.as_tensor(list(rows), dtype=torch.int64)
        top, token = top[at], token[at]
    if check and bool(broken_maxima(top)):
        raise ValueError(BROKEN_TARGET)
    return token


@dataclass(frozen=True)
class SubsetLogits:
    """Draft logits over a subset of the target vocabulary: ``logits [..., V']`` at the
    target ids ``ids [V']`` (strictly increasing); every other token has draft probability
    0. The same draft law as the dense ``[..., V]`` logits with ``-inf`` outside ``ids``
    (``dense``), without materialising the ``V - V'`` zeros: an EAGLE-3 head over a
    reduced vocabulary (8192 of SmolLM2's 49152 tokens) returns this, and the ``expand``
    passes take the softmax and the top-S over ``V'`` columns, then map the chosen columns
    to target ids. Increasing ids keep "ties to the lower id" the same in both forms.

    Example:
        >>> sub = SubsetLogits(torch.tensor([[0.0, 1.0]]), torch.tensor([1, 3]))
        >>> sub.dense(4)
        tensor([[-inf, 0., -inf, 1.]])
    """

    logits: torch.Tensor
    ids: torch.Tensor

    def dense(self, vocab_size: int) -> torch.Tensor:
        """The same logits over the whole vocabulary, ``-inf`` outside ``ids`` (float32)."""
        x = self.logits.to(torch.float32)
        out = torch.full((*x.shape[:-1], vocab_size), float("-inf"), device=x.device)
        out[..., self.ids.to(x.device)] = x
        return out


def draft_scores(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``logits / T_d`` in float32 (``T_d = T``, 1 when greedy), whose softmax is the draft law."""
    x = logits.to(torch.float32)
    T = sampling.draft_temperature
    return x if T == 1.0 else x / T  # x / 1 is exact: skipping it changes no bit


def draft_probs(logits: torch.Tensor, sampling: SamplingConfig, check: bool = True) -> torch.Tensor:
    """Draft law ``softmax(logits / T_d)`` in float32, ``T_d = T`` (1 when greedy).

    The check reads the scores after the division: finite logits that overflow to +inf
    when divided by a temperature below 1 would give a NaN law (and no tree) as surely as
    a NaN logit. ``check=False`` skips it (a host sync); the caller then checks
    ``broken_rows(draft_scores(...))`` itself (the Triton planner defers it to the end of
    planning).
    """
    q = torch.softmax(draft_scores(logits, sampling), dim=-1)
    # A broken row's softmax is NaN in every entry: its sum is NaN (a NaN entry, or the
    # NaN of inf - inf where its max is +inf, or of -inf - -inf where nothing is finite),
    # and every entry is divided by it; a row without NaN or +inf and with a finite entry
    # sums to >= 1. So its first column tells, with no second pass over V.
    if check and q.shape[-1] and bool(torch.isnan(q[..., 0]).any()):
        raise ValueError(BROKEN_DRAFT)
    return q


def rank_support(q: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``support`` tokens of each row of ``q [n, V]`` by q descending, ties lower id.

    Returns ``(tokens [n, S'], q [n, S'])`` with ``S' = min(support, V)``.
    """
    V = q.shape[-1]
    s = min(support, V)
    if 4 * s >= V:
        vals, idx = torch.sort(q, dim=-1, descending=True, stable=True)
        return idx[..., :s].contiguous(), vals[..., :s].contiguous()
    # Large vocabularies: a full stable sort of V entries is the planner's hot spot. Same
    # result, cheaper: every top-s entry is >= the s-th largest value, so stable-sorting
    # just the entries >= that value (all boundary ties included) gives the same ranks.
    kth = torch.topk(q, s, dim=-1).values[..., -1:]
    c = int((q >= kth).sum(dim=-1).max())
    cand_q, cand_i = torch.topk(q, c, dim=-1)  # holds every entry >= kth, in any order
    by_id = torch.argsort(cand_i, dim=-1)
    cand_q, cand_i = torch.gather(cand_q, -1, by_id), torch.gather(cand_i, -1, by_id)
    order = torch.sort(cand_q, dim=-1, descending=True, stable=True).indices[..., :s]
    return torch.gather(cand_i, -1, order).contiguous(), torch.gather(cand_q, -1, order).contiguous()


def tail_mass(sup_q: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``z`` = mass of ranks ``m+1..n`` of each row of ``sup_q [R, S]``, float64 ``[R]``.

    Every implementation sums with this torch reduction: a sequential loop rounds
    differently in the last bit now and then.
    """
    return sup_q[..., m:n].to(torch.float64).sum(dim=-1)


def tail_law_rows(sup_q: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``tail_law`` for every row of ``sup_q [R, S]`` at once: ``[R, n - m]`` float64."""
    tail = sup_q[..., m:n].to(torch.float64)
    z = tail_mass(sup_q, m, n).unsqueeze(-1)
    return torch.where(z > 0, tail / torch.where(z > 0, z, 1.0), 1.0 / max(n - m, 1))


def tail_law(sup_q: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The sampled slot's exact proposal law q~ over ranks ``m+1..n`` (float64, sums to 1).

    ``sup_q`` is one expanded node's ranked support probabilities. If the tail has no
    mass (the top ``m`` hold all of it), q~ is uniform over the tail: any fixed law is
    lossless as long as drafting and verification use the same one, which they do by
    both calling this function.

    Example: sup_q [0.5, 0.3, 0.2], m = 1 -> [0.6, 0.4] (for ranks 2 and 3).
    """
    return tail_law_rows(sup_q[None], m, n)[0]
