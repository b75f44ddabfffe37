"""The in-flight bound: how many tickets may be between poll and commit, and when to pause or resume.

Counting up to the *commit* (not just the produce) keeps two promises with one number: memory holds at most
`max_in_flight` tickets whatever the input rate, and a crash re-delivers at most `max_in_flight` tickets
(everything past the committed position is tracked, so it is counted here).

Pausing is only half of back-pressure: the consumer must keep calling poll while paused, or the group evicts
it after `max.poll.interval.ms` (the bug peers hit). The loop therefore never blocks on this gate; it asks how
many messages it may take (`capacity`) and whether the partitions should be paused or resumed, with a gap
between the two levels so that it does not flap at the bound.
"""

from __future__ import annotations

import enum


class Flow(enum.Enum):
    """What the consumer should do with its assigned partitions after the count changed."""

    KEEP = "keep"
    PAUSE = "pause"
    RESUME = "resume"


class InFlightGate:
    """Pause at `max_in_flight`, resume once the count is at or below `resume_below`."""

    def __init__(self, max_in_flight: int, resume_below: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not 0 <= resume_below < max_in_flight:
            raise ValueError(f"resume_below must be in [0, {max_in_flight}), got {resume_below}")
        self.max_in_flight = max_in_flight
        self.resume_below = resume_below
        self.paused = False
        self.in_flight = 0
        self.max_seen = 0

    def capacity(self) -> int:
        """How many more messages the loop may take from Kafka now (0 while paused)."""
        if self.paused:
            return 0
        return max(0, self.max_in_flight - self.in_flight)

    def update(self, in_flight: int) -> Flow:
        """Record the current count (`max_seen` keeps the peak, for the gauge); says whether to pause or
        resume the partitions."""
        self.in_flight = in_flight
        self.max_seen = max(self.max_seen, in_flight)
        if not self.paused and in_flight >= self.max_in_flight:
            self.paused = True
            return Flow.PAUSE
        if self.paused and in_flight <= self.resume_below:
            self.paused = False
            return Flow.RESUME
        return Flow.KEEP
