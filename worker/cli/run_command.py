"""`triage-worker run`: the worker itself — consume tickets, classify them, produce one record each.

Every pipeline, topic, inference and log setting has a flag here; flags beat `--set`, which beats the
environment and the `--config` file (see worker/config.py). The process runs until SIGTERM/SIGINT, then
shuts down gracefully (exit 0); a second signal exits at once (exit 128+signal). SIGHUP (and `POST /reload`
when metrics.port and metrics.reload_token_file are set) reloads the model without leaving the group (see
worker/cli/reload.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import types
from collections.abc import Callable
from typing import Any, cast

import msgspec
import structlog

from worker.cli.defaults import with_default
from worker.cli.reload import Reloader
from worker.config import (
    InferenceSettings,
    Settings,
    add_config_argument,
    masked_kafka_config,
    settings_from_args,
)
from worker.contracts.input import decoder_for
from worker.contracts.output import result_encoder_for
from worker.errors import UserError
from worker.inference.escalation import choose_escalation, escalation_threshold
from worker.inference.loading import resolve_taxonomy, with_zero_shot_review
from worker.inference.pool import (
    ClassifierPool,
    default_pool_kind,
    default_pool_size,
    measure_turnaround,
    open_pool,
)
from worker.inference.switch import SwitchingClassifier
from worker.inference.taxonomy import Taxonomy
from worker.kafka.admin import existing_topics, record_size_limits
from worker.kafka.clients import (
    ClientErrorLog,
    KafkaClients,
    create_producer,
    producer_config,
    producer_record_limit,
)
from worker.learning.artifacts import fetch_stage_files
from worker.logs import configure_logging, librdkafka_logger
from worker.pipeline.cascade import Cascade
from worker.pipeline.review import Review
from worker.pipeline.runner import Pipeline
from worker.pipeline.shadow import Shadow
from worker.telemetry.access import ReloadAccess
from worker.telemetry.worker import WorkerTelemetry

_log = structlog.get_logger("worker.run")
# Niceness added to the shadow pool's processes (Linux CFS: a nice-10 process gets about a tenth of the CPU
# share of a nice-0 one when both want a core).
SHADOW_NICENESS = 10

# (flag, dotted settings key, help). Types are parsed by the settings loader, so flags take text; each help
# gets its default from Settings (worker/cli/defaults.py).
_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--bootstrap-servers", "kafka.bootstrap.servers", "Kafka bootstrap servers, host:port[,host:port]"),
    ("--group-id", "pipeline.group_id", "consumer group id"),
    ("--input-topic", "topics.input", "topic of raw tickets"),
    ("--output-topic", "topics.output", "topic of triage records"),
    ("--dead-letter-topic", "topics.dead_letter", "topic of undecodable records"),
    (
        "--max-in-flight",
        "pipeline.max_in_flight",
        "most tickets between poll and commit; also the most a crash can duplicate",
    ),
    (
        "--resume-below",
        "pipeline.resume_below",
        "paused partitions resume once in-flight drops to this",
    ),
    ("--deadline-ms", "pipeline.deadline_ms", "per-ticket budget from poll to answer"),
    ("--poll-batch-size", "pipeline.poll_batch_size", "most records taken per poll"),
    ("--poll-timeout-ms", "pipeline.poll_timeout_ms", "longest wait of an idle poll"),
    ("--commit-interval-ms", "pipeline.commit_interval_ms", "commit cadence"),
    (
        "--revoke-timeout-ms",
        "pipeline.revoke_timeout_ms",
        "how long a rebalance waits for in-flight tickets of revoked partitions",
    ),
    (
        "--shutdown-timeout-ms",
        "pipeline.shutdown_timeout_ms",
        "how long shutdown waits for in-flight tickets",
    ),
    ("--max-value-bytes", "pipeline.max_value_bytes", "larger records are dead-lettered"),
    (
        "--guarantee",
        "pipeline.guarantee",
        "at_least_once | exactly_once (transactions; readers need read_committed)",
    ),
    (
        "--transactional-id",
        "pipeline.transactional_id",
        "exactly_once: this worker's transactional.id, unique among live workers",
    ),
    (
        "--scheduling",
        "pipeline.scheduling",
        "edf | fifo: tickets go to the model earliest deadline first, or in arrival order",
    ),
    ("--model", "inference.model", "ORT GenAI model folder"),
    ("--taxonomy", "inference.taxonomy", "taxonomy TOML"),
    ("--mode", "inference.mode", "score | generate"),
    ("--provider", "inference.provider", "cpu | cuda | dml"),
    ("--pool", "inference.pool", "process | thread | batch"),
    ("--pool-size", "inference.pool_size", "contexts/worker processes"),
    ("--intra-op-threads", "inference.intra_op_num_threads", "ONNX Runtime threads per context"),
    (
        "--shadow-model",
        "inference.shadow_model",
        "shadow model folder: also classifies every classified ticket, off the critical path",
    ),
    ("--shadow-taxonomy", "inference.shadow_taxonomy", "shadow taxonomy"),
    ("--shadow-mode", "inference.shadow_mode", "shadow's score | generate"),
    ("--shadow-pool-size", "inference.shadow_pool_size", "shadow contexts"),
    ("--shadow-topic", "topics.shadow", "side topic of shadow answers"),
    (
        "--escalation",
        "inference.escalation",
        "escalation stage folder (encoder stage or ORT GenAI model; the shipped one: triage-encoder), auto "
        "(that one where it fits the taxonomy) or off: tickets the model is unsure of go to it when their "
        "deadline allows",
    ),
    ("--escalate-below", "inference.escalate_below", "escalate tickets whose first confidence is under this"),
    ("--escalation-pool-size", "inference.escalation_pool_size", "escalation stage processes"),
    (
        "--review-threshold",
        "review.threshold",
        "results under this confidence also go to the review topic, for `triage-worker review`",
    ),
    ("--review-topic", "topics.review", "side topic of results to review"),
    ("--log-level", "log.level", "debug | info | warning | error"),
    ("--log-format", "log.format", "console | json"),
    ("--metrics-port", "metrics.port", "serve /metrics, /healthz, /readyz here; 0 = any free port"),
    ("--metrics-host", "metrics.host", "address the metrics port binds"),
    ("--stall-timeout-ms", "metrics.stall_timeout_ms", "/healthz fails after a loop stall this long"),
    (
        "--reload-token-file",
        "metrics.reload_token_file",
        "file holding the token POST /reload requires; unset, the endpoint is closed (SIGHUP reloads)",
    ),
)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the worker: consume tickets, classify, produce triage records (until Ctrl-C/SIGTERM)",
        description=(
            "Consume tickets from the input topic, classify each with the local model within its deadline, "
            "produce one triage record per ticket (dead letters for undecodable records) and commit only "
            "finished offsets. At-least-once: a crash re-delivers at most --max-in-flight tickets."
        ),
    )
    add_config_argument(parser)
    for flag, key, help_text in _FLAGS:
        parser.add_argument(
            flag, dest=_dest(key), metavar=key.rsplit(".", 1)[-1].upper(), help=with_default(help_text, key)
        )
    parser.add_argument(
        "--metrics-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often the metrics event is logged (default 10; also logged at shutdown)",
    )
    parser.set_defaults(handler=run, takes_stop_signals=True)


def flag_settings() -> list[tuple[str, str]]:
    """Each of `run`'s setting flags and the dotted setting it sets (for the generated reference)."""
    return [(flag, key) for flag, key, _ in _FLAGS]


