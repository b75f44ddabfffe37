"""One HTTP port per process: Prometheus `/metrics`, liveness `/healthz` and readiness `/readyz`.

Nothing here runs on the consumer thread. The pipeline keeps plain counters and histograms in
`PipelineMetrics` (see worker/pipeline/metrics.py); a custom Collector turns them into Prometheus families
when Prometheus scrapes, on the server's own thread. Broker reachability for `/readyz` is checked by a
background thread with its own admin client, so a probe never waits on the broker, nor the loop on a probe.

- `/healthz` (liveness): 200 unless the consumer loop has not turned for `metrics.stall_timeout_ms`. Before
  the loop starts (model loading) it is 200: restarting a loading worker would only load it again.
- `/readyz` (readiness): 200 once the model pool is warm, the broker answers, and the consumer has joined its
  group; otherwise 503 with the failing checks in the JSON body.
- `POST /reload` (the worker only): starts a hot reload of the model and answers 202 at once; the outcome
  goes to the logs and `triage_reloads_total{outcome}` (see worker/ops/reload.py).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import wsgiref.simple_server
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import confluent_kafka
import msgspec
import structlog
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from worker import __version__
from worker.config import InferenceSettings, MetricsSettings, Settings
from worker.errors import UserError
from worker.inference.pool import ClassifierPool, default_pool_kind, default_pool_size
from worker.kafka.clients import ClientErrorLog, producer_config
from worker.pipeline.metrics import LatencyHistogram, PipelineMetrics, ReviewMetrics, ShadowMetrics

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from worker.replay.engine import PartitionPlan, RecordReport, ReplayObserver

_log = structlog.get_logger("worker.telemetry")

# How often the background thread asks the broker for metadata, and how long it waits for an answer.
_BROKER_CHECK_INTERVAL_S = 5.0
_BROKER_CHECK_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Check:
    ok: bool
    detail: str


def _report(checks: dict[str, Check]) -> tuple[bool, dict[str, Any]]:
    ok = all(check.ok for check in checks.values())
    return ok, {
        "status": "ok" if ok else "fail",
        "checks": {name: {"ok": check.ok, "detail": check.detail} for name, check in checks.items()},
    }


class Probes:
    """What /healthz and /readyz answer; this default (short-lived commands such as replay) is always ok."""

    def live(self) -> tuple[bool, dict[str, Any]]:
        return _report({})

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return _report({})


class TelemetryServer:
    """/metrics, /healthz and /readyz on a threading WSGI server in a daemon thread."""

    def __init__(self, settings: MetricsSettings, registry: CollectorRegistry, probes: Probes) -> None:
        assert settings.port is not None
        self._metrics_app = make_wsgi_app(registry)
        self._probes = probes
        # What `POST /reload` calls (it must not block); None: the path does not exist.
        self.reload: Callable[[], None] | None = None
        try:
            self._server = wsgiref.simple_server.make_server(
                settings.host, settings.port, self._app, ThreadingWSGIServer, handler_class=_QuietHandler
            )
        except OSError as error:
            raise UserError(
                f"cannot serve metrics on {settings.host}:{settings.port}: {error.strerror or error}"
            ) from None
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="telemetry", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> TelemetryServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path == "/reload" and self.reload is not None:
            if environ.get("REQUEST_METHOD") != "POST":
                start_response("405 Method Not Allowed", [("Allow", "POST"), ("Content-Type", "text/plain")])
                return [b"POST /reload starts a reload\n"]
            self.reload()
            start_response("202 Accepted", [("Content-Type", "application/json")])
            return [b'{"status": "accepted", "outcome": "see the logs and triage_reloads_total"}\n']
        probe: Callable[[], tuple[bool, dict[str, Any]]] | None = {
            "/healthz": self._probes.live,
            "/readyz": self._probes.ready,
        }.get(path)
        if probe is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"try /metrics, /healthz or /readyz\n"]
        ok, body = probe()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [json.dumps(body).encode() + b"\n"]


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    """No access log: probes every few seconds would drown the worker's own events."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def new_registry() -> CollectorRegistry:
    """A registry with the process (CPU, RSS, open fds) and Python platform collectors, and nothing global."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


# -- the worker -------------------------------------------------------------------------------------------


class BrokerProbe:
    """Asks the bootstrap brokers for metadata every few seconds from a daemon thread (own admin client, the
    worker's connection settings and credentials); the last answer is what /readyz reports."""

    def __init__(self, settings: Settings, logger: Any = None) -> None:
        config: dict[str, Any] = dict(producer_config(settings))
        config["error_cb"] = ClientErrorLog("readiness-probe")
        if logger is not None:
            config["logger"] = logger
        self._admin = AdminClient(config)
        self._topic = settings.topics.input
        self.state = Check(False, "not checked yet")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="broker-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._admin.list_topics(topic=self._topic, timeout=_BROKER_CHECK_TIMEOUT_S)
                self.state = Check(True, "metadata answered")
            except confluent_kafka.KafkaException as error:
                # The client's message names the broker and the failure, never a credential.
                self.state = Check(False, f"unreachable: {error.args[0].str()}")
            if self._stop.wait(_BROKER_CHECK_INTERVAL_S):
                return

    def close(self) -> None:
        self._stop.set()


class WorkerProbes(Probes):
    def __init__(self, stall_timeout_s: float, broker: BrokerProbe, clock: Callable[[], float]) -> None:
        self._stall_timeout_s = stall_timeout_s
        self._broker = broker
        self._clock = clock
        self.metrics: PipelineMetrics | None = None
        # Contexts the pool is configured with, and how many are warm (0 until the pool has started).
        self.pool_contexts: int | None = None
        self.warm_contexts = 0
        self.reloads: dict[str, int] = {"succeeded": 0, "failed": 0}

    def loop_age(self) -> float | None:
        """Seconds since the consumer loop last turned; None before its first turn."""
        turned = self.metrics.loop_turned_at if self.metrics is not None else None
        return None if turned is None else max(0.0, self._clock() - turned)

    def _loop(self) -> Check:
        age = self.loop_age()
        if age is None:
            return Check(True, "starting")
        if age > self._stall_timeout_s:
            return Check(False, f"stalled: no turn for {age:.1f}s (limit {self._stall_timeout_s:g}s)")
        return Check(True, f"turned {age:.3f}s ago")

    def live(self) -> tuple[bool, dict[str, Any]]:
        return _report({"loop": self._loop()})

    def ready(self) -> tuple[bool, dict[str, Any]]:
        warm = self.warm_contexts
        gauges = self.metrics.partitions if self.metrics is not None else None
        return _report(
            {
                "pool": Check(True, f"{warm} contexts warm") if warm else Check(False, "warming up"),
                "broker": self._broker.state,
                "group": (
                    Check(True, f"joined, {len(gauges.assigned)} partition(s) assigned")
                    if gauges is not None and gauges.member
                    else Check(False, "not joined yet")
                ),
                "loop": self._loop() if self.loop_age() is not None else Check(False, "not started"),
            }
        )


# (Prometheus name without _total, PipelineMetrics attribute, help)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("triage_consumed", "consumed", "Records taken from the input topic."),
    (
        "triage_redelivered",
        "redelivered",
        "Records delivered again for an offset already in flight (skipped).",
    ),
    ("triage_classified", "classified", "Tickets the model classified (not fallbacks)."),
    ("triage_produced", "produced", "Results and dead letters the broker acknowledged."),
    ("triage_delivery_failed", "delivery_failed", "Results or dead letters whose delivery failed for good."),
    ("triage_committed", "committed", "Input offsets released by a confirmed commit."),
    ("triage_commit_failed", "commit_failed", "Commits that failed."),
    ("triage_transactions", "transactions", "Exactly-once: transactions committed."),
    ("triage_transactions_aborted", "transactions_aborted", "Exactly-once: transactions aborted and redone."),
    ("triage_discarded_after_revoke", "discarded_after_revoke", "Answers dropped: their partition moved."),
    ("triage_partitions_revoked", "revoked", "Partitions revoked by rebalances."),
    ("triage_partitions_lost", "lost", "Partitions lost (the group moved on without this worker)."),
    ("triage_max_poll_exceeded", "max_poll_exceeded", "Times the consumer left the group for not polling."),
)


