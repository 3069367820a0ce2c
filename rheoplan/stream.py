"""``decode_requests``: batched decoding of an open-ended stream of requests.

``plan_and_decode`` with a list of prompts (and ``max_batch_size``) decodes prompts known
up front and returns when all are done. A server does not know its prompts up front:
``decode_requests`` takes them from an iterable or a ``queue.Queue`` while it decodes,
keeps at most ``max_batch_size`` rows in each step, and yields each request's result as
soon as it finishes (continuous batching: a long request never holds short ones
hostage). The loop is ``plan_and_decode``'s batched loop (``rheoplan.decode.run_rows``):
every row is exact, and request ``i`` draws from stream ``(seed, stream_id)``, its
stream id ``i`` by default, so it gets the tokens of row ``i`` of
``plan_and_decode(target, draft, prompts, seed=seed)``.

    >>> from rheoplan import TreeConfig
    >>> from rheoplan.models import hashed_context_lm
    >>> lm = hashed_context_lm(vocab_size=6, seed=1)
    >>> tree = TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=6)
    >>> done = decode_requests(lm, lm, [[0, 1], Request([2, 3], max_new_tokens=2)],
    ...                        max_batch_size=1, max_new_tokens=4, tree=tree, seed=0)
    >>> [(i, len(r.tokens)) for i, r in done]
    [(0, 4), (1, 2)]
"""

from __future__ import annotations

import numbers
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Sequence

from rheoplan.backends import check_backend
from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.costmodel import CostModel
from rheoplan.decode import (BatchState, DecodeResult, _check_context, _check_int, _check_memory, _check_prompt,
                             _Row, _warm_up, check_decode_args, check_models, prefill_overhead, run_rows)
from rheoplan.models import as_draft, as_target