def _dest(key: str) -> str:
    return "flag_" + key.replace(".", "_")


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    return {key: getattr(args, _dest(key)) for _, key, _ in _FLAGS}


def dispatch_window(settings: Settings) -> int:
    """How many tickets the pool holds at once: enough to keep every context busy, no more.

    Tickets beyond it wait in the pipeline, where an expired deadline turns them into `overloaded` records
    without a round trip to the model.
    """
    inference = settings.inference
    kind = default_pool_kind(inference)
    if kind == "batch":
        return 2 * inference.batch_size
    return 2 * default_pool_size(inference, kind)


def _check_topics(settings: Settings) -> Settings:
    """Fail at start, in one line, when the broker is unreachable, refuses the credentials or certificate,
    or a topic is missing; returns `settings` with the producer's record limit fitted to the topics it
    writes (`producer_record_limit`)."""
    bootstrap = settings.kafka.get("bootstrap.servers", "")
    # In the configured log format (JSON logs stay JSON), not a bare line on stderr.
    existing = existing_topics(
        producer_config(settings), on_wait=lambda line: _log.info("waiting_for_kafka", line=line)
    )
    topics = settings.topics
    needed = [topics.input, topics.output, topics.dead_letter]
    if settings.inference.shadow_settings() is not None:
        needed.append(topics.shadow)
    if settings.review.enabled:
        needed.append(topics.review)
    missing = [t for t in needed if t not in existing]
    if missing:
        raise UserError(
            f"topic(s) {', '.join(missing)} do not exist on {bootstrap}; create them with "
            "`triage-worker topics create` (same settings)"
        )
    written = [topic for topic in needed if topic != topics.input]
    return producer_record_limit(settings, record_size_limits(producer_config(settings), written))


