"""``rheoplan.mutation``: the test-only lossy switches are off by default, on only inside
``rheoplan.testing.mutation(...)``, and unknown names are refused up front."""

from __future__ import annotations

import inspect
import threading

import pytest

import rheoplan
from rheoplan.mutation import MUTATIONS, active
from rheoplan.rng import Purpose, Streams
from rheoplan.testing import mutation


def test_switches_are_off_by_default_and_scoped_to_the_with_block():
    assert not any(active(n) for n in MUTATIONS)
    with mutation("raw_q_ratio") as on:
        assert on == frozenset({"raw_q_ratio"})
        assert active("raw_q_ratio") and not active("skip_pruned_sampled")
        with mutation("skip_pruned_sampled"):
            assert active("raw_q_ratio") and active("skip_pruned_sampled")
        assert not active("skip_pruned_sampled")
    assert not active("raw_q_ratio")


def test_switch_is_reset_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with mutation("reuse_draft_stream"):
            raise RuntimeError("boom")
    assert not active("reuse_draft_stream")


def test_switch_does_not_leak_into_another_thread():
    seen = []
    with mutation("raw_q_ratio"):
        t = threading.Thread(target=lambda: seen.append(active("raw_q_ratio")))
        t.start()
        t.join()
    assert seen == [False]


def test_reuse_draft_stream_collapses_the_verify_purposes():
    s = Streams(3)
    assert s.purpose_key(Purpose.VERIFY_ACCEPT) == int(Purpose.VERIFY_ACCEPT)
    with mutation("reuse_draft_stream"):
        assert s.purpose_key(Purpose.VERIFY_ACCEPT) == int(Purpose.DRAFT_SAMPLE)
        assert s.purpose_key(Purpose.DRAFT_SAMPLE) == int(Purpose.DRAFT_SAMPLE)


@pytest.mark.parametrize("names,err,words", [
    (("raw_q",), ValueError, ["raw_q", "raw_q_ratio", "skip_pruned_sampled"]),
    ((frozenset({"raw_q_ratio"}),), TypeError, ["frozenset", "raw_q_ratio"]),
])
def test_unknown_or_mistyped_names_are_refused(names, err, words):
    with pytest.raises(err) as e:
        with mutation(*names):
            pass
    for w in words:
        assert w in str(e.value)
    assert not any(active(n) for n in MUTATIONS)


def test_no_public_signature_carries_mutations():
    from rheoplan.testing import exact_law, functional_decode
    from rheoplan.verify import coupling_law, walk

    for fn in (rheoplan.plan_and_decode, rheoplan.plan_tree, walk, coupling_law, exact_law, functional_decode):
        assert "mutations" not in inspect.signature(fn).parameters, fn.__name__
    assert not hasattr(Streams(0), "reuse_draft_stream")
