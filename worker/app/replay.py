"""The replay door: `triage-worker replay` on the one loop (`worker.pipeline.engine.Engine`).

The source is the planned dead-letter ranges (`worker/replay/source.py`), the stage selects, repairs and
republishes each dead letter (`worker/replay/stage.py`), and the settlement is the worker's own delivery
guarantee, `pipeline.guarantee` (`worker/pipeline/settlements/guarantees.py`, with no dead-letter topic:
outputs go back where they came from), with the replay's reports as its observer (`worker/replay/reports.py`).
A dry run settles through `InOrder` instead, which produces and commits nothing and hands each output back
as acknowledged. What a replay has of its own:

- its consumer: the replay's group (never the worker's, `selection.default_group`), end-of-partition events,
  read_committed; its partitions assigned, not subscribed;
- exactly-once, a transactional producer of its own (`selection.replay_transactional_id`);
- progress committed every `COMMIT_INTERVAL_MS`, so that a killed replay re-sends little, and an in-flight
  bound of its own (`_IN_FLIGHT`: no model to keep fed, only the broker's acknowledgements to wait for);
- `--source-topic` checked against the cluster before anything else: a typo costs nothing;
- a stop (SIGTERM, SIGINT: `request_stop`, even before `run`) reads nothing more, gives the records in flight
  up to `INTERRUPT_DRAIN_S` to be confirmed and commits past what was; the summary says `interrupted`, and
  `fatal` why the producer could go no further (fenced by another replay of the group, say).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import confluent_kafka

from worker.app.doors import limits
from worker.kafka.clients import create_consumer, create_producer, exactly_once, kafka_call
from worker.logs import librdkafka_logger
from worker.pipeline.engine import Engine, GiveUpAt
from worker.pipeline.failure import Failure
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.seams import Settlement
from worker.pipeline.settlements.committer import Committer, CommitterFactory
from worker.pipeline.settlements.delivery import DeliveryRules
from worker.pipeline.settlements.guarantees import GuaranteeWiring, guarantee_for
from worker.pipeline.settlements.in_order import InOrder
from worker.pipeline.settlements.offsets import OffsetTracker
from worker.pipeline.triage.records import DeadLetterRedaction
from worker.replay.outcomes import PartitionPlan, ReplayObserver, ReplaySummary, fatal_reason
from worker.replay.reports import Reports
from worker.replay.selection import METADATA_TIMEOUT_S, ReplayOptions, check_source, replay_transactional_id
from worker.replay.source import ReplaySource
from worker.replay.stage import ReplayStage
from worker.settings import Settings
from worker.telemetry.tracing import tracing_for

# Commit confirmed progress at most this often, so a kill re-sends little without a commit per record.
COMMIT_INTERVAL_MS = 200
# How long a stopped replay waits for the records in flight before it commits what was confirmed (the
# client's own delivery timeout bounds every record anyway).
INTERRUPT_DRAIN_S = 30.0
# How long a read waits for a record when nothing is in flight.
_POLL_S = 0.1
# Records the run may wait for at once (republished, their acknowledgement not in yet), whatever the worker's
# pipeline.max_in_flight: enough that the broker's acknowledgements never hold the reading back, and still a
# bound on memory (a replay had none before the loop). Measured on 5,000 dead letters at least once (local
# broker, 2 shared cores): 0.74-0.76 s before the loop, 0.74-0.88 s on it with the worker's 64, 0.64-0.69 s
# with 1,000; exactly once 1.1-2.4 s, 1.7-2.4 s and 1.0-1.5 s.
_IN_FLIGHT = 1000


class Replay:
    """One replay (see the module docstring): `run` replays what the options select and returns what
    happened; `request_stop` (from a signal handler too, before `run` or during it) stops it gracefully."""

    def __init__(self) -> None:
        self._stop_requested = False
        self._engine: Engine | None = None

    def request_stop(self) -> None:
        self._stop_requested = True
        if self._engine is not None:
            self._engine.request_stop()

    def stop_requested(self) -> bool:
        """Whether a stop was asked for (a running `--transform` call gives up then)."""
        return self._stop_requested

    def run(
        self, settings: Settings, options: ReplayOptions, observer: ReplayObserver | None = None
    ) -> ReplaySummary:
        """Replay the dead letters `options` select; what happened. Raises UserError on setup problems, before
        anything is read or published."""
        started = time.monotonic()
        summary = ReplaySummary(
            options.dlq_topic, options.group, options.dry_run, guarantee=settings.pipeline.guarantee
        )
        failure = Failure()
        consumer = _consumer(settings, options.group)
        try:
            if options.source_topic is not None:  # before anything else: a typo must cost nothing
                check_source(_topic_partitions(consumer), options)
            engine = self._engine = replay_pipeline(settings, options, consumer, summary, observer, failure)
        except BaseException:
            consumer.close()
            raise
        if self._stop_requested:
            engine.request_stop()
        try:
            engine.run()
        finally:
            summary.elapsed_s = time.monotonic() - started
        summary.interrupted = self._stop_requested
        if failure.reason is not None:
            summary.fatal = fatal_reason(failure.reason, failure.fenced, options.group, settings.kafka)
        return summary


def replay_pipeline(
    settings: Settings,
    options: ReplayOptions,
    consumer: confluent_kafka.Consumer,
    summary: ReplaySummary,
    observer: ReplayObserver | None,
    failure: Failure,
    *,
    clock: Callable[[], float] = time.monotonic,
    committer: CommitterFactory = Committer,
) -> Engine:
    """The loop over what `options` select, read with `consumer`, its outcomes into `summary` and on to
    `observer`; why it had to end into `failure`. `clock` and `committer` are the loop's clock and the
    guarantee's committer (a virtual clock and a committer on the loop's thread in tests/simulation)."""
    tracker, give_up, metrics = OffsetTracker(), GiveUpAt(), PipelineMetrics()
    source = ReplaySource(consumer, options, tracker, _planned(summary, observer), clock=clock)
    reports = Reports(summary, observer, source, exactly_once(settings.pipeline) and not options.dry_run)
    # The run's numbers, its own in-flight bound among them: the loop and the guarantee take it from here.
    numbers = dataclasses.replace(
        limits(settings),
        max_in_flight=_IN_FLIGHT,
        resume_below=_IN_FLIGHT // 2,
        poll_timeout_s=_POLL_S,
        shutdown_timeout_s=INTERRUPT_DRAIN_S,
        # Progress committed every COMMIT_INTERVAL_MS, so a kill re-sends little.
        commit_interval_s=COMMIT_INTERVAL_MS / 1000.0,
    )
    settlement: Settlement
    if options.dry_run:  # nothing published, nothing committed: each output is as good as acknowledged
        settlement = InOrder(lambda work, _output: reports.delivered(work, None))
    else:
        settlement = guarantee_for(
            GuaranteeWiring(
                settings.pipeline.guarantee,
                # A replay's targets are the original topics: nothing goes to the dead-letter topic from
                # here (nothing written smaller; a record refused for its content is left out, `refused` in
                # the report, and stays where it is).
                DeliveryRules(
                    None,
                    DeadLetterRedaction.configured(settings.privacy, settings.dead_letter),
                    metrics,
                    clock,
                ),
                _ReplayClients(settings, options.group),
                consumer,
                tracker,
                metrics,
                clock,
                reports.stopped,
                failure,
                reports,
                give_up.get,
                committer,
                max_in_flight=numbers.max_in_flight,
                commit_interval_s=numbers.commit_interval_s,
            )
        )
    stage = ReplayStage(options, source, settlement, reports)
    tracing = tracing_for(settings.tracing, options.group, replay=True)
    return Engine(
        source, stage, settlement, numbers, metrics, failure, give_up, clock=clock, lifecycle_log=False,
        tracing=tracing,
    )  # fmt: skip


def _consumer(settings: Settings, group: str) -> confluent_kafka.Consumer:
    """The pipeline's client options (the user's librdkafka options; no auto-commit), in the replay's own
    group, with end-of-partition events to know when a range is read."""
    overrides = {"group.id": group, "enable.partition.eof": "true", "isolation.level": "read_committed"}
    consumer: confluent_kafka.Consumer = kafka_call(
        "create a consumer",
        lambda: create_consumer(
            settings.kafka, settings.pipeline, logger=librdkafka_logger(), overrides=overrides
        ),
        settings.kafka,
    )
    return consumer


def _topic_partitions(consumer: confluent_kafka.Consumer) -> dict[str, int]:
    """The cluster's topics, each with its partition count."""
    metadata = kafka_call(
        "read the cluster's topics", lambda: consumer.list_topics(timeout=METADATA_TIMEOUT_S)
    )
    return {name: len(topic.partitions) for name, topic in metadata.topics.items()}


def _planned(
    summary: ReplaySummary, observer: ReplayObserver | None
) -> Callable[[list[PartitionPlan]], None]:
    def planned(plan: list[PartitionPlan]) -> None:
        summary.plan = plan
        if observer is not None:
            observer.planned(plan)

    return planned


@dataclass(frozen=True)
class _ReplayClients:
    """The replay's producer for its guarantee (a `ProducerFactory`: the replay reads with a consumer of its
    own): transactional under the replay's own id in exactly_once."""

    settings: Settings
    group: str

    def producer(self, on_error: Callable[[confluent_kafka.KafkaError], None]) -> Any:
        settings = self.settings
        pipeline = settings.pipeline
        transactional = replay_transactional_id(pipeline, self.group) if exactly_once(pipeline) else None
        return kafka_call(
            "create a producer",
            lambda: create_producer(
                settings.kafka, on_error=on_error, logger=librdkafka_logger(), transactional=transactional
            ),
            settings.kafka,
        )
