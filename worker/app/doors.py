"""The doors of the worker, each assembled from the one loop (`worker.pipeline.engine.Engine`) with its own
source and settlement, and the same triage stage (see `worker/pipeline/seams.py` for the table):

- `group_pipeline`: `run` in group mode — a consumer group, and the delivery guarantee (`pipeline.guarantee`);
- `queue_pipeline`: `run --consume queue` — a share group, each record acknowledged on its own.

This is the only place where a door's parts meet: below it each part receives what it uses. The model's pool,
the cascade and the side topics are opened by the caller (`application.WorkerApp`, the tests), so that a hot
reload can swap the pool under a running loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from worker.classification import Classifier, FallbackLabel
from worker.errors import UserError
from worker.kafka.clients import ClientFactory, KafkaClients, consumer_config
from worker.kafka.share_groups import ShareClientFactory, ShareClients, ShareGroup, delivery_timeout_ms
from worker.messages import TriageResult
from worker.pipeline.engine import Engine, GiveUpAt, Limits
from worker.pipeline.failure import Failure
from worker.pipeline.metrics import PipelineMetrics, RegistryState
from worker.pipeline.registry_wait import RegistryWait
from worker.pipeline.seams import HandBack, Settlement, Source
from worker.pipeline.settlements.acknowledgements import Acknowledging
from worker.pipeline.settlements.committer import Committer, CommitterFactory
from worker.pipeline.settlements.delivery import DeliveryRules
from worker.pipeline.settlements.guarantees import GuaranteeWiring, guarantee_for
from worker.pipeline.settlements.offsets import OffsetTracker
from worker.pipeline.side_topics.review import Review
from worker.pipeline.side_topics.shadow import Shadow
from worker.pipeline.side_topics.side_topic import ResultWatcher
from worker.pipeline.sources.group import GroupSource, PausedPartitions
from worker.pipeline.sources.lock_budget import LockBudget
from worker.pipeline.sources.share import FetchSize, ShareSource
from worker.pipeline.tracing import NO_TRACING, Tracing
from worker.pipeline.triage.cascade import Cascade
from worker.pipeline.triage.dispatch_queue import DispatchQueue
from worker.pipeline.triage.intake import Intake, TicketDecoding
from worker.pipeline.triage.model_stage import ModelStage, Redone
from worker.pipeline.triage.outputs import Outputs
from worker.pipeline.triage.records import DeadLetterRedaction, encode_result
from worker.pipeline.triage.requests import ModelRequests
from worker.pipeline.triage.stage import TriageStage
from worker.pipeline.work import Work
from worker.settings import Settings

ResultEncoder = Callable[[TriageResult], bytes]


class TriageParts:
    """What every classifying door shares: the model and its cascade, the side topics, the input's decoder
    (None: plain JSON tickets), the output's encoder (None: JSON) and the tracer of each ticket (off unless
    given: `worker.telemetry.tracing.tracing_for`). `reloaded(settings)` hands the parts built over them the
    settings a hot reload applies live (worker/settings/reloads.py): the redaction of the intake, the outputs
    and the dead letters, and which results go to review."""

    def __init__(
        self,
        classifier: Classifier,
        fallback: FallbackLabel,
        dispatch_window: int,
        *,
        cascade: Cascade | None = None,
        shadow: Shadow | None = None,
        review: Review | None = None,
        decoder: TicketDecoding | None = None,
        result_encoder: ResultEncoder | None = None,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self.classifier, self.fallback, self.dispatch_window = classifier, fallback, dispatch_window
        self.cascade, self.shadow, self.review = cascade, shadow, review
        self.decoder = decoder
        self.encode = result_encoder or encode_result
        self.tracing = tracing
        self._live: list[Callable[[Settings], None]] = []
        if review is not None:
            self.follow(lambda settings: review.review_as(settings.review))

    def follow(self, apply: Callable[[Settings], None]) -> None:
        """Call `apply` with the settings of each hot reload that succeeds (from the reload's thread)."""
        self._live.append(apply)

    def reloaded(self, settings: Settings) -> None:
        """A hot reload's `settings` for every part that takes them live."""
        for apply in self._live:
            apply(settings)

    @property
    def side_topics(self) -> list[ResultWatcher]:
        return [side for side in (self.shadow, self.review) if side is not None]

    def metrics(self, deadline_s: float) -> PipelineMetrics:
        metrics = PipelineMetrics.for_deadline(deadline_s)
        metrics.shadow = self.shadow.metrics if self.shadow is not None else None
        metrics.review = self.review.metrics if self.review is not None else None
        metrics.escalation = self.cascade.metrics if self.cascade is not None else None
        metrics.registry = RegistryState() if self.decoder is not None else None
        return metrics


def triage_stage(
    settings: Settings,
    parts: TriageParts,
    queue: DispatchQueue,
    requests: ModelRequests,
    settlement: Settlement,
    hand_back: Callable[[Work], HandBack],
    metrics: PipelineMetrics,
    clock: Callable[[], float],
) -> TriageStage:
    side_topics = parts.side_topics
    outputs = Outputs(
        settings.topics, settings.privacy, settings.dead_letter, settings.pipeline.max_header_bytes,
        parts.encode, settlement.write, side_topics, metrics,
    )  # fmt: skip
    intake = Intake(settings.pipeline, settings.privacy, settings.inference.redact_input, metrics)
    parts.follow(lambda new: intake.redact_as(new.privacy, new.inference.redact_input))
    parts.follow(lambda new: outputs.redact_as(new.privacy, new.dead_letter))
    stage = TriageStage(
        intake,
        parts.decoder,
        queue,
        requests,
        outputs,
        side_topics,
        hand_back,
        metrics,
        clock,
    )
    stage.attach(
        ModelStage(
            parts.classifier, parts.cascade, parts.dispatch_window, parts.fallback, queue, requests, metrics,
            clock, stage.answered,
        )
    )  # fmt: skip
    return stage


def limits(settings: Settings) -> Limits:
    """Every door's numbers as `pipeline` sets them, its milliseconds in seconds: the one place they are
    converted (a door with numbers of its own replaces those on these)."""
    pipeline = settings.pipeline
    return Limits(
        max_in_flight=pipeline.max_in_flight,
        resume_below=pipeline.resume_threshold,
        deadline_s=pipeline.deadline_ms / 1000.0,
        poll_timeout_s=pipeline.poll_timeout_ms / 1000.0,
        shutdown_timeout_s=pipeline.shutdown_timeout_ms / 1000.0,
        commit_interval_s=pipeline.commit_interval_ms / 1000.0,
        read_batch=pipeline.poll_batch_size,
    )


def _started_line(settings: Settings) -> dict[str, object]:
    return {
        "output": settings.topics.output,
        "dead_letter": settings.topics.dead_letter,
        "scheduling": settings.pipeline.scheduling,
        "guarantee": settings.pipeline.guarantee,
        "input_format": settings.input.format,
    }


def _triage_loop(
    settings: Settings,
    parts: TriageParts,
    source: Source,
    settlement: Settlement,
    queue: DispatchQueue,
    requests: ModelRequests,
    metrics: PipelineMetrics,
    failure: Failure,
    give_up: GiveUpAt,
    clock: Callable[[], float],
    metrics_interval_s: float,
    numbers: Limits,
) -> Engine:
    """A Kafka door's loop: `source` and `settlement` with the triage stage, the registry's wait where the
    input needs one; `numbers`: the door's `Limits`, the same the settlement was given its bound from."""
    stage = triage_stage(settings, parts, queue, requests, settlement, source.hand_back, metrics, clock)
    registry = RegistryWait(metrics.registry, clock) if metrics.registry is not None else None
    return Engine(
        source, stage, settlement, numbers, metrics, failure, give_up, registry, clock,
        metrics_interval_s, _started_line(settings), tracing=parts.tracing,
    )  # fmt: skip


def group_pipeline(
    settings: Settings,
    parts: TriageParts,
    *,
    clients: ClientFactory | None = None,
    metrics_interval_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    committer: CommitterFactory = Committer,
) -> Engine:
    """`run` in group mode: a consumer group's partitions, the delivery guarantee `pipeline.guarantee`;
    `committer` makes the guarantee's committer (`GuaranteeWiring.committer`: the threaded one)."""
    pipeline = settings.pipeline
    clients = clients or KafkaClients(settings.kafka, settings.pipeline)
    numbers = limits(settings)
    metrics = parts.metrics(numbers.deadline_s)
    failure, give_up = Failure(), GiveUpAt()
    consumer = clients.consumer(failure.client_error)
    tracker = OffsetTracker()
    paused = PausedPartitions(consumer)
    source = GroupSource(
        consumer, consumer_config(settings.kafka, pipeline), settings.topics.input, pipeline.group_id,
        pipeline.revoke_timeout_ms / 1000.0, tracker, paused, metrics, failure, clock,
    )  # fmt: skip
    queue, requests = DispatchQueue(pipeline.scheduling), ModelRequests()
    guarantee = guarantee_for(
        GuaranteeWiring(
            pipeline.guarantee, _dead_letter_rules(settings, parts, metrics, clock), clients, consumer,
            tracker, metrics, clock, paused.pause, failure, Redone(queue, requests), give_up.get, committer,
            max_in_flight=numbers.max_in_flight, commit_interval_s=numbers.commit_interval_s,
        )
    )  # fmt: skip
    return _triage_loop(
        settings, parts, source, guarantee, queue, requests, metrics, failure, give_up, clock,
        metrics_interval_s, numbers,
    )  # fmt: skip


def queue_pipeline(
    settings: Settings,
    parts: TriageParts,
    group: ShareGroup,
    *,
    clients: ShareClientFactory | None = None,
    metrics_interval_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> Engine:
    """`run --consume queue`: a share group's records, each acknowledged on its own. `settings` with the
    `[kafka]` options `share_groups.queue_kafka_options` fitted; `group` as `share_groups.prepare_share_group`
    read it."""
    refuse_exactly_once(settings)
    pipeline = settings.pipeline
    budget = lock_budget(settings, group)
    budget.check()
    factory = clients or ShareClients(settings.kafka, settings.pipeline)
    numbers = limits(settings)
    metrics = parts.metrics(numbers.deadline_s)
    failure, give_up = Failure(), GiveUpAt()
    given = settings.kafka.get("max.poll.records")
    fetch = FetchSize.starting(
        parts.dispatch_window, numbers.max_in_flight, numbers.deadline_s,
        int(given) if given is not None else None,
    )  # fmt: skip
    source = ShareSource(
        factory.share_consumer, settings.topics.input, pipeline.group_id, group, budget, fetch,
        numbers.poll_timeout_s, metrics, failure, clock,
    )  # fmt: skip
    rules = _dead_letter_rules(settings, parts, metrics, clock)
    settlement = Acknowledging(
        factory, rules, failure, source.acknowledge, give_up.get, clock, source.last_delivery
    )
    queue, requests = DispatchQueue(pipeline.scheduling), ModelRequests()
    return _triage_loop(
        settings, parts, source, settlement, queue, requests, metrics, failure, give_up, clock,
        metrics_interval_s, numbers,
    )  # fmt: skip


def _dead_letter_rules(
    settings: Settings, parts: TriageParts, metrics: PipelineMetrics, clock: Callable[[], float]
) -> DeliveryRules:
    """The delivery-error rules of `run`'s outputs: dead letters to `topics.dead_letter`, redacted as the
    privacy and dead-letter sections say (a hot reload's, from then on)."""
    redaction = DeadLetterRedaction.configured(settings.privacy, settings.dead_letter)
    rules = DeliveryRules(settings.topics.dead_letter, redaction, metrics, clock)
    parts.follow(lambda new: rules.redact_as(DeadLetterRedaction.configured(new.privacy, new.dead_letter)))
    return rules


def refuse_exactly_once(settings: Settings) -> None:
    """Queue mode has no transactions to put the acknowledgements in: exactly-once is refused."""
    if settings.pipeline.guarantee == "exactly_once":
        raise UserError(
            'config error: pipeline.guarantee = "exactly_once" cannot be used with pipeline.consume = '
            '"queue": share groups have no transactional acknowledgements'
        )


def lock_budget(settings: Settings, group: ShareGroup) -> LockBudget:
    """The lock arithmetic for `settings` (the producer's delivery timeout as the clients will have it)."""
    return LockBudget(
        lock_s=group.lock_ms / 1000.0,
        deadline_s=limits(settings).deadline_s,
        delivery_s=delivery_timeout_ms(settings.kafka) / 1000.0,
    )
