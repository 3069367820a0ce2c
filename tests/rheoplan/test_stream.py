"""``decode_requests``: an open-ended stream of requests through the batched loop.

* every request gets the tokens of the same row of ``plan_and_decode``'s batch (the same
  loop and stream ids; that loop's exactness is tested in test_decode_batch.py), from a
  list, a generator pulled only when a row is free, and a ``queue.Queue`` fed by another
  thread while the decode runs; results come in finishing order;
* transformers models with an EAGLE-3 draft (batched caches, rows joining mid-decode);
* bad input: the arguments before any model work, each request when it is taken (the
  error names ``requests[i]``).
"""

from __future__ import annotations

import queue
import threading

import pytest

from _decode_models import random_eagle3_head, tiny_llama
from rheoplan import Request, SamplingConfig, TreeConfig, decode_requests, plan_and_decode
from rheoplan.models.functional import hashed_context_lm

TREE = TreeConfig(depth=3, frontier=2, slots=2, budget=5, rheostat=1, support=6)
PROMPTS = [[0, 1], [2, 3, 4], [5], [1, 1], [3], [4, 4, 4]]
LIMITS = [5, 12, 3, 7, 2, 9]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _lms():
    return hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)


def _batch(tgt, drf, prompts=PROMPTS, limits=LIMITS, **kw):
    return [r.tokens for r in plan_and_decode(tgt, drf, prompts, max_new_tokens=limits, **kw)]


@pytest.mark.parametrize("with_draft", [True, False], ids=["tree", "autoregressive"])
def test_requests_equal_the_rows_of_a_batch(with_draft):
    tgt, drf = _lms()
    drf = drf if with_draft else None
    kw = dict(seed=3, tree=TREE, eos_token_id=4)
    want = _batch(tgt, drf, **kw)
    reqs = [Request(p, max_new_tokens=n) for p, n in zip(PROMPTS, LIMITS)]
    got = list(decode_requests(tgt, drf, reqs, max_batch_size=2, max_new_tokens=1, **kw))
    assert sorted(i for i, _ in got) == list(range(len(PROMPTS)))
    assert {i: r.tokens for i, r in got} == dict(enumerate(want))
    # finishing order, not request order
    order = [i for i, _ in got]
    assert order != sorted(order)
    for i, r in got:
        assert r.stopped_by == ("eos" if 4 in r.tokens else "max_new_tokens")


def test_generator_is_pulled_only_when_a_row_is_free():
    tgt, drf = _lms()
    pulled: list[int] = []

    def gen():
        for i, p in enumerate(PROMPTS[:4]):
            pulled.append(i)
            yield p

    stream = decode_requests(tgt, drf, gen(), max_batch_size=2, max_new_tokens=6, tree=TREE, seed=1)
    assert pulled == []  # nothing runs before the caller iterates
    first, _ = next(stream)
    assert pulled == [0, 1] and first in (0, 1)  # two rows, no request taken ahead of a free row
    rest = list(stream)
    assert pulled == [0, 1, 2, 3] and sorted([first] + [i for i, _ in rest]) == [0, 1, 2, 3]
    # default stream ids are the request indices: the rows of plan_and_decode's batch
    assert {i: r.tokens for i, r in [(first, _)] + rest} == dict(enumerate(
        _batch(tgt, drf, PROMPTS[:4], 6, tree=TREE, seed=1)))


def test_queue_fed_while_decoding():
    """Requests put on a queue by another thread while rows decode join the running batch;
    ``None`` ends the stream. The loop waits on the queue only when no row decodes."""
    tgt, drf = _lms()
    q: queue.Queue = queue.Queue()
    q.put(PROMPTS[0])
    started = threading.Event()

    def producer():
        started.wait(5)
        for p in PROMPTS[1:]:
            q.put(p)
        q.put(None)

    threading.Thread(target=producer, daemon=True).start()
    out = {}
    for i, r in decode_requests(tgt, drf, q, max_batch_size=3, max_new_tokens=8, tree=TREE, seed=2,
                                callback=lambda i, toks: started.set()):
        out[i] = r.tokens
    assert out == dict(enumerate(_batch(tgt, drf, PROMPTS, 8, tree=TREE, seed=2)))