class PipelineCollector(Collector):
    """Prometheus families built from `PipelineMetrics` at scrape time."""

    def __init__(self, probes: WorkerProbes, info: dict[str, str]) -> None:
        self._probes = probes
        self._info = info

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("triage_worker", "Build and model of this worker.")
        info.add_metric([], self._info)
        yield info
        yield _gauge(
            "triage_pool_contexts",
            "Inference contexts configured (worker processes or batchers).",
            self._probes.pool_contexts,
        )
        yield _gauge(
            "triage_pool_ready_contexts",
            "Contexts loaded and warmed (0 while the pool starts).",
            self._probes.warm_contexts,
        )
        reloads = CounterMetricFamily(
            "triage_reloads", "Hot reloads of the model, by outcome.", labels=["outcome"]
        )
        for outcome, count in sorted(self._probes.reloads.items()):
            reloads.add_metric([outcome], count)
        yield reloads
        metrics = self._probes.metrics
        if metrics is None:
            return
        for name, attribute, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(metrics, attribute))
        fallbacks = CounterMetricFamily(
            "triage_fallbacks", "Tickets answered with the fallback label, by reason.", labels=["reason"]
        )
        for reason, count in sorted(dict(metrics.fallback).items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
        dead = CounterMetricFamily(
            "triage_dead_letters",
            "Records sent to the dead-letter topic, by error type.",
            labels=["error_type"],
        )
        for error_type, count in sorted(dict(metrics.dead_lettered_by_type).items()):
            dead.add_metric([error_type], count)
        yield dead
        yield _histogram(
            "triage_end_to_end_latency_seconds",
            "Poll to broker acknowledgement of the ticket's result or dead letter.",
            metrics.end_to_end,
        )
        yield _histogram(
            "triage_model_latency_seconds",
            "Model time per ticket, as the engine reports it.",
            metrics.model_latency,
        )
        yield _histogram(
            "triage_queue_wait_seconds", "Poll to hand-over to the inference pool.", metrics.queue_wait
        )
        yield _gauge("triage_in_flight", "Tickets between poll and confirmed commit.", metrics.in_flight)
        yield _gauge("triage_in_flight_max", "Highest in-flight count seen.", metrics.in_flight_max)
        yield _gauge(
            "triage_backpressure", "1 while consumption is paused at max_in_flight.", int(metrics.paused)
        )
        gauges = metrics.partitions
        yield _gauge(
            "triage_assigned_partitions", "Partitions assigned to this worker.", len(gauges.assigned)
        )
        yield _gauge("triage_paused_partitions", "Assigned partitions paused.", len(gauges.paused))
        yield _gauge(
            "triage_blocked_partitions", "Partitions stopped by a failed delivery (need a restart).",
            len(gauges.blocked),
        )  # fmt: skip
        yield _gauge("triage_group_member", "1 once the consumer has joined its group.", int(gauges.member))
        lag = GaugeMetricFamily(
            "triage_consumer_lag",
            "Log end offset (as of the last fetch) minus the next offset this worker reads, per partition.",
            labels=["topic", "partition"],
        )
        for (topic, partition), value in gauges.lag:
            lag.add_metric([topic, str(partition)], value)
        yield lag
        yield _gauge(
            "triage_loop_last_turn_age_seconds", "Seconds since the consumer loop last turned.",
            self._probes.loop_age(),
        )  # fmt: skip
        if metrics.shadow is not None:
            yield from _shadow_families(metrics.shadow)
        if metrics.review is not None:
            yield from _review_families(metrics.review)


def _shadow_families(shadow: ShadowMetrics) -> Iterator[Metric]:
    """The shadow model's families. Intent labels come from the two taxonomies, so the pairs are bounded by
    the product of their sizes, and only pairs seen are exported."""
    yield CounterMetricFamily(
        "triage_shadow_offered", "Classified tickets offered to the shadow model.", value=shadow.offered
    )
    dropped = CounterMetricFamily(
        "triage_shadow_dropped",
        "Tickets the shadow did not classify: full (at its bound) or shutdown (still at it on stop).",
        labels=["reason"],
    )
    for reason, count in sorted(dict(shadow.dropped).items()):
        dropped.add_metric([reason], count)
    yield dropped
    yield CounterMetricFamily(
        "triage_shadow_agreed", "Shadow classifications with the primary's intent.", value=shadow.agreed
    )
    disagreed = CounterMetricFamily(
        "triage_shadow_disagreed",
        "Shadow classifications with another intent than the primary's, by intent pair.",
        labels=["primary_intent", "shadow_intent"],
    )
    for (primary, other), count in sorted(dict(shadow.disagreed).items()):
        disagreed.add_metric([primary, other], count)
    yield disagreed
    fallbacks = CounterMetricFamily(
        "triage_shadow_fallbacks", "Shadow answers that were fallbacks (not compared).", labels=["reason"]
    )
    for reason, count in sorted(dict(shadow.fallback).items()):
        fallbacks.add_metric([reason], count)
    yield fallbacks
    yield CounterMetricFamily(
        "triage_shadow_produced", "Side records the broker acknowledged.", value=shadow.produced
    )
    yield CounterMetricFamily(
        "triage_shadow_delivery_failed", "Side records not sent or not acknowledged.",
        value=shadow.delivery_failed,
    )  # fmt: skip
    yield _gauge("triage_shadow_outstanding", "Tickets at the shadow model now.", shadow.outstanding)
    yield _histogram(
        "triage_shadow_latency_seconds", "Shadow model time per ticket, as its engine reports it.",
        shadow.latency,
    )  # fmt: skip


def _review_families(review: ReviewMetrics) -> Iterator[Metric]:
    """Results sent to the review topic, by intent (the taxonomy bounds the labels) and reason."""
    sent = CounterMetricFamily(
        "triage_review_sent", "Results also sent to the review topic.", labels=["intent", "reason"]
    )
    for (intent, reason), count in sorted(dict(review.sent).items()):
        sent.add_metric([intent, reason], count)
    yield sent
    yield CounterMetricFamily(
        "triage_review_produced", "Review records the broker acknowledged.", value=review.produced
    )
    yield CounterMetricFamily(
        "triage_review_delivery_failed",
        "Review records not sent or not acknowledged.",
        value=review.delivery_failed,
    )


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def _histogram(name: str, doc: str, histogram: LatencyHistogram) -> HistogramMetricFamily:
    counts, total = histogram.snapshot()
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for bound, count in zip([*histogram.bounds, float("inf")], counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


@dataclass
class WorkerTelemetry:
    """The worker's endpoint, or nothing when `metrics.port` is unset; `attach` as the pieces come up."""

    probes: WorkerProbes | None = None
    server: TelemetryServer | None = None
    broker: BrokerProbe | None = None
    info: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, settings: Settings, logger: Any = None) -> WorkerTelemetry:
        """Serve from now on (before the model loads, so probes answer during start-up)."""
        if settings.metrics.port is None:
            return cls()
        broker = BrokerProbe(settings, logger)
        probes = WorkerProbes(settings.metrics.stall_timeout_ms / 1000.0, broker, time.monotonic)
        inference = settings.inference
        probes.pool_contexts = default_pool_size(inference, default_pool_kind(inference))
        info = {
            "version": __version__,
            "model": "",
            "mode": inference.mode,
            "provider": inference.provider,
            "pool": default_pool_kind(inference),
        }
        registry = new_registry()
        registry.register(PipelineCollector(probes, info))
        try:
            server = TelemetryServer(settings.metrics, registry, probes)
        except BaseException:
            broker.close()
            raise
        _log.info("telemetry_listening", host=settings.metrics.host, port=server.port)
        return cls(probes, server, broker, info)

    def attach(self, metrics: PipelineMetrics, model_id: str, pool_contexts: int) -> None:
        """The pool is warm and the pipeline built: from now on its numbers are exported."""
        if self.probes is None:
            return
        self.info["model"] = model_id
        self.probes.pool_contexts = self.probes.warm_contexts = pool_contexts
        self.probes.metrics = metrics

    def serve_reload(self, request: Callable[[], None]) -> None:
        """Answer `POST /reload` by calling `request` (which must return at once)."""
        if self.server is not None:
            self.server.reload = request

    def reloaded(
        self, outcome: str, inference: InferenceSettings | None, pool: ClassifierPool | None
    ) -> None:
        """Count a reload; a new pool's model and contexts are what runs from now on."""
        if self.probes is None:
            return
        self.probes.reloads[outcome] += 1
        if inference is not None and pool is not None:
            kind = default_pool_kind(inference)
            self.info.update(model=pool.model_id, mode=inference.mode, provider=inference.provider, pool=kind)
            self.probes.pool_contexts = self.probes.warm_contexts = pool.size

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.broker is not None:
            self.broker.close()


# -- replay -----------------------------------------------------------------------------------------------


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
        yield _gauge("triage_replay_planned_records", "Dead letters this run will go through.", self._planned)
        records = CounterMetricFamily(
            "triage_replay_records", "Dead letters settled by this run, by outcome.", labels=["outcome"]
        )
        for outcome, count in sorted(dict(self._settled).items()):
            records.add_metric([outcome], count)
        yield records


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
