"""The rates behind the ETAs of the sampling and training jobs' progress lines."""

from __future__ import annotations

import pytest

from rheoplan.train.progress import RecentRate


def test_the_recent_rate_forgets_a_pause_once_a_window_has_passed():
    """The ETA's rate: a job stopped for a while reads its running speed again once a
    window of readings has passed since it resumed, while the run's average stays low."""
    r = RecentRate(window=60)
    assert r.rate() is None
    r.add(0, 0)
    assert r.rate() is None and r.span() == 0
    for t in range(10, 70, 10):  # running at 10 tok/s
        r.add(t, 10 * t)
    assert r.rate() == 10 and r.span() == 60
    r.add(1000, 600)  # stopped from 60 s to 1000 s
    assert r.rate() == 0 and r.span() == 940
    for t in range(1010, 1070, 10):  # running again
        r.add(t, 600 + 10 * (t - 1000))
    assert r.rate() == 10 and r.span() == 60


def test_the_recent_rate_rejects_a_bad_window_and_time_going_back():
    with pytest.raises(ValueError, match="window"):
        RecentRate(window=0)
    r = RecentRate(window=60)
    r.add(5, 0)
    with pytest.raises(ValueError, match="back in time"):
        r.add(4, 1)