@dataclass(frozen=True)
class Request:
    """One prompt of ``decode_requests`` with its own settings.

    ``max_new_tokens``: this request's limit (default: ``decode_requests``'
    ``max_new_tokens``). ``stream_id``: its random stream (default: its index in the
    stream of requests); two live requests never share one. ``cancelled``: a
    ``threading.Event`` the caller may set (its client went away): the request leaves the
    batch before the next step and is yielded with the tokens it had, ``stopped_by
    'cancelled'``; set before it joins, it is yielded without a prefill or a token.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int | None = None
    stream_id: int | None = None
    cancelled: threading.Event | None = None


class _Source:
    """Pulls requests when rows are free, checks each one before it joins (errors name
    ``requests[i]``), and makes it a row of the batched loop."""

    def __init__(self, requests, tgt, drf, budget: int | None, max_new_tokens: int, max_batch: int) -> None:
        self.queue = requests if isinstance(requests, queue.Queue) else None
        self.it = None if self.queue is not None else iter(requests)
        self.tgt, self.drf, self.budget = tgt, drf, budget
        self.default, self.max_batch = max_new_tokens, max_batch
        self.count = 0
        self.done = False
        self.keys: set[int] = set()  #: stream ids used so far
        self.rows: list[_Row] = []

    def _next(self, wait: bool):
        if self.queue is not None:
            try:
                item = self.queue.get(block=wait)
            except queue.Empty:
                return None
            if item is None:  # the end of the stream
                self.done = True
            return item
        try:
            return next(self.it)
        except StopIteration:
            self.done = True
            return None

    def take(self, k: int) -> list[_Row]:
        """At most ``k`` new rows; waits on a queue only when no row decodes (``k`` is the
        whole batch), and then for one request only."""
        out = []
        while len(out) < k and not self.done:
            item = self._next(wait=not out and k == self.max_batch)
            if item is None:
                break
            out.append(self._row(item))
        return out

    def _row(self, item) -> _Row:
        i = self.count
        self.count += 1
        where = f"requests[{i}]"
        req = item if isinstance(item, Request) else Request(item)
        try:
            prompt = _check_prompt(req.prompt_ids, self.tgt.vocab_size)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
        limit = self.default if req.max_new_tokens is None else _check_int(
            f"{where}.max_new_tokens", req.max_new_tokens, 1)
        key = i if req.stream_id is None else _check_int(f"{where}.stream_id", req.stream_id, 0)
        if key >= 2**32:
            raise ValueError(f"{where}.stream_id={key} is out of range: allowed [0, 2**32)")
        if key in self.keys:
            raise ValueError(f"{where}.stream_id={key} was used by an earlier request: allowed distinct "
                             "ids (requests sharing a stream would draw the same numbers)")
        self.keys.add(key)
        if req.cancelled is not None and not callable(getattr(req.cancelled, "is_set", None)):
            raise TypeError(f"{where}.cancelled is a {type(req.cancelled).__name__}: allowed a "
                            "threading.Event (anything with is_set()) or None")
        _check_context(self.tgt, len(prompt), limit, self.budget, row=i)
        # a batch of max_batch_size requests like this one must fit (estimated, before its prefill)
        _check_memory(self.tgt, self.drf, [prompt], [limit], self.budget, self.max_batch)
        row = _Row(i, prompt, limit, key, cancelled=req.cancelled)
        self.rows.append(row)
        return row


def decode_requests(target, draft, requests: Iterable | queue.Queue, *, max_batch_size: int,
                    max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                    tree: TreeConfig = TreeConfig(), seed: int | None = None,
                    eos_token_id: int | Sequence[int] | None = None, progress: bool = False, passes=None,
                    callback=None, logits_processors=None, cost_model: CostModel | None = None,
                    backend: str = "auto") -> Iterator[tuple[int, DecodeResult]]:
    """Decode a stream of requests in batches of at most ``max_batch_size`` rows; yield
    ``(index, DecodeResult)`` for each request as it finishes (finishing order; ``index``
    counts the requests from 0 in the order they were taken).

    Args:
        requests: token-id sequences or ``Request`` objects, as an iterable (pulled with
            ``next`` whenever a row is free, so a generator may produce them as they come;
            a pull that blocks holds the batch) or a ``queue.Queue`` (polled without
            waiting while rows decode, waited on when none do; put ``None`` to end it).
        max_batch_size: rows decoding at once (>= 1).
        max_new_tokens: the limit of a request that sets none (>= 1).
        The other arguments are ``plan_and_decode``'s; ``callback(index, new_tokens)``
        streams. ``backend``: 'auto' (numba), 'reference' or 'numba'.

    The arguments are checked here, before any model work; each request is checked when
    it is taken (an error names ``requests[i]`` and ends the stream). Each result's
    ``seconds`` counts from the first step of the decode until the request finished.
    """
    check_backend(backend)
    if backend == "triton":
        raise ValueError("backend='triton' decodes a single sequence (its walk runs one tree): allowed "
                         "backend='auto', 'reference' or 'numba' for decode_requests")
    backend = "numba" if backend == "auto" else backend
    _check_int("max_batch_size", max_batch_size, 1)
    _check_int("max_new_tokens", max_new_tokens, 1)
    if not isinstance(requests, queue.Queue) and (isinstance(requests, (str, bytes, numbers.Number))
                                                  or not isinstance(requests, Iterable)):
        raise TypeError(f"requests is a {type(requests).__name__}: allowed an iterable of token-id "
                        "sequences or Request objects, or a queue.Queue of them")
    seed, processors = check_decode_args(sampling, tree, seed, callback, logits_processors, cost_model)
    return _serve(target, draft, requests, max_batch_size, max_new_tokens, sampling, tree, seed,
                  eos_token_id, progress, passes, callback, processors, cost_model, backend)


def _total_tokens(requests, max_new_tokens: int) -> int | None:
    """The progress bar's total: every request's limit, when ``requests`` is a list or tuple
    (None for a generator or a queue: their length is not known)."""
    if not isinstance(requests, (list, tuple)):
        return None
    total = 0
    for r in requests:
        limit = r.max_new_tokens if isinstance(r, Request) else None
        if limit is not None and not isinstance(limit, int):
            return None  # the request's own check names it when it is taken
        total += max_new_tokens if limit is None else limit
    return total


def _serve(target, draft, requests, max_batch, max_new_tokens, sampling, tree, seed, eos_token_id, progress,
           passes, callback, processors, cost_model, backend) -> Iterator[tuple[int, DecodeResult]]:
    # The adapters are built when the caller starts iterating, so a generator never iterated
    # leaves no hook on the caller's models; the checks that need them run first.
    tgt = as_target(target)
    drf = None
    try:
        drf = as_draft(draft) if draft is not None else None
        eos = check_models(tgt, drf, tree, eos_token_id)
        budget = tree.budget if drf is not None else None
        source = _Source(requests, tgt, drf, budget, max_new_tokens, max_batch)
        if drf is not None:
            _warm_up(backend)
        # as plan_and_decode: with a cost model, prompts that join together are prefilled in
        # groups of similar lengths where that costs less than one padded forward
        state = BatchState(target=tgt, draft=drf, prompts=[], limits=[], keys=[], sampling=sampling, tree=tree,
                           seed=seed, eos=frozenset(eos), passes=passes, backend=backend, progress=progress,
                           callback=callback, processors=processors,
                           cost=cost_model if drf is not None else None, max_batch=max_batch,
                           prefill_overhead=prefill_overhead(cost_model))
        for row in run_rows(state, source.take, total=_total_tokens(requests, max_new_tokens),
                            more=lambda: not source.done):
            yield row.index, row.result
    finally:
        if tgt is not target:
            tgt.close()
        if drf is not None and drf is not draft:
            drf.close()
