"""What every door promises of each input, checked after a run (and, for commits, as each one lands).

A door's harness (`harness.py`) collects what became of each input — its outcomes (`Outcome`: a triage
record with its fallback reason, or a dead letter with its type and message) and how the door settled it —
and calls these checks. Each broken promise is a `Violation`, named by a stable `prop` (the property) so
that a known defect can be told from a new one (`KNOWN` in `runner.py`).

The properties, per door (a door's harness adds its own settlement checks):

- every input ends with exactly one triage record or one dead letter, or is still available to the group
  (a healthy worker run after the schedule settles it) — never settled, committed past or archived without
  an outcome; duplicates only where the door's promise allows them (at least once, after a crash, a loss,
  a stop or a redelivery), never in exactly-once as read_committed readers see it;
- what the outcome is: a poison record is a dead letter; a valid ticket a triage record (or a dead letter
  for a refused result, or its last delivery spent); a ticket past its `deadline_at` the
  `expired_on_arrival` fallback; a ticket the model raised on is answered `model_error`, never
  dead-lettered as if its model process had died;
- the loop never raises, never exits non-zero because of a record, always ends.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from worker.kafka.dead_letters import DELIVERY_COUNT_EXCEEDED, RESULT_REFUSED

from .schedule import Input

# The dead letters a valid ticket may end as.
_VALID_DEAD_LETTERS = {RESULT_REFUSED, DELIVERY_COUNT_EXCEEDED}
_DEATH = "model process died"


@dataclass(frozen=True)
class Outcome:
    """One output for an input: a triage record (`dead` False, its fallback `reason` or None) or a dead
    letter (its error type as `reason`, its message)."""

    dead: bool
    reason: str | None
    message: str = ""

    def describe(self) -> str:
        if self.dead:
            return f"dead letter {self.reason} ({self.message})"
        return "triage record" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True)
class Violation:
    prop: str
    index: int | None
    detail: str

    def describe(self) -> str:
        where = f"input #{self.index}: " if self.index is not None else ""
        return f"{self.prop}: {where}{self.detail}"


def outcome_checks(each: Input, outs: Sequence[Outcome], died: Collection[int] = ()) -> list[Violation]:
    """What the outcomes of `each` must be, whatever the door (those it has; none is checked elsewhere);
    `died`: the inputs a model process died under at least once."""
    found: list[Violation] = []
    said = "; ".join(out.describe() for out in outs)
    results = [out for out in outs if not out.dead]
    letters = [out for out in outs if out.dead]
    if not each.valid and results:
        found.append(Violation("poison record classified", each.index, f"{each.shape}: {said}"))
    if each.valid:
        wrong = [out for out in letters if out.reason not in _VALID_DEAD_LETTERS]
        if wrong:
            found.append(Violation("valid ticket dead-lettered", each.index, f"{each.shape}: {said}"))
    if each.shape in ("deadline_past", "deadline_past_lower"):
        classified = [out for out in results if out.reason != "expired_on_arrival"]
        if classified:
            found.append(
                Violation("ticket past its deadline_at classified", each.index, f"{each.shape}: {said}")
            )
    if each.raises and each.index not in died and any(_DEATH in out.message for out in letters):
        found.append(
            Violation(
                "model error dead-lettered as a dead model process",
                each.index,
                f"the model raised on it (it never died): {said}",
            )
        )
    return found