def run(args: argparse.Namespace) -> int:
    settings = with_zero_shot_review(settings_from_args(args, _overrides(args)))
    configure_logging(settings.log)
    stop = _StopOnSignals(args.held_stop_signals.received)
    _log.info("settings", kafka=masked_kafka_config(settings.kafka), pid=os.getpid())
    reload_access = ReloadAccess.configured(settings.metrics)  # an unfit token file stops the start here
    # The input's decoder (with its registry client) reads only input settings: a Protobuf class that does
    # not import stops the start here, before the broker is asked.
    decoder = decoder_for(settings)
    # Model and taxonomy pairs first: a config problem needs no broker to be found (pairing.py).
    taxonomy, taxonomy_path = resolve_taxonomy(settings.inference)
    if (shadow_inference := settings.inference.shadow_settings()) is not None:
        resolve_taxonomy(shadow_inference)
    escalation = choose_escalation(settings.inference, taxonomy, taxonomy_path)
    if escalation.why_off is not None:
        _log.info("cascade_off", reason=escalation.why_off)
    settings = _check_topics(settings)
    # Registered once, here: a registry that refuses the output schema stops the start in one line.
    result_encoder = result_encoder_for(settings)
    # A no-op unless metrics.port is set.
    telemetry = WorkerTelemetry.start(settings, librdkafka_logger(), reload_access)
    # Read the settings again as above: an edited --config file (a remounted ConfigMap) takes effect.
    reloader = Reloader(
        settings,
        lambda: with_zero_shot_review(settings_from_args(args, _overrides(args))),
        taxonomy.fallback_label,
        telemetry.reloaded,
        escalation_labels=None if escalation.settings is None else taxonomy.labels,
    )
    if hasattr(signal, "SIGHUP"):  # not on Windows: POST /reload there
        # Before the model loads: a hang-up meanwhile reloads once the worker runs, instead of killing it.
        signal.signal(signal.SIGHUP, lambda _signum, _frame: reloader.request("SIGHUP"))
    classifier = SwitchingClassifier(open_pool(settings.inference, settings.log))
    shadow_pool: ClassifierPool | None = None
    escalation_pool: ClassifierPool | None = None
    try:
        cascade = None
        if escalation.settings is not None:
            fetch_stage_files(escalation.settings, lambda line: _log.info("fetching", what=line))
            escalation_pool = open_pool(escalation.settings, settings.log)
            cascade = start_cascade(
                settings, escalation.settings, escalation_pool, taxonomy, classifier.current.size
            )
        shadow = None
        if (shadow_settings := settings.inference.shadow_settings()) is not None:
            # Its processes run at a lower CPU priority: on shared cores the primary's contexts come first.
            # (A partial of a builtin pickles by reference, so the spawned processes import nothing more.)
            lower_priority = cast("Callable[[], None]", functools.partial(os.nice, SHADOW_NICENESS))
            shadow_pool = open_pool(shadow_settings, settings.log, lower_priority)
            shadow = _shadow(settings, shadow_settings, shadow_pool)
        review = _review(settings) if settings.review.enabled else None
        pipeline = Pipeline(
            settings,
            classifier,
            taxonomy.fallback_label,
            dispatch_window=dispatch_window(settings),
            metrics_interval_s=args.metrics_interval,
            clients=KafkaClients(settings, librdkafka_logger()),
            shadow=shadow,
            cascade=cascade,
            review=review,
            decoder=decoder,
            result_encoder=result_encoder,
        )
        telemetry.attach(pipeline.metrics, classifier.model_id, classifier.current.size)
        telemetry.watch_model_processes("primary", lambda: classifier.current.worker_pids())
        if shadow_pool is not None:
            telemetry.watch_model_processes("shadow", shadow_pool.worker_pids)
        if escalation_pool is not None:
            telemetry.watch_model_processes("escalation", escalation_pool.worker_pids)
        telemetry.serve_reload(lambda: reloader.request_unless_busy("POST /reload"))
        stop.attach(pipeline)
        reloader.start(classifier, cascade)
        return pipeline.run()
    finally:
        reloader.close()
        classifier.close()
        if shadow_pool is not None:
            shadow_pool.close()
        if escalation_pool is not None:
            escalation_pool.close()
        telemetry.close()


