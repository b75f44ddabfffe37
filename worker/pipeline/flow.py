"""The in-flight bound: how many tickets may be between poll and commit, and when to pause or resume.

Counting up to the *commit* (not just the produce) keeps two promises with one number: memory holds at most
`max_in_flight` tickets whatever the input rate, and a crash re-delivers at most `max_in_flight` tickets
(everything past the committed position is tracked, so it is counted here).

At the bound the loop stops taking records. Briefly, it simply does not poll (commit confirmations arrive on
their own thread, see `committer.py`); that is the steady state with a fast model, where slots free up within
a commit round trip. Only when the bound holds for `pause_after_s` (a slow model) are the partitions paused,
because a paused consumer can be polled without handing over records: the consumer must keep calling poll, or
the group evicts it after `max.poll.interval.ms` (the bug peers hit). Pausing is not the first resort because
librdkafka discards a paused partition's prefetched records and restarts its fetcher only about a second
after the resume. Partitions resume at `resume_below`, a gap below the bound so that they do not flap.
"""

from __future__ import annotations

import enum


class Flow(enum.Enum):
    """What the consumer should do with its assigned partitions after the count changed."""

    KEEP = "keep"
    PAUSE = "pause"
    RESUME = "resume"


class InFlightGate:
    """Pause once the count has stayed at `max_in_flight` for `pause_after_s`; resume at `resume_below`."""

    def __init__(self, max_in_flight: int, resume_below: int, pause_after_s: float = 0.0) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not 0 <= resume_below < max_in_flight:
            raise ValueError(f"resume_below must be in [0, {max_in_flight}), got {resume_below}")
        self.max_in_flight = max_in_flight
        self.resume_below = resume_below
        self.pause_after_s = pause_after_s
        self._full_since: float | None = None
        self.paused = False
        self.in_flight = 0
        self.max_seen = 0

    def capacity(self) -> int:
        """How many more messages the loop may take from Kafka now (0 while paused)."""
        if self.paused:
            return 0
        return max(0, self.max_in_flight - self.in_flight)

    def may_poll(self) -> bool:
        """Whether polling is safe: there is room for records, or the partitions are paused (a poll then only
        serves callbacks and keeps the member alive)."""
        return self.paused or self.in_flight < self.max_in_flight

    def update(self, in_flight: int, now: float = 0.0) -> Flow:
        """Record the current count at time `now` (`max_seen` keeps the peak, for the gauge); says whether to
        pause or resume the partitions."""
        self.in_flight = in_flight
        self.max_seen = max(self.max_seen, in_flight)
        if in_flight < self.max_in_flight:
            self._full_since = None
        elif self._full_since is None:
            self._full_since = now
        full_for = None if self._full_since is None else now - self._full_since
        if not self.paused and full_for is not None and full_for >= self.pause_after_s:
            self.paused = True
            return Flow.PAUSE
        if self.paused and in_flight <= self.resume_below:
            self.paused = False
            return Flow.RESUME
        return Flow.KEEP
