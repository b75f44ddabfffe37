"""The worker's endpoint: its probes (the loop turning, the pool warm, the broker answering, the group
joined), the collectors registered on one port, and the reload hook behind its token (access.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from worker import __version__
from worker.inference.encoder import out_of_scope_promise
from worker.inference.pool import ClassifierPool, default_pool_kind, default_pool_size
from worker.pipeline.metrics import PipelineMetrics
from worker.settings import InferenceSettings, MetricsSettings
from worker.telemetry.access import ReloadAccess
from worker.telemetry.collectors import ModelProcessCollector, PipelineCollector
from worker.telemetry.probes import BrokerProbe, WorkerProbes
from worker.telemetry.server import TelemetryServer, new_registry

_log = structlog.get_logger("worker.telemetry")


@dataclass
class WorkerTelemetry:
    """The worker's endpoint, or nothing when `metrics.port` is unset; `attach` as the pieces come up."""

    probes: WorkerProbes | None = None
    server: TelemetryServer | None = None
    broker: BrokerProbe | None = None
    info: dict[str, str] = field(default_factory=dict)
    model_processes: ModelProcessCollector | None = None
    reload_access: ReloadAccess = field(default_factory=lambda: ReloadAccess(None))
    # The cascade's encoder stage (None: no cascade), whose detector serves where the model has none.
    escalation_stage: Path | None = None

    @classmethod
    def start(
        cls,
        metrics: MetricsSettings,
        inference: InferenceSettings,
        kafka: Mapping[str, str],
        input_topic: str,
        logger: Any = None,
        reload_access: ReloadAccess | None = None,
    ) -> WorkerTelemetry:
        """Serve on `metrics`' port from now on (before the model loads, so probes answer during start-up);
        the info metric and the contexts expected describe `inference`; readiness asks the brokers of the
        `[kafka]` options `kafka` about `input_topic`. `reload_access` decides who may `POST /reload` once
        `serve_reload` wires it (default: nobody)."""
        access = reload_access or ReloadAccess(None)
        if metrics.port is None:
            return cls()
        broker = BrokerProbe(kafka, input_topic, logger)
        probes = WorkerProbes(metrics.stall_timeout_ms / 1000.0, broker, time.monotonic)
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
        model_processes = ModelProcessCollector()
        registry.register(model_processes)
        try:
            server = TelemetryServer(metrics, registry, probes)
        except BaseException:
            broker.close()
            raise
        reload = "closed (SIGHUP reloads)" if access.closed else "token required"
        _log.info("telemetry_listening", host=metrics.host, port=server.port, reload=reload)
        return cls(probes, server, broker, info, model_processes, access)

    def attach(
        self,
        metrics: PipelineMetrics,
        model_id: str,
        pool_contexts: int,
        model: Path | None = None,
        escalation_stage: Path | None = None,
    ) -> None:
        """The pool is warm and the pipeline built: from now on its numbers are exported, with the promise
        of the out-of-scope detector that serves: the `model` folder's, else the cascade's
        `escalation_stage`'s (`promise`)."""
        if self.probes is None:
            return
        self.info["model"] = model_id
        self.probes.pool_contexts = self.probes.warm_contexts = pool_contexts
        self.probes.metrics = metrics
        self.escalation_stage = escalation_stage
        self.probes.out_of_scope_promise = self.promise(model)

    def promise(self, model: Path | None) -> float | None:
        """The share of in-scope tickets the detector answering "none of these" was fitted to flag at most:
        the first stage's (`model`, an encoder stage) where it has one, else the cascade's stage's."""
        found = None if model is None else out_of_scope_promise(model)
        if found is None and self.escalation_stage is not None:
            found = out_of_scope_promise(self.escalation_stage)
        return found

    def watch_model_processes(self, role: str, pids: Callable[[], list[int]]) -> None:
        """Export the CPU and memory of the processes `pids` names, as pool `role` (primary, shadow)."""
        if self.model_processes is not None:
            self.model_processes.pools[role] = pids

    def serve_reload(self, request: Callable[[], bool]) -> None:
        """Answer `POST /reload` (for holders of the token) by calling `request`, which must return at once,
        saying whether it took the request (False: a reload is already waiting or running)."""
        if self.server is not None:
            self.server.serve_reload(request, self.reload_access)

    def reloaded(
        self, outcome: str, inference: InferenceSettings | None, pool: ClassifierPool | None
    ) -> None:
        """Count a reload; a new pool's model and contexts are what runs from now on (the cascade's stage,
        and so the out-of-scope promise where it comes from that stage, only a restart changes)."""
        if self.probes is None:
            return
        self.probes.reloads[outcome] += 1
        if inference is not None and pool is not None:
            kind = default_pool_kind(inference)
            self.info.update(model=pool.model_id, mode=inference.mode, provider=inference.provider, pool=kind)
            self.probes.pool_contexts = self.probes.warm_contexts = pool.size
            self.probes.out_of_scope_promise = self.promise(Path(inference.model).expanduser())

    def restart_pending(self, settings: list[str]) -> None:
        """The settings configured now that only a restart applies (a hot reload's finding; none: [])."""
        if self.probes is not None:
            self.probes.restart_pending = tuple(settings)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.broker is not None:
            self.broker.close()