def test_stream_ids_and_limits_per_request():
    tgt, drf = _lms()
    reqs = [Request([0, 1], stream_id=7), Request([2, 3], max_new_tokens=3)]
    got = dict(decode_requests(tgt, drf, reqs, max_batch_size=4, max_new_tokens=5, tree=TREE, seed=9))
    assert got[0].tokens == plan_and_decode(tgt, drf, [[0, 1]], max_new_tokens=5, tree=TREE, seed=9,
                                            stream_ids=[7])[0].tokens
    assert got[1].tokens == plan_and_decode(tgt, drf, [[2, 3]], max_new_tokens=3, tree=TREE, seed=9,
                                            stream_ids=[1])[0].tokens


def test_hf_eagle3_requests_equal_the_rows_of_a_batch():
    target = tiny_llama(2, vocab=32, hidden=32, layers=4, head_scale=20.0)
    from rheoplan.models.eagle3 import Eagle3Draft

    drf = Eagle3Draft(random_eagle3_head(32, 24, seed=5), target.get_input_embeddings(), features_from=target)
    prompts, limits = [[1, 2, 3, 4], [7], [9, 8, 7, 6, 5], [3, 3], [4]], [12, 16, 5, 14, 3]
    tree = TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=32)
    kw = dict(sampling=SamplingConfig(), tree=tree, seed=11, eos_token_id=5)
    want = _batch(target, drf, prompts, limits, **kw)
    reqs = [Request(p, max_new_tokens=n) for p, n in zip(prompts, limits)]
    got = dict(decode_requests(target, drf, iter(reqs), max_batch_size=2, max_new_tokens=1, **kw))
    assert [got[i].tokens for i in range(len(prompts))] == want
    assert sum(len(layer._forward_pre_hooks) for layer in target.model.layers) == 0  # hooks removed


def test_requests_with_a_cost_model_are_prefilled_in_groups(monkeypatch):
    """As ``plan_and_decode``: with a cost model, requests that join together are prefilled
    in length groups (``prefill_groups``), and greedy requests still give the rows of a
    batch decoded alone (float32)."""
    from rheoplan.costmodel import CostModel, Timings
    from rheoplan.models.hf_target import HFTarget

    groups = []
    real = HFTarget._prefill_groups

    def spy(self, ids, with_root, groups_):
        groups.append(groups_)
        return real(self, ids, with_root, groups_)

    monkeypatch.setattr(HFTarget, "_prefill_groups", spy)
    target = tiny_llama(2, vocab=32, hidden=32, layers=2, head_scale=20.0)
    # a forward's fixed cost is 2 tokens' worth: prompts of 1..9 tokens split into groups
    tm = Timings((1, 64), (2.0, 65.0), (2.0, 65.0), 0, 1000, (1, 64), (0.1, 0.5), 0.05, 0.05)
    prompts = [[1] * 9, [2], [3] * 8, [4, 5]]
    kw = dict(sampling=SamplingConfig(temperature=0.0), tree=TreeConfig(depth=2, frontier=1, slots=1, budget=2,
                                                                         support=32), seed=0)
    got = dict(decode_requests(target, target, prompts, max_batch_size=4, max_new_tokens=4,
                               cost_model=CostModel(tm), **kw))
    assert groups and groups[0] is not None and len(groups[0]) > 1
    assert [got[i].tokens for i in range(4)] == _batch(target, target, prompts, [4] * 4, **kw)


def test_progress_total_counts_every_limit_of_a_list():
    from rheoplan.stream import _total_tokens

    assert _total_tokens([[1], Request([2], max_new_tokens=3), Request([4])], 5) == 13
    assert _total_tokens(iter([[1]]), 5) is None  # a generator's length is not known
    assert _total_tokens([Request([2], max_new_tokens="3")], 5) is None  # refused when taken


@pytest.mark.parametrize("with_draft", [True, False], ids=["tree", "autoregressive"])
def test_a_cancelled_request_leaves_and_the_others_keep_their_tokens(with_draft):
    """A request whose event is set mid-decode (here by the stream callback, once it has
    two tokens) leaves before the next step with the tokens it had (a prefix of its
    uncancelled ones), ``stopped_by='cancelled'``; a waiting request takes its place, and
    every other request gets the tokens it gets without the cancellation. A request
    cancelled before it joins is yielded with no token and no step."""
    tgt, drf = _lms()
    drf = drf if with_draft else None
    kw = dict(seed=3, tree=TREE)
    limits = [12, 9, 3, 7]
    want = _batch(tgt, drf, PROMPTS[:4], limits, **kw)
    stop0, stop3 = threading.Event(), threading.Event()
    stop3.set()
    # request 0 leaves from in front of request 1, whose cache rows must follow it
    reqs = [Request(PROMPTS[0], 12, cancelled=stop0), Request(PROMPTS[1], 9), Request(PROMPTS[2], 3),
            Request(PROMPTS[3], 7, cancelled=stop3)]
    seen: dict[int, list[int]] = {}

    def callback(i, new):
        seen.setdefault(i, []).extend(new)
        if i == 0 and len(seen[0]) >= 2:
            stop0.set()

    got = dict(decode_requests(tgt, drf, reqs, max_batch_size=2, max_new_tokens=1, callback=callback, **kw))
    assert got[0].stopped_by == "cancelled" and 2 <= len(got[0].tokens) < 12
    assert got[0].tokens == want[0][:len(got[0].tokens)]
    assert got[3].stopped_by == "cancelled" and got[3].tokens == [] and got[3].steps == []
    assert got[3].first_token_seconds is None
    for i in (1, 2):
        assert got[i].stopped_by == "max_new_tokens" and got[i].tokens == want[i]


