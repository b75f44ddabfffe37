"""A replay's progress on its own short-lived port (`replay --metrics-port`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.core import (
    Metric,
)
from prometheus_client.registry import Collector

from worker.replay.outcomes import ReplayOutcome
from worker.settings import MetricsSettings

if TYPE_CHECKING:
    from worker.replay.outcomes import PartitionPlan, RecordReport, ReplayObserver

from worker.telemetry.collectors import by_label, gauge
from worker.telemetry.server import Probes, TelemetryServer, new_registry

REPLAY_OUTCOMES: tuple[str, ...] = tuple(outcome.value for outcome in ReplayOutcome)


class ReplayMetrics(Collector):
    """A replay's progress for Prometheus; forwards the plan and each settled record to `inner` (the bar)."""

    def __init__(self, inner: ReplayObserver) -> None:
        self._inner = inner
        self._planned: int | None = None
        self._settled: dict[str, int] = {}

    def planned(self, plan: list[PartitionPlan]) -> None:
        self._planned = sum(item.end - item.start for item in plan)
        self._inner.planned(plan)

    def settled(self, report: RecordReport) -> None:
        outcome = report.outcome.value
        self._settled[outcome] = self._settled.get(outcome, 0) + 1
        self._inner.settled(report)

    def collect(self) -> Iterator[Metric]:
        yield gauge("triage_replay_planned_records", "Dead letters this run will go through.", self._planned)
        yield by_label(
            "triage_replay_records",
            "Dead letters settled by this run, by outcome.",
            "outcome",
            REPLAY_OUTCOMES,
            self._settled,
        )


@contextmanager
def replay_metrics(
    port: int | None, settings: MetricsSettings, inner: ReplayObserver
) -> Iterator[ReplayObserver]:
    """`inner` as is when `port` is None; else an observer that also serves the progress on `port`
    (while the replay runs: the endpoint closes with it)."""
    if port is None:
        yield inner
        return
    progress = ReplayMetrics(inner)
    registry = new_registry()
    registry.register(progress)
    server = TelemetryServer(msgspec.structs.replace(settings, port=port), registry, Probes())
    # stderr: stdout is the replay's report (or its --json summary).
    print(f"replay metrics on http://{settings.host}:{server.port}/metrics", file=sys.stderr, flush=True)
    try:
        yield progress
    finally:
        server.close()
