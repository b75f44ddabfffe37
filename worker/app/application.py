"""The worker assembled from its settings: `WorkerApp(settings, reread).run()` is `triage-worker run`.

Contract:
- `WorkerApp(settings, reread, metrics_interval_s=..., held_stop_signals=...)` does nothing yet; `settings`
  as loaded (worker/settings), `reread` loads them again the same way for a hot reload (an edited config
  file takes effect), `held_stop_signals` are SIGTERM/SIGINT received before (the CLI holds them while the
  modules import, `cli.HeldStopSignals`).
- `start()` configures logging, takes SIGTERM/SIGINT (and SIGHUP) and checks before it loads anything heavy:
  the reload token file, the consumer's options, the input's decoder, the model and taxonomy pairs, the
  cascade's choice, then the broker and topics (one line each, as a `UserError`), then registers the output
  schema. Then it starts the telemetry port, the hot reloader, the primary pool (behind a
  `SwitchingClassifier`), the cascade's escalation stage, the shadow and the review, and builds the
  `Pipeline` over them. What it opened before a failure is closed by `close()`.
- `run()` starts it (unless started), runs the pipeline until it is stopped, and closes everything: its
  value is the pipeline's exit code (0 after a graceful stop). A `UserError` leaves it for the caller to
  print.
- Stopping: SIGTERM, SIGINT or `request_stop()` stop it gracefully (in-flight tickets drain, finished
  offsets are committed, within `pipeline.shutdown_timeout_ms`); a stop asked for before the pipeline exists
  stops it as soon as it does. A second signal exits the process at once (exit 128+signal): nothing
  uncommitted is lost, the next owner of the partitions reads it again (worker/app/signals.py, as for
  `replay`).
- Reloading: SIGHUP, or `POST /reload` when metrics.port and metrics.reload_token_file are set, loads the
  model again without leaving the consumer group, hands the running parts the privacy, redaction and review
  settings, and names what only a restart applies (worker/app/reload.py, worker/settings/reloads.py).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import structlog

from worker.app.doors import TriageParts, group_pipeline, lock_budget, queue_pipeline, refuse_exactly_once
from worker.app.reload import Reloader
from worker.app.signals import StopOnSignals
from worker.app.stages import (
    dispatch_window,
    open_cascade,
    open_shadow_pool,
    start_review,
    start_shadow,
)
from worker.contracts.input import decoder_for
from worker.contracts.output import result_encoder_for
from worker.errors import UserError
from worker.inference.escalation import choose_escalation
from worker.inference.loading import resolve_taxonomy, zero_shot_review
from worker.inference.pool import ClassifierPool, open_pool
from worker.inference.switch import SwitchingClassifier
from worker.kafka.admin import existing_topics, record_size_limits
from worker.kafka.clients import (
    KafkaClients,
    consumer_config,
    exactly_once,
    producer_config,
    producer_record_limit,
    transaction_timeout_ms,
)
from worker.kafka.share_groups import ShareClients, prepare_share_group, queue_kafka_options
from worker.logs import configure_logging, librdkafka_logger
from worker.pipeline.engine import Engine
from worker.pipeline.hanging import TransactionWatch
from worker.settings import Settings, masked_kafka_config
from worker.telemetry.access import ReloadAccess
from worker.telemetry.tracing import tracing_for
from worker.telemetry.worker import WorkerTelemetry

_log = structlog.get_logger("worker.run")


class WorkerApp:
    """One running worker: consume tickets, classify them, produce one record each (see the module's
    contract)."""

    def __init__(
        self,
        settings: Settings,
        reread: Callable[[], Settings],
        *,
        metrics_interval_s: float = 10.0,
        held_stop_signals: Sequence[int] = (),
    ) -> None:
        self._configured = settings
        self._reread = reread
        self._metrics_interval_s = metrics_interval_s
        self._held = held_stop_signals  # read at start: the CLI's holder may still be appending
        self._stop_requested = False
        self._pipeline: Engine | None = None
        self._telemetry: WorkerTelemetry | None = None
        self._reloader: Reloader | None = None
        self._classifier: SwitchingClassifier | None = None
        self._escalation_pool: ClassifierPool | None = None
        self._shadow_pool: ClassifierPool | None = None
        self._transaction_watch: TransactionWatch | None = None

    def run(self) -> int:
        """Start (unless started), run until stopped, close; the pipeline's exit code."""
        try:
            pipeline = self._pipeline or self.start()
            return pipeline.run()
        finally:
            self.close()

    def request_stop(self) -> None:
        """Stop gracefully, as SIGTERM does (from any thread, or a signal handler: no lock is taken)."""
        self._stop_requested = True
        if self._pipeline is not None:
            self._pipeline.request_stop()

    def start(self) -> Engine:
        """Check, load and assemble everything (see the contract); the pipeline, not running yet."""
        # As configured, before the start fits options to the broker: what a reload compares with.
        settings = configured = with_zero_shot_review(self._configured)
        configure_logging(settings.log, settings.privacy)
        StopOnSignals(self._held, self.request_stop, _log_stop)
        _log.info("settings", kafka=masked_kafka_config(settings.kafka), pid=os.getpid())
        reload_access = ReloadAccess.configured(settings.metrics)  # an unfit token file stops the start here
        # Tracing on without the `otel` extra stops the start here (a no-op unless tracing is configured).
        tracing = tracing_for(settings.tracing, settings.pipeline.group_id)
        queue = settings.pipeline.consume == "queue"
        if queue:
            refuse_exactly_once(settings)
        else:
            # An option the group protocol refuses (or one the pipeline relies on, weakened) stops it here.
            consumer_config(settings.kafka, settings.pipeline)
        # The input's decoder (with its registry client) reads only input settings: a Protobuf class that
        # does not import stops the start here, before the broker is asked.
        decoder = decoder_for(settings.input, settings.schema_registry, settings.pipeline.max_value_bytes)
        # Model and taxonomy pairs first: a config problem needs no broker to be found (pairing.py). Each
        # model's taxonomy is resolved here, once: its pool, engines and fallbacks take this one value (the
        # escalation stage takes the first stage's).
        taxonomy, taxonomy_path = resolve_taxonomy(settings.inference)
        shadow_inference = settings.inference.shadow_settings()
        shadow_taxonomy = None if shadow_inference is None else resolve_taxonomy(shadow_inference)
        escalation = choose_escalation(settings.inference, taxonomy, taxonomy_path)
        if escalation.why_off is not None:
            _log.info("cascade_off", reason=escalation.why_off)
        settings = check_topics(settings)
        share_group = None
        if queue:  # the share group's lock and delivery limit; its start at the earliest offset
            share_group = prepare_share_group(settings.kafka, settings.pipeline)
            settings = msgspec.structs.replace(
                settings, kafka=queue_kafka_options(settings.kafka, share_group)
            )
            lock_budget(settings, share_group).check()
        # Registered once, here: a registry that refuses the output schema stops the start in one line.
        result_encoder = result_encoder_for(settings.output, settings.schema_registry, settings.topics.output)
        # A no-op unless metrics.port is set.
        telemetry = self._telemetry = WorkerTelemetry.start(
            settings.metrics,
            settings.inference,
            settings.kafka,
            settings.topics.input,
            librdkafka_logger(),
            reload_access,
        )
        # Read the settings again as above: an edited --config file (a remounted ConfigMap) takes effect.
        reloader = self._reloader = Reloader(
            configured,
            lambda: with_zero_shot_review(self._reread()),
            taxonomy.fallback_label,
            telemetry.reloaded,
            escalation_labels=None if escalation.settings is None else taxonomy.labels,
            on_pending=telemetry.restart_pending,
        )
        if hasattr(signal, "SIGHUP"):  # not on Windows: POST /reload there
            # Before the model loads: a hang-up meanwhile reloads once the worker runs, instead of killing it.
            signal.signal(signal.SIGHUP, lambda _signum, _frame: reloader.request("SIGHUP"))
        pool = open_pool(settings.inference, taxonomy, taxonomy_path, settings.log, settings.privacy)
        classifier = self._classifier = SwitchingClassifier(pool)
        cascade = None
        if escalation.settings is not None:
            self._escalation_pool, cascade = open_cascade(
                settings,
                escalation.settings,
                taxonomy,
                taxonomy_path,
                classifier.current.size,
                lambda line: _log.info("fetching", what=line),
            )
        shadow = None
        if shadow_inference is not None and shadow_taxonomy is not None:
            self._shadow_pool = open_shadow_pool(shadow_inference, *shadow_taxonomy, settings)
            shadow = start_shadow(settings, shadow_inference, self._shadow_pool)
        review = start_review(settings) if settings.review.enabled else None
        parts = TriageParts(
            classifier,
            taxonomy.fallback_label,
            dispatch_window(settings),
            cascade=cascade,
            shadow=shadow,
            review=review,
            decoder=decoder,
            result_encoder=result_encoder,
            tracing=tracing,
        )
        if share_group is not None:
            pipeline = queue_pipeline(
                settings,
                parts,
                share_group,
                clients=ShareClients(settings.kafka, settings.pipeline, librdkafka_logger()),
                metrics_interval_s=self._metrics_interval_s,
            )
        else:
            pipeline = group_pipeline(
                settings,
                parts,
                clients=KafkaClients(settings.kafka, settings.pipeline, librdkafka_logger()),
                metrics_interval_s=self._metrics_interval_s,
            )
        if share_group is None and exactly_once(settings.pipeline):
            self._transaction_watch = TransactionWatch(
                consumer_config(settings.kafka, settings.pipeline),
                settings.topics.input,
                [settings.topics.output, settings.topics.dead_letter],
                pipeline.metrics,
                transaction_timeout_ms(settings.kafka),
            ).start()
        telemetry.attach(
            pipeline.metrics,
            classifier.model_id,
            classifier.current.size,
            model=Path(settings.inference.model).expanduser(),
            escalation_stage=None
            if escalation.settings is None
            else Path(escalation.settings.model).expanduser(),
        )
        telemetry.watch_model_processes("primary", lambda: classifier.current.worker_pids())
        if self._shadow_pool is not None:
            telemetry.watch_model_processes("shadow", self._shadow_pool.worker_pids)
        if self._escalation_pool is not None:
            telemetry.watch_model_processes("escalation", self._escalation_pool.worker_pids)
        telemetry.serve_reload(lambda: reloader.request_unless_busy("POST /reload"))
        self._pipeline = pipeline
        if self._stop_requested:
            pipeline.request_stop()
        reloader.start(classifier, cascade, parts.reloaded)
        return pipeline

    def close(self) -> None:
        """Stop the reloader and the transaction watch, close the pools and the telemetry port (what was
        started of them)."""
        if self._transaction_watch is not None:
            self._transaction_watch.close()
        if self._reloader is not None:
            self._reloader.close()
        if self._classifier is not None:
            self._classifier.close()
        if self._shadow_pool is not None:
            self._shadow_pool.close()
        if self._escalation_pool is not None:
            self._escalation_pool.close()
        if self._telemetry is not None:
            self._telemetry.close()


def check_topics(settings: Settings) -> Settings:
    """Fail at start, in one line, when the broker is unreachable, refuses the credentials or certificate,
    or a topic is missing; returns `settings` with the producer's record limit fitted to the topics it
    writes (`producer_record_limit`)."""
    bootstrap = settings.kafka.get("bootstrap.servers", "")
    # In the configured log format (JSON logs stay JSON), not a bare line on stderr.
    existing = existing_topics(
        producer_config(settings.kafka), on_wait=lambda line: _log.info("waiting_for_kafka", line=line)
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
    limits = record_size_limits(producer_config(settings.kafka), written)
    return msgspec.structs.replace(settings, kafka=producer_record_limit(settings.kafka, limits))


def with_zero_shot_review(settings: Settings) -> Settings:
    """`settings` with review on for a zero-shot model (`worker.inference.loading.zero_shot_review`): what
    `run` serves and what `topics create` makes topics for."""
    review = zero_shot_review(settings.review, settings.privacy, settings.inference.model)
    return msgspec.structs.replace(settings, review=review)


def _log_stop(name: str, held: bool) -> None:
    if held:
        _log.info("stop_requested", signal=name, when="while the modules imported")
    else:
        _log.info("stop_requested", signal=name, again="exits at once")
