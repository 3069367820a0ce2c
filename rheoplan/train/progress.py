"""Progress lines of long background jobs (sampling, training): rates for their ETAs."""

from __future__ import annotations

#: the window of a progress line's recent rate, which its ETA uses (seconds)
RATE_WINDOW = 600.0


class RecentRate:
    """Work per second (sampled tokens, training steps) over about the last ``window``
    seconds, from ``(time, total)`` readings: what an ETA should use. The run's average
    does not serve there: a job paused with ``kill -STOP`` (as docs/train.md suggests, for
    a measurement beside it) or slowed by other work keeps a low average for hours after
    it runs at full speed again, and the ETA it gives is hours too long; a training run's
    later epochs, which read cached features, run several times faster than its first.

    The rate spans from the newest reading at least ``window`` old (the oldest one
    while the run is younger) to the latest one; None until two readings differ in time.

    Example:
        >>> r = RecentRate(window=60)
        >>> for t, n in [(0, 0), (30, 10), (100, 10), (130, 910)]:  # stopped from 30 to 100 s
        ...     r.add(t, n)
        >>> r.rate(), r.span()  # from the reading at 30 s, the newest one at least 60 s old
        (9.0, 100.0)
        >>> 910 / 130  # the run's average
        7.0
    """

    def __init__(self, window: float = RATE_WINDOW) -> None:
        if not window > 0:
            raise ValueError(f"window={window}: allowed > 0 seconds")
        self.window = float(window)
        self._readings: list[tuple[float, float]] = []

    def add(self, t: float, total: float) -> None:
        """A reading: ``total`` tokens counted by time ``t`` (seconds, not decreasing)."""
        if self._readings and t < self._readings[-1][0]:
            raise ValueError(f"t={t}: readings must not go back in time (last {self._readings[-1][0]})")
        self._readings.append((float(t), float(total)))
        # keep the newest reading at least a window old, and everything after it
        old = [i for i, (ti, _) in enumerate(self._readings) if t - ti >= self.window]
        if old:
            del self._readings[:old[-1]]

    def span(self) -> float:
        """Seconds between the readings ``rate`` spans."""
        return self._readings[-1][0] - self._readings[0][0] if self._readings else 0.0

    def rate(self) -> float | None:
        if not self.span() > 0:
            return None
        (_, n0), (_, n1) = self._readings[0], self._readings[-1]
        return (n1 - n0) / self.span()
