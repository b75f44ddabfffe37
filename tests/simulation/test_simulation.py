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

from worker.inference.switch import SwitchingClassifier
from worker.pipeline.settlements.guarantees import AtLeastOnce, ExactlyOnce
from worker.pipeline.settlements.in_order import InOrder
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.sources.share import Acknowledgement, ShareSource
from worker.pipeline.work import Output, Work

from .harness import HARNESSES, simulate
from .runner import KNOWN, Known, failure_report, shrink, sweep
from .schedule import DOORS, Event, Input, Knobs, Schedule, generate

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


# -- the simulator is not blind: defects planted in the engine's parts are found ---------------------------


def _commit_out_of_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug peers shipped: an offset counts as committable as soon as it finishes, before the ones
    below it."""

    def done(self: PartitionOffsets, offset: int) -> None:
        if offset in self._waiting:
            self._waiting.remove(offset)
            self._ready.append(offset)

    monkeypatch.setattr(PartitionOffsets, "done", done)


def _lost_without_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly once: a lost partition's outputs stay in the open transaction, which commits."""
    monkeypatch.setattr(ExactlyOnce, "lost", lambda self, keys: None)


def _release_as_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queue mode: a record given another try is acknowledged ACCEPT instead of RELEASE."""
    acknowledge = ShareSource.acknowledge

    def accept(self: ShareSource, work: Work, outcome: Acknowledgement) -> None:
        release = outcome is Acknowledgement.RELEASE
        acknowledge(self, work, Acknowledgement.ACCEPT if release else outcome)

    monkeypatch.setattr(ShareSource, "acknowledge", accept)


def _lines_as_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline: each line's outcome handed over as it comes, not in input order."""

    def write(self: InOrder, work: Work, output: Output) -> None:
        del self._order[work]
        work.state.done(work.offset)
        self._deliver(work, output)

    monkeypatch.setattr(InOrder, "write", write)


def _replay_reports_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay: a dead letter counts as done when it is republished, before the broker acknowledged it."""
    write = AtLeastOnce.write

    def early(self: AtLeastOnce, work: Work, output: Output) -> None:
        write(self, work, output)
        AtLeastOnce.done(self, work)

    monkeypatch.setattr(AtLeastOnce, "write", early)


def _retire_busy_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hot reload: the old pool is closed at the switch, though tickets at it still owe their answers."""

    def close_all(self: SwitchingClassifier) -> None:
        for pool in list(self._retired):
            self._retired.remove(pool)
            self._closer(pool)

    monkeypatch.setattr(SwitchingClassifier, "_close_finished", close_all)


MUTANTS = {
    "group-alo: commits past an unfinished offset": (
        "group-alo", _commit_out_of_order, "committed past a record without an outcome"
    ),
    "group-eos: a lost partition's transaction commits": (
        "group-eos", _lost_without_abort, "duplicate in exactly-once"
    ),
    "queue: RELEASE sent as ACCEPT": ("queue", _release_as_accept, "accepted without a triage record"),
    "lines: outcomes as they come": ("lines", _lines_as_answered, "lines out of input order or repeated"),
    "replay-alo: done before acknowledged": (
        "replay-alo", _replay_reports_early, "committed past a failed publish"
    ),
    "group-alo: a reload closes the pool still answering": (
        "group-alo", _retire_busy_pool, "a pool's contract broken across a reload"
    ),
}  # fmt: skip


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_planted_defect_is_found(mutant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    door, plant, prop = MUTANTS[mutant]
    plant(monkeypatch)
    for seed in range(400):
        if any(v.prop == prop for v in simulate(generate(door, seed))):
            return
    pytest.fail(f"{mutant}: no schedule of 400 broke {prop!r}")


def test_issue_55_rolling_restart_leaves_no_record_without_an_outcome() -> None:
    """The scenario of issue 55, written out: delivery limit 2, a worker killed with a batch (one producer
    batch, handed out whole), its replacement takes the records on their last delivery and gets SIGTERM (a
    rolling deploy): every record must still end as a triage record or a dead letter. Today 24 of the 30
    are archived with neither (`ShareSource.stop_taking` releases them)."""
    knobs = Knobs(deadline_ms=1000, max_in_flight=4, dispatch_window=2, lock_ms=4000, delivery_count_limit=2,
                  delivery_timeout_ms=1000, shutdown_timeout_ms=500, producer_batch=True)  # fmt: skip
    inputs = tuple(Input(i, "ticket", latency_s=0.2) for i in range(30))
    # Killed with the whole batch; its lock ends at 4 s, the replacement takes it, SIGTERM at 4.3 s.
    events = (Event(0.3, "kill", for_s=0.0), Event(4.3, "stop", for_s=0.1))
    violations = simulate(Schedule("queue", -1, knobs, inputs, events))
    assert not violations, [v.describe() for v in violations]