class _SetWhileRead:
    """An event another thread sets right after the loop first reads it."""

    def __init__(self):
        self.reads = 0

    def is_set(self) -> bool:
        self.reads += 1
        return self.reads > 1


def test_an_event_set_while_the_loop_reads_it_loses_no_request():
    """Each event is read once per decision: a request whose event is set between two
    reads still either joins or leaves, and is yielded exactly once."""
    tgt, drf = _lms()
    reqs = [Request(PROMPTS[0], 4), Request(PROMPTS[1], 6, cancelled=_SetWhileRead())]
    got = list(decode_requests(tgt, drf, reqs, max_batch_size=2, max_new_tokens=1, tree=TREE, seed=0))
    assert sorted(i for i, _ in got) == [0, 1]
    assert dict(got)[1].stopped_by == "cancelled" and dict(got)[0].stopped_by == "max_new_tokens"


def test_cancelled_must_be_an_event():
    tgt, drf = _lms()
    with pytest.raises(TypeError, match=r"requests\[0\]\.cancelled is a bool: allowed a threading.Event"):
        list(decode_requests(tgt, drf, [Request([0, 1], cancelled=True)], max_batch_size=1, max_new_tokens=2,
                             tree=TREE, seed=0))


@pytest.mark.parametrize("kw, err, match", [
    (dict(max_batch_size=0), ValueError, r"max_batch_size=0 is out of range"),
    (dict(max_new_tokens=0), ValueError, r"max_new_tokens=0 is out of range"),
    (dict(requests=5), TypeError, r"requests is a int: allowed an iterable"),
    (dict(requests="abc"), TypeError, r"requests is a str"),
    (dict(backend="triton"), ValueError, r"backend='triton' decodes a single sequence"),
    (dict(backend="cuda"), ValueError, r"backend"),
    (dict(seed=-1), ValueError, r"seed=-1 is out of range"),
])
def test_bad_arguments_are_refused_at_the_call(kw, err, match):
    tgt, drf = _lms()
    args = dict(requests=[[0, 1]], max_batch_size=2, max_new_tokens=3, tree=TREE, seed=0)
    args.update(kw)
    with pytest.raises(err, match=match):
        decode_requests(tgt, drf, **args)  # not iterated: refused at the call


@pytest.mark.parametrize("reqs, err, match", [
    ([[0, 1], []], ValueError, r"requests\[1\]: .*empty"),
    ([[0, 9]], ValueError, r"requests\[0\]: .*out of range"),
    ([Request([0], max_new_tokens=0)], ValueError, r"requests\[0\].max_new_tokens=0 is out of range"),
    ([Request([0], stream_id=1), [1]], ValueError, r"requests\[1\].stream_id=1 was used by an earlier"),
    ([Request([0], stream_id=-2)], ValueError, r"requests\[0\].stream_id=-2 is out of range"),
])
def test_bad_request_is_refused_when_taken(reqs, err, match):
    tgt, drf = _lms()
    with pytest.raises(err, match=match):
        list(decode_requests(tgt, drf, reqs, max_batch_size=4, max_new_tokens=3, tree=TREE, seed=0))
    assert tgt.n_calls == drf.n_calls == 0  # the batch is taken (and checked) before any model work


def test_eos_out_of_range_is_refused_before_model_work():
    tgt, drf = _lms()
    with pytest.raises(ValueError, match="eos_token_id"):
        next(decode_requests(tgt, drf, [[0, 1]], max_batch_size=1, max_new_tokens=2, eos_token_id=99,
                             tree=TREE, seed=0))
    assert tgt.n_calls == drf.n_calls == 0
