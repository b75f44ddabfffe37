"""The worker's probes: liveness (the consumer loop turns) and readiness (the model pool warm, the broker
answering, the consumer in its group), and the background broker check behind them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import confluent_kafka
import structlog
from confluent_kafka.admin import AdminClient

from worker.kafka.admin import METADATA_ONLY
from worker.kafka.clients import ClientErrorLog, producer_config
from worker.pipeline.metrics import PartitionGauges, PipelineMetrics, RegistryState
from worker.telemetry.server import Check, Probes, report

_log = structlog.get_logger("worker.telemetry")

# How often the background thread asks the broker for metadata, and how long it waits for an answer.
_BROKER_CHECK_INTERVAL_S = 5.0
_BROKER_CHECK_TIMEOUT_S = 3.0


class BrokerProbe:
    """Asks the bootstrap brokers for metadata every few seconds from a daemon thread (own admin client, the
    worker's connection settings and credentials, the `[kafka]` options `kafka`) about `topic`; the last
    answer is what /readyz reports."""

    def __init__(self, kafka: Mapping[str, str], topic: str, logger: Any = None) -> None:
        config: dict[str, Any] = {**producer_config(kafka), **METADATA_ONLY}
        config["error_cb"] = ClientErrorLog("readiness-probe")
        if logger is not None:
            config["logger"] = logger
        self._admin = AdminClient(config)
        self._topic = topic
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
            # An admin client's lines and errors wait in its queue (growing through an outage) for a poll.
            self._admin.poll(0)
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
        # Settings configured (as the last reload read them) that only a restart applies, by dotted key.
        self.restart_pending: tuple[str, ...] = ()
        # The share of in-scope tickets the serving out-of-scope detector was fitted to flag at most (its
        # folder's card); None: no detector serves.
        self.out_of_scope_promise: float | None = None

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
        return report({"loop": self._loop()})

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """The checks, and `restart_pending`: the settings only a restart applies, which do not fail
        readiness (the worker serves with the settings it started with; failing every pod a ConfigMap edit
        reached would take the whole group out of service instead of waiting for a rollout)."""
        ok, body = self._checks()
        return ok, {**body, "restart_pending": list(self.restart_pending)}

    def _checks(self) -> tuple[bool, dict[str, Any]]:
        warm = self.warm_contexts
        gauges = self.metrics.partitions if self.metrics is not None else None
        registry = self.metrics.registry if self.metrics is not None else None
        # Only where the input format reads a Schema Registry: plain JSON workers keep their checks.
        registry_check = {} if registry is None else {"schema_registry": self._registry(registry)}
        return report(
            {
                "pool": Check(True, f"{warm} contexts warm") if warm else Check(False, "warming up"),
                "broker": self._broker.state,
                "group": (
                    Check(True, f"joined, {len(gauges.assigned)} partition(s) assigned")
                    if gauges is not None and gauges.member
                    else Check(False, "not joined yet")
                ),
                "loop": self._loop() if self.loop_age() is not None else Check(False, "not started"),
                "partitions": self._partitions(gauges),
                **registry_check,
            }
        )

    @staticmethod
    def _registry(registry: RegistryState) -> Check:
        """Not ready while records wait for the Schema Registry (worker/pipeline/registry_wait.py): they are
        retried, not lost, but this worker makes no progress on those partitions until it answers."""
        if registry.outage is None:
            return Check(True, "answering")
        waiting = (
            ", ".join(f"{topic}[{partition}]" for topic, partition in registry.waiting) or "retrying now"
        )
        return Check(False, f"unavailable ({registry.cause}), records retried ({waiting}): {registry.outage}")

    @staticmethod
    def _partitions(gauges: PartitionGauges | None) -> Check:
        """Not ready while a partition is stopped: a delivery failed for a reason no retry fixes (its topic
        gone or not writable). The worker takes nothing more from it until a restart or rebalance."""
        if gauges is None or not gauges.blocked:
            return Check(True, "none stopped")
        stopped = ", ".join(f"{topic}[{partition}]" for topic, partition in gauges.blocked)
        return Check(False, f"stopped by a failed delivery (see delivery_failed in the log): {stopped}")


# (Prometheus name without _total, PipelineMetrics attribute, help)
