"""The fault simulator in the fast tier: thousands of generated schedules over every door, each input held
to its door's promise (see `tests/simulation/__init__.py`); the known defects of issue 55 replayed from
their seeds as strict xfails, so that each turns red once it is fixed and its entry in `runner.KNOWN` must
go.

A failure prints the door, the seed, the broken promises, a shrunk schedule and the command that replays
it. `SIM_SEEDS` (seeds per door) changes how many schedules run; `make simulate` runs a longer soak.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import structlog

from .harness import HARNESSES, simulate
from .runner import KNOWN, Known, failure_report, shrink, sweep
from .schedule import DOORS, generate

# Seeds per door in the fast tier, in proportion to what a schedule of the door costs (about 20-40 s for
# all of them on two shared cores).
SEEDS = {"group-alo": 250, "group-eos": 250, "queue": 500, "replay-alo": 350, "replay-eos": 350, "lines": 700}
_SCALE = float(os.environ.get("SIM_SCALE", "1"))


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """The engine's log lines cost more than the simulated run; they are dropped here (`-v` replays them)."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    try:
        yield
    finally:
        structlog.configure(**saved)


@pytest.mark.parametrize("door", DOORS)
def test_every_input_ends_as_its_door_promises_over_generated_schedules(door: str) -> None:
    count = max(1, round(SEEDS[door] * _SCALE))
    found = sweep(door, range(count))
    if found.failures:
        seed, violations = found.failures[0]
        schedule = generate(door, seed)
        shrunk = shrink(schedule, violations[0].prop, budget=60)
        others = [other for other, _ in found.failures[1:]]
        pytest.fail(
            f"{failure_report(schedule, violations, shrunk)}\n"
            f"{len(found.failures)} of {found.runs} schedules failed (the other seeds: {others[:20]})",
            pytrace=False,
        )


@pytest.mark.parametrize("door", DOORS)
def test_a_seed_replays_the_same_run(door: str) -> None:
    for seed in range(5):
        runs = []
        for _ in range(2):
            harness = HARNESSES[door](generate(door, seed))
            violations = harness.run()
            runs.append((violations, harness.clock.reads, harness.clock.waits, harness.workers))
        assert runs[0] == runs[1], f"{door} seed {seed} ran differently the second time"


def _known_cells() -> Iterator[object]:
    for defect in KNOWN:
        for door, seed in defect.seeds:
            yield pytest.param(
                defect, door, seed, id=f"{door}-{seed}-{defect.prop}-{defect.detail or 'any'}",
                marks=pytest.mark.xfail(strict=True, reason=defect.what),
            )  # fmt: skip


@pytest.mark.parametrize(("defect", "door", "seed"), list(_known_cells()))
def test_known_defect_is_fixed(defect: Known, door: str, seed: int) -> None:
    """Fails while the defect is there (xfail); passes once it is fixed, which strict xfail reports as a
    failure: then the defect's entry in `runner.KNOWN` goes, and the sweep above holds the door to it."""
    violations = [v for v in simulate(generate(door, seed)) if defect.matches(door, v)]
    assert not violations, "; ".join(v.describe() for v in violations)