def _shadow(settings: Settings, shadow_settings: InferenceSettings, pool: ClassifierPool) -> Shadow:
    """The shadow: its own pool and its own producer, so neither its model nor its records hold back the
    primary's; at most its own dispatch window outstanding (the drop rule, see worker/pipeline/shadow.py)."""
    window = dispatch_window(msgspec.structs.replace(settings, inference=shadow_settings))
    producer = create_producer(settings, ClientErrorLog("shadow-producer"), librdkafka_logger())
    _log.info("shadow_started", model=pool.model_id, topic=settings.topics.shadow, window=window)
    return Shadow(pool, window, producer, settings.topics.shadow, settings.pipeline.deadline_ms / 1000.0)


def start_cascade(
    settings: Settings,
    escalation: InferenceSettings,
    pool: ClassifierPool,
    taxonomy: Taxonomy,
    first_contexts: int,
    window: int | None = None,
) -> Cascade:
    """The cascade over the escalation stage's own pool: at most `window` (default: its dispatch window)
    outstanding, beyond which escalations are shed, with its turnaround on warm-up tickets as the gate's
    first p95."""
    window = window or dispatch_window(msgspec.structs.replace(settings, inference=escalation))
    prior_s = measure_turnaround(pool)
    escalate_below = escalation_threshold(settings.inference)
    _log.info(
        "cascade_started",
        escalation=pool.model_id,
        escalate_below=escalate_below,
        window=window,
        warm_turnaround_ms=round(prior_s * 1000.0, 1),
    )
    return Cascade(pool, escalate_below, window, prior_s, first_contexts, taxonomy.labels)


def _review(settings: Settings) -> Review:
    """Results to review go through a producer of their own, as the shadow's side records do."""
    producer = create_producer(settings, ClientErrorLog("review-producer"), librdkafka_logger())
    review = settings.review
    _log.info(
        "review_started", topic=settings.topics.review, threshold=review.threshold, fallbacks=review.fallbacks
    )
    return Review(review, producer, settings.topics.review)


class _StopOnSignals:
    """SIGTERM/SIGINT from the very start: a stop asked for while the modules import (`held`, see
    `cli.HeldStopSignals`) or the model loads (a pod stopped during start-up) is remembered and the pipeline
    stops as soon as it exists (exit 0), instead of the process dying by the signal's default action. A
    second signal exits at once."""

    def __init__(self, held: list[int]) -> None:
        self._received: list[int] = []
        self._pipeline: Pipeline | None = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if held:  # held signals count as one: the next one is the one that exits at once
            self._received.append(held[0])
            name = signal.Signals(held[0]).name
            _log.info("stop_requested", signal=name, when="while the modules imported")

    def attach(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        if self._received:
            pipeline.request_stop()

    def _on_signal(self, signum: int, _frame: types.FrameType | None) -> None:
        if self._received:
            # Second signal: leave now. Nothing uncommitted is lost; the next owner re-reads it.
            os._exit(128 + signum)
        self._received.append(signum)
        _log.info("stop_requested", signal=signal.Signals(signum).name, again="exits at once")
        if self._pipeline is not None:
            self._pipeline.request_stop()
