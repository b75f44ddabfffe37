"""Seeds to schedules to verdicts: sweep many seeds, shrink a failing schedule, say how to replay it.

`KNOWN` lists the defects the simulator found that are known and not fixed on this branch (issue 55), each
with the seed that shows it: a sweep counts them apart from new failures, and `test_simulation.py` replays
each seed as a strict xfail, which turns red once the defect is fixed (then the entry goes).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .checks import Violation
from .harness import simulate
from .schedule import DOORS, Schedule, generate


@dataclass(frozen=True)
class Known:
    """A known defect: the doors it shows on, the property it breaks, a piece of the violation's detail that
    tells it from others of the property (the code path, say), a seed per door that shows it, and what it
    is."""

    doors: tuple[str, ...]
    prop: str
    detail: str
    seeds: tuple[tuple[str, int], ...]
    what: str

    def matches(self, door: str, violation: Violation) -> bool:
        return door in self.doors and violation.prop == self.prop and self.detail in violation.detail


_ISSUE = "issue 55"
KNOWN: tuple[Known, ...] = (
    Known(
        ("queue",), "archived without an outcome", "Acknowledging._on_delivery", (("queue", 1799),),
        f"{_ISSUE}: a last delivery whose triage record and then dead letter both failed is released to the"
        " broker's own net (its dead-letter topic, where one is configured): nothing else can be written",
    ),
)  # fmt: skip


def known(door: str, violation: Violation) -> Known | None:
    return next((each for each in KNOWN if each.matches(door, violation)), None)


def unknown(door: str, violations: Iterable[Violation]) -> list[Violation]:
    return [violation for violation in violations if known(door, violation) is None]


def replay_command(door: str, seed: int) -> str:
    return f"PYTHONPATH=tests python -m simulation --door {door} --seed {seed} -v"


def shrink(schedule: Schedule, prop: str, budget: int = 300) -> Schedule:
    """A smaller schedule that still breaks `prop`: drop events and inputs, and inputs' faults, one at a
    time while it still fails (at most `budget` runs)."""
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for candidate in schedule.smaller():
            runs += 1
            if any(v.prop == prop for v in simulate(candidate)):
                schedule, improved = candidate, True
                break
            if runs >= budget:
                break
    return schedule


def failure_report(schedule: Schedule, violations: list[Violation], shrunk: Schedule | None = None) -> str:
    lines = [f"FAILED: door {schedule.door}, seed {schedule.seed}"]
    lines += [f"  - {violation.describe()}" for violation in violations]
    shown = shrunk or schedule
    lines.append(("minimal schedule" if shrunk is not None else "schedule") + ":")
    lines.append(shown.describe())
    lines.append(f"replay: {replay_command(schedule.door, schedule.seed)}")
    if shrunk is not None and shrunk != schedule:
        lines.append(
            "replay the minimal schedule: PYTHONPATH=tests python -m simulation -v --schedule "
            f"'{shrunk.to_json()}'"
        )
    return "\n".join(lines)


@dataclass
class Sweep:
    """What a sweep of seeds over a door found."""

    door: str
    runs: int = 0
    seconds: float = 0.0
    failures: list[tuple[int, list[Violation]]] = dataclasses.field(default_factory=list)
    known: Counter[str] = dataclasses.field(default_factory=Counter)
    first_known: dict[str, int] = dataclasses.field(default_factory=dict)


def sweep(
    door: str, seeds: Iterable[int], on_failure: Callable[[int, list[Violation]], None] | None = None
) -> Sweep:
    """Run each seed's schedule on `door`: new failures in `failures`, known defects counted apart."""
    found = Sweep(door)
    began = time.perf_counter()
    for seed in seeds:
        violations = simulate(generate(door, seed))
        found.runs += 1
        for violation in violations:
            if (defect := known(door, violation)) is not None:
                found.known[defect.what] += 1
                found.first_known.setdefault(defect.what, seed)
        new = unknown(door, violations)
        if new:
            found.failures.append((seed, new))
            if on_failure is not None:
                on_failure(seed, new)
    found.seconds = time.perf_counter() - began
    return found


__all__ = ["DOORS", "KNOWN", "Known", "Sweep", "failure_report", "shrink", "sweep", "unknown"]
