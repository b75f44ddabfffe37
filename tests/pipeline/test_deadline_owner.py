"""A ticket's deadline has one owner, its loop's `Limits.deadline_s` (set once in `Engine._take`), with the
producer's earlier `deadline_at` applied once (`triage/deadlines.py`): the intake does not set it again from
its own copy of `pipeline.deadline_ms`, so a door whose `Limits` say otherwise is held to its own."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Sequence

from doubles import InstantClassifier

from worker.app.doors import TriageParts, triage_stage
from worker.app.doors import limits as door_limits
from worker.classification import ClassifyRequest, FallbackLabel
from worker.pipeline.engine import Engine, GiveUpAt
from worker.pipeline.failure import Failure
from worker.pipeline.settlements.in_order import InOrder
from worker.pipeline.sources.lines import Line, LineReader, LinesSource
from worker.pipeline.triage.dispatch_queue import DispatchQueue
from worker.pipeline.triage.requests import ModelRequests
from worker.pipeline.work import Output, Work
from worker.settings import load_settings

FALLBACK = FallbackLabel("unclassified", "Medium")
# The section's deadline, and the door's own (its Limits): far apart, so that either shows.
SECTION_MS, LIMITS_S = 60_000, 5.0


class _Timed(InstantClassifier):
    """Answers at once; keeps each request's time left when it was submitted, by its text."""

    def __init__(self) -> None:
        super().__init__()
        self.time_left: dict[str, float] = {}

    def submit(self, request: ClassifyRequest) -> None:
        self.time_left[request.text] = request.deadline - time.monotonic()
        super().submit(request)


def _at(seconds_from_now: float) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds_from_now)
    return moment.isoformat().replace("+00:00", "Z")


def _line(index: int, body: str, deadline_at: str | None = None) -> Line:
    metadata = "" if deadline_at is None else f', "metadata": {{"deadline_at": "{deadline_at}"}}'
    return index, f'{{"ticket_id": "T-{index}", "body": "{body}"{metadata}}}'.encode(), None


def _run(lines: Sequence[Line], classifier: _Timed) -> list[Output]:
    """The lines door's parts, with a loop whose Limits give each ticket `LIMITS_S`, where the settings'
    `pipeline.deadline_ms` says `SECTION_MS`."""
    settings = load_settings(env={}, overrides={"pipeline.deadline_ms": SECTION_MS})
    parts = TriageParts(classifier, FALLBACK, 4)
    metrics = parts.metrics(LIMITS_S)
    outputs: list[Output] = []

    def deliver(work: Work, output: Output) -> None:
        outputs.append(output)

    settlement = InOrder(deliver)
    source = LinesSource(LineReader(iter(lines), "lines"), lambda: settlement.held)
    queue, requests = DispatchQueue("fifo"), ModelRequests()
    stage = triage_stage(
        settings, parts, queue, requests, settlement, source.hand_back, metrics, time.monotonic
    )
    limits = dataclasses.replace(
        door_limits(settings),
        max_in_flight=8,
        resume_below=4,
        deadline_s=LIMITS_S,
        poll_timeout_s=0.05,
        shutdown_timeout_s=5.0,
        paced_by_model=True,
    )
    engine = Engine(source, stage, settlement, limits, metrics, Failure(), GiveUpAt(), lifecycle_log=False)
    assert engine.run() == 0
    return outputs


def test_a_ticket_s_deadline_is_its_loop_s_with_the_producer_s_earlier_deadline_at_applied_once() -> None:
    classifier = _Timed()
    lines = [
        _line(0, "no deadline_at"),
        _line(1, "deadline_at later than the loop's", _at(30.0)),
        _line(2, "deadline_at earlier than the loop's", _at(2.0)),
    ]
    outputs = _run(lines, classifier)

    assert len(outputs) == 3
    left = classifier.time_left
    # The loop's deadline, not the section's 60 s (nor the producer's later 30 s, which is ignored).
    assert LIMITS_S - 1.0 < left["no deadline_at"] <= LIMITS_S
    assert LIMITS_S - 1.0 < left["deadline_at later than the loop's"] <= LIMITS_S
    assert 1.0 < left["deadline_at earlier than the loop's"] <= 2.0
