"""`triage-worker run`: the worker itself — consume tickets, classify them, produce one record each.

Every pipeline, topic, inference and log setting has a flag here; flags beat `--set`, which beats the
environment and the `--config` file (see worker/config.py). The process runs until SIGTERM/SIGINT, then
shuts down gracefully (exit 0); a second signal exits at once (exit 128+signal). SIGHUP (and `POST /reload`
when metrics.port is set) reloads the model without leaving the group (see worker/ops/reload.py).
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

from worker.config import (
    InferenceSettings,
    Settings,
    add_config_argument,
    masked_kafka_config,
    settings_from_args,
)
from worker.errors import UserError
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import ClassifierPool, default_pool_kind, default_pool_size, open_pool
from worker.inference.switch import SwitchingClassifier
from worker.kafka.admin import existing_topics
from worker.kafka.clients import ClientErrorLog, KafkaClients, create_producer, producer_config
from worker.logs import configure_logging, librdkafka_logger
from worker.ops.reload import Reloader
from worker.ops.telemetry import WorkerTelemetry
from worker.pipeline.review import Review
from worker.pipeline.runner import Pipeline
from worker.pipeline.shadow import Shadow

_log = structlog.get_logger("worker.run")
# Niceness added to the shadow pool's processes (Linux CFS: a nice-10 process gets about a tenth of the CPU
# share of a nice-0 one when both want a core).
SHADOW_NICENESS = 10

# (flag, dotted settings key, type, help). Types are parsed by the settings loader, so flags take text.
_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--bootstrap-servers", "kafka.bootstrap.servers", "Kafka bootstrap servers, host:port[,host:port]"),
    ("--group-id", "pipeline.group_id", "consumer group id (default triage-worker)"),
    ("--input-topic", "topics.input", "topic of raw tickets (default tickets.raw)"),
    ("--output-topic", "topics.output", "topic of triage records (default tickets.triaged)"),
    ("--dead-letter-topic", "topics.dead_letter", "topic of undecodable records (default tickets.dlq)"),
    (
        "--max-in-flight",
        "pipeline.max_in_flight",
        "most tickets between poll and commit; also the most a crash can duplicate (default 64)",
    ),
    (
        "--resume-below",
        "pipeline.resume_below",
        "paused partitions resume once in-flight drops to this (default max-in-flight/2)",
    ),
    ("--deadline-ms", "pipeline.deadline_ms", "per-ticket budget from poll to answer (default 2000)"),
    ("--poll-batch-size", "pipeline.poll_batch_size", "most records taken per poll (default 100)"),
    ("--poll-timeout-ms", "pipeline.poll_timeout_ms", "longest wait of an idle poll (default 100)"),
    ("--commit-interval-ms", "pipeline.commit_interval_ms", "commit cadence (default 1000)"),
    (
        "--revoke-timeout-ms",
        "pipeline.revoke_timeout_ms",
        "how long a rebalance waits for in-flight tickets of revoked partitions (default 10000)",
    ),
    (
        "--shutdown-timeout-ms",
        "pipeline.shutdown_timeout_ms",
        "how long shutdown waits for in-flight tickets (default 15000)",
    ),
    ("--max-value-bytes", "pipeline.max_value_bytes", "larger records are dead-lettered (default 1048576)"),
    (
        "--guarantee",
        "pipeline.guarantee",
        "at_least_once | exactly_once (transactions; readers need read_committed) (default at_least_once)",
    ),
    (
        "--transactional-id",
        "pipeline.transactional_id",
        "exactly_once: this worker's transactional.id, unique among live workers (default <group>-<host>)",
    ),
    (
        "--scheduling",
        "pipeline.scheduling",
        "edf | fifo: tickets go to the model earliest deadline first, or in arrival order (default edf)",
    ),
    ("--model", "inference.model", "ORT GenAI model folder (default models/triage-mini)"),
    ("--taxonomy", "inference.taxonomy", "taxonomy TOML (default: the model's taxonomy.toml)"),
    ("--mode", "inference.mode", "score | generate (default score)"),
    ("--provider", "inference.provider", "cpu | cuda | dml (default cpu)"),
    ("--pool", "inference.pool", "process | thread | batch (default: per provider)"),
    ("--pool-size", "inference.pool_size", "contexts/worker processes (default: per CPU count)"),
    ("--intra-op-threads", "inference.intra_op_num_threads", "ONNX Runtime threads per context (default 1)"),
    (
        "--shadow-model",
        "inference.shadow_model",
        "shadow model folder: also classifies every classified ticket, off the critical path (default off)",
    ),
    ("--shadow-taxonomy", "inference.shadow_taxonomy", "shadow taxonomy (default: the shadow model's)"),
    ("--shadow-mode", "inference.shadow_mode", "shadow's score | generate (default: the primary's)"),
    ("--shadow-pool-size", "inference.shadow_pool_size", "shadow contexts (default 1)"),
    ("--shadow-topic", "topics.shadow", "side topic of shadow answers (default tickets.triaged.shadow)"),
    (
        "--review-threshold",
        "review.threshold",
        "results under this confidence also go to the review topic, for `triage-worker review` (default off)",
    ),
    ("--review-topic", "topics.review", "side topic of results to review (default tickets.review)"),
    ("--log-level", "log.level", "debug | info | warning | error (default info)"),
    ("--log-format", "log.format", "console | json (default console)"),
    ("--metrics-port", "metrics.port", "serve /metrics, /healthz, /readyz here (default off; 0 = any free)"),
    ("--metrics-host", "metrics.host", "address the metrics port binds (default 0.0.0.0)"),
    ("--stall-timeout-ms", "metrics.stall_timeout_ms", "/healthz fails after a loop stall this long (60000)"),
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
        parser.add_argument(flag, dest=_dest(key), metavar=key.rsplit(".", 1)[-1].upper(), help=help_text)
    parser.add_argument(
        "--metrics-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often the metrics event is logged (default 10; also logged at shutdown)",
    )
    parser.set_defaults(handler=run)


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


def _check_topics(settings: Settings) -> None:
    """Fail at start, in one line, when the broker is unreachable, refuses the credentials or certificate,
    or a topic is missing."""
    bootstrap = settings.kafka.get("bootstrap.servers", "")
    existing = existing_topics(producer_config(settings))
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


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, _overrides(args))
    configure_logging(settings.log)
    _log.info("settings", kafka=masked_kafka_config(settings.kafka), pid=os.getpid())
    _check_topics(settings)
    taxonomy, _ = resolve_taxonomy(settings.inference)
    telemetry = WorkerTelemetry.start(settings, librdkafka_logger())  # a no-op unless metrics.port is set
    # Read the settings again as above: an edited --config file (a remounted ConfigMap) takes effect.
    reloader = Reloader(
        settings,
        lambda: settings_from_args(args, _overrides(args)),
        taxonomy.fallback_label,
        telemetry.reloaded,
    )
    if hasattr(signal, "SIGHUP"):  # not on Windows: POST /reload there
        # Before the model loads: a hang-up meanwhile reloads once the worker runs, instead of killing it.
        signal.signal(signal.SIGHUP, lambda _signum, _frame: reloader.request("SIGHUP"))
    classifier = SwitchingClassifier(open_pool(settings.inference, settings.log))
    shadow_pool: ClassifierPool | None = None
    try:
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
            review=review,
        )
        telemetry.attach(pipeline.metrics, classifier.model_id, classifier.current.size)
        telemetry.serve_reload(lambda: reloader.request("POST /reload"))
        _install_signal_handlers(pipeline)
        reloader.start(classifier)
        return pipeline.run()
    finally:
        reloader.close()
        classifier.close()
        if shadow_pool is not None:
            shadow_pool.close()
        telemetry.close()


def _shadow(settings: Settings, shadow_settings: InferenceSettings, pool: ClassifierPool) -> Shadow:
    """The shadow: its own pool and its own producer, so neither its model nor its records hold back the
    primary's; at most its own dispatch window outstanding (the drop rule, see worker/pipeline/shadow.py)."""
    window = dispatch_window(msgspec.structs.replace(settings, inference=shadow_settings))
    producer = create_producer(settings, ClientErrorLog("shadow-producer"), librdkafka_logger())
    _log.info("shadow_started", model=pool.model_id, topic=settings.topics.shadow, window=window)
    return Shadow(pool, window, producer, settings.topics.shadow, settings.pipeline.deadline_ms / 1000.0)


def _review(settings: Settings) -> Review:
    """Results to review go through a producer of their own, as the shadow's side records do."""
    producer = create_producer(settings, ClientErrorLog("review-producer"), librdkafka_logger())
    review = settings.review
    _log.info(
        "review_started", topic=settings.topics.review, threshold=review.threshold, fallbacks=review.fallbacks
    )
    return Review(review, producer, settings.topics.review)


def _install_signal_handlers(pipeline: Pipeline) -> None:
    received: list[int] = []

    def on_signal(signum: int, _frame: types.FrameType | None) -> None:
        if received:
            # Second signal: leave now. Nothing uncommitted is lost; the next owner re-reads it.
            os._exit(128 + signum)
        received.append(signum)
        _log.info("stop_requested", signal=signal.Signals(signum).name, again="exits at once")
        pipeline.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
