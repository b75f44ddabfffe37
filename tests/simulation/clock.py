"""Virtual time: the one clock of a simulated run, moved on only by waits.

Every wait of the run — a consumer's or producer's poll with nothing to hand out, the model's poll with
no answer due, a committer waited for — calls `wait(timeout)`, which moves the clock to the earlier of the
wait's end and the next scheduled action, and runs the actions due (a SIGTERM, a rebalance, a record
arriving, kill -9). A read of the clock (`__call__`) moves it by a microsecond, as a real loop's work takes
time, so that a loop that never waits still sees time pass. Nothing sleeps: a schedule of a minute of
virtual time runs in milliseconds, and the same seed gives the same run.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

# How far one read of the clock moves it: the loop's own work between two waits.
READ_S = 1e-6


class Killed(BaseException):
    """kill -9: raised out of a wait of the running worker; nothing after it runs in that process."""


class Hung(BaseException):
    """The run went past its budget of virtual time or clock reads: the loop did not end."""


class VirtualClock:
    """Virtual seconds from `start`; `at(when, action)` schedules an action, run by the first wait that
    reaches `when`. `budget_s` / `budget_reads`: past either, the next wait raises `Hung`."""

    def __init__(
        self, start: float = 1000.0, budget_s: float = 3600.0, budget_reads: int = 3_000_000
    ) -> None:
        self.start = self.now = start
        self._actions: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.reads = 0
        self.waits = 0
        self._end = start + budget_s
        self._budget_reads = budget_reads

    def __call__(self) -> float:
        self.reads += 1
        self.now += READ_S
        return self.now

    def peek(self) -> float:
        """The time, without counting as a read (the fakes' own bookkeeping: a lock's start, say)."""
        return self.now

    @property
    def elapsed(self) -> float:
        return self.now - self.start

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._actions, (when, next(self._order), action))

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        self.at(self.now + seconds, action)

    def next_at(self) -> float:
        return self._actions[0][0] if self._actions else float("inf")

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds: until then, or until the next action, which runs (with every
        other action due)."""
        self.waits += 1
        if self.now > self._end or self.reads > self._budget_reads:
            raise Hung(f"still running after {self.elapsed:.1f} virtual s and {self.reads} clock reads")
        target = self.now + max(0.0, timeout)
        self.now = max(self.now, min(target, self.next_at()))
        self.run_due()

    def run_due(self) -> None:
        while self._actions and self._actions[0][0] <= self.now:
            _, _, action = heapq.heappop(self._actions)
            action()

    def until(self, when: float) -> None:
        """Between two workers: time passes to `when`, running what is due on the way."""
        while self.next_at() <= when:
            self.now = max(self.now, self.next_at())
            self.run_due()
        self.now = max(self.now, when)

    def sleep(self, seconds: float) -> None:
        """`time.sleep` for code that sleeps outright."""
        self.wait(seconds)
