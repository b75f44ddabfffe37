"""Queue mode's arithmetic of the record lock: what may still be taken from a polled batch, and which
settings can never fit.

A share group locks each record it hands out for `share.record.lock.duration.ms` (30 s by default, 15-60 s).
A record not acknowledged by then goes to another member (its delivery count + 1), and a late ACCEPT can
report success although that member already wrote the record again (measured, docs/design.md#queue-mode).
So a record is taken into the model stage only while its whole path still fits before the lock expires:

    now + deadline + delivery wait  <  lock start + lock - margin

`deadline` is `pipeline.deadline_ms` (a ticket's model time never exceeds it: later it is answered with a
fallback); the delivery wait is the producer's `delivery.timeout.ms` (after it a delivery fails and the
record is released); `margin` covers the acknowledgement's own trip to the broker. The lock starts when the
broker acquired the batch, which is no later than the start of the poll that returned it: the client fetches
in the background only while it holds no unacknowledged records, i.e. just before the loop polls again.

`check` refuses, in one line, settings where even a record taken at the very start of its lock cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import UserError

# The acknowledgement's trip to the broker, and the loop's own turn, after the record's output is written.
MARGIN_S = 1.0


@dataclass(frozen=True)
class LockBudget:
    """`lock_s`: the group's record lock; `deadline_s`: a ticket's model time at most; `delivery_s`: the
    producer's delivery timeout."""

    lock_s: float
    deadline_s: float
    delivery_s: float

    @property
    def needed_s(self) -> float:
        """The longest a taken record can take until its outcome is known."""
        return self.deadline_s + self.delivery_s + MARGIN_S

    def check(self) -> None:
        """Refuse settings where a record taken at once could still outlive its lock."""
        if self.needed_s >= self.lock_s:
            raise UserError(
                f"config error: queue mode: pipeline.deadline_ms ({self.deadline_s * 1000:.0f}) + the "
                f"producer's delivery.timeout.ms ({self.delivery_s * 1000:.0f}) + {MARGIN_S * 1000:.0f} ms "
                f"must be under the share group's record lock ({self.lock_s * 1000:.0f} ms, "
                "share.record.lock.duration.ms): a ticket could be redelivered while it is still at work"
            )

    def may_take(self, lock_from: float, now: float) -> bool:
        """Whether a record of a batch whose lock started at `lock_from` can still finish inside the lock."""
        return now + self.needed_s < lock_from + self.lock_s

    def may_answer(self, lock_from: float, now: float) -> bool:
        """Whether an answer written now, without the model, can still be delivered inside that lock."""
        return now + self.delivery_s + MARGIN_S < lock_from + self.lock_s

    def answer_by(self, lock_from: float) -> float:
        """The last instant an answer written without the model can still be delivered inside that lock
        (where `may_answer` turns False)."""
        return lock_from + self.lock_s - self.delivery_s - MARGIN_S

    def expires_at(self, lock_from: float) -> float:
        """When records of that batch not acknowledged yet must be released (their lock is about to end)."""
        return lock_from + self.lock_s - MARGIN_S
