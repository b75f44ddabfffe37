"""The exporter and probes without a broker: exposition format, histogram buckets, known labels at 0, model
processes, stall detection, config."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import typing
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from doubles import HealthyBroker
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from worker.decoding import DecodeErrorType
from worker.errors import UserError
from worker.messages import FallbackReason
from worker.pipeline.metrics import (
    LATENCY_BUCKETS_S,
    LatencyHistogram,
    PartitionGauges,
    PipelineMetrics,
    QueueMetrics,
    ShadowMetrics,
)
from worker.replay.outcomes import ReplayOutcome
from worker.settings import MetricsSettings, load_settings
from worker.telemetry.access import ReloadAccess
from worker.telemetry.collectors import ModelProcessCollector, PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.replay import ReplayMetrics
from worker.telemetry.server import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    REQUEST_DEADLINE_S,
    TelemetryServer,
    new_registry,
)


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _serve(probes: WorkerProbes) -> TelemetryServer:
    registry = new_registry()
    registry.register(PipelineCollector(probes, {"version": "0.1.0", "model": "m", "mode": "score"}))
    return TelemetryServer(MetricsSettings(port=0, host="127.0.0.1"), registry, probes)


def _get(server: TelemetryServer, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_value_on_a_bucket_bound_counts_in_that_bucket() -> None:
    histogram = LatencyHistogram((0.01, 0.1))
    for seconds in (0.01, 0.05, 0.1, 3.0):
        histogram.observe(seconds)
    counts, total = histogram.snapshot()
    assert counts == [1, 2, 1]  # le=0.01, le=0.1, above every bound
    assert total == pytest.approx(3.16)


def test_metrics_page_parses_and_carries_the_pipeline_numbers() -> None:
    clock = _Clock()
    probes = WorkerProbes(60.0, HealthyBroker(), clock)  # type: ignore[arg-type]
    metrics = PipelineMetrics(consumed=10, classified=6, produced=10, committed=10)
    metrics.fallback["deadline_exceeded"] += 2
    metrics.dead_letter("invalid_json")
    metrics.dead_letter("invalid_json")
    metrics.pii_tickets, metrics.pii_found["card_number"] = 3, 4
    for seconds in (0.004, 0.02, 0.02, 7.0):
        metrics.end_to_end.observe(seconds)
    metrics.partitions = PartitionGauges(assigned=(("in", 0), ("in", 1)), lag=((("in", 1), 42),), member=True)
    metrics.loop_turned_at = 99.5
    probes.metrics, probes.pool_contexts, probes.warm_contexts = metrics, 2, 2
    with _serve(probes) as server:
        status, text = _get(server, "/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("triage_consumed_total", ())] == 10
    assert samples[("triage_fallbacks_total", (("reason", "deadline_exceeded"),))] == 2
    assert samples[("triage_dead_letters_total", (("error_type", "invalid_json"),))] == 2
    assert samples[("triage_pii_tickets_total", ())] == 3
    assert samples[("triage_pii_detections_total", (("kind", "card_number"),))] == 4
    assert samples[("triage_pii_detections_total", (("kind", "iban"),))] == 0  # every kind, found or not
    assert samples[("triage_end_to_end_latency_seconds_bucket", (("le", "0.005"),))] == 1
    assert samples[("triage_end_to_end_latency_seconds_bucket", (("le", "0.025"),))] == 3
    assert samples[("triage_end_to_end_latency_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("triage_end_to_end_latency_seconds_count", ())] == 4
    assert samples[("triage_consumer_lag", (("partition", "1"), ("topic", "in")))] == 42
    assert samples[("triage_assigned_partitions", ())] == 2
    assert samples[("triage_pool_ready_contexts", ())] == 2
    assert samples[("triage_loop_last_turn_age_seconds", ())] == pytest.approx(0.5)
    assert ("triage_worker_info", (("mode", "score"), ("model", "m"), ("version", "0.1.0"))) in samples
    assert any(name.startswith("process_") for name, _ in samples)


def test_healthz_fails_once_the_loop_stalls_and_readyz_names_what_is_missing() -> None:
    clock = _Clock()
    probes = WorkerProbes(60.0, HealthyBroker(), clock)  # type: ignore[arg-type]
    with _serve(probes) as server:
        # Loading the model: alive, not ready, and the body says why.
        assert _get(server, "/healthz")[0] == 200
        status, body = _get(server, "/readyz")
        checks = json.loads(body)["checks"]
        assert status == 503
        assert not checks["pool"]["ok"] and not checks["group"]["ok"] and checks["broker"]["ok"]
        metrics = PipelineMetrics(loop_turned_at=clock.now)
        metrics.partitions = PartitionGauges(member=True)
        probes.metrics, probes.pool_contexts, probes.warm_contexts = metrics, 2, 2
        assert _get(server, "/readyz")[0] == 200
        clock.now += 61.0
        status, body = _get(server, "/healthz")
        assert status == 503
        assert "stalled" in json.loads(body)["checks"]["loop"]["detail"]
        assert _get(server, "/readyz")[0] == 503
        assert _get(server, "/nope")[0] == 404


def test_a_stopped_partition_makes_the_worker_not_ready_and_is_named_by_readyz_and_a_metric() -> None:
    """Issue #31: a partition stopped by a delivery no retry fixes (its topic deleted or not writable) left
    /readyz at 200. It is now a failed check naming the partition, and a labelled series the
    TriagePartitionBlocked alert names it by."""
    clock = _Clock()
    probes = WorkerProbes(60.0, HealthyBroker(), clock)  # type: ignore[arg-type]
    metrics = PipelineMetrics(loop_turned_at=clock.now)
    metrics.partitions = PartitionGauges(assigned=(("in", 0), ("in", 1)), blocked=(("in", 1),), member=True)
    probes.metrics, probes.pool_contexts, probes.warm_contexts = metrics, 2, 2
    with _serve(probes) as server:
        status, body = _get(server, "/readyz")
        _, text = _get(server, "/metrics")
    check = json.loads(body)["checks"]["partitions"]
    assert status == 503 and not check["ok"] and "in[1]" in check["detail"]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("triage_partition_blocked", (("partition", "1"), ("topic", "in")))] == 1
    assert ("triage_partition_blocked", (("partition", "0"), ("topic", "in"))) not in samples
    assert samples[("triage_blocked_partitions", ())] == 1


def test_metrics_settings_come_from_env_and_a_taken_port_is_one_line() -> None:
    settings = load_settings(
        env={"TRIAGE_METRICS__PORT": "9400", "TRIAGE_METRICS__STALL_TIMEOUT_MS": "30000"}
    )
    assert settings.metrics == MetricsSettings(port=9400, stall_timeout_ms=30000)
    assert load_settings(env={}).metrics.port is None  # off unless asked
    with pytest.raises(UserError, match=r"metrics\.port: expected int <= 65535"):
        load_settings(env={"TRIAGE_METRICS__PORT": "70000"})
    probes = WorkerProbes(60.0, HealthyBroker(), _Clock())  # type: ignore[arg-type]
    with _serve(probes) as first, pytest.raises(UserError, match=r"cannot serve metrics on 127\.0\.0\.1:"):
        TelemetryServer(MetricsSettings(port=first.port, host="127.0.0.1"), new_registry(), probes)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def test_every_known_label_value_is_exported_at_zero_before_it_happens() -> None:
    probes = WorkerProbes(60.0, HealthyBroker(), _Clock())  # type: ignore[arg-type]
    probes.metrics = PipelineMetrics()
    probes.metrics.dead_letter("invalid_json")
    probes.metrics.shadow = ShadowMetrics()
    probes.metrics.queue = QueueMetrics()
    registry = CollectorRegistry()
    registry.register(PipelineCollector(probes, {}))
    samples = _samples(registry)

    def by(name: str, label: str) -> dict[str, float]:
        return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}

    assert by("triage_fallbacks_total", "reason") == dict.fromkeys(
        ["deadline_exceeded", "expired_on_arrival", "invalid_output", "model_error", "overloaded"], 0
    )
    dead = by("triage_dead_letters_total", "error_type")
    assert dead["invalid_json"] == 1 and dead["empty_ticket"] == 0 and dead["internal_error"] == 0
    assert set(dead) == {
        *typing.get_args(DecodeErrorType),
        "internal_error",
        "key_too_large",
        "result_refused",
        "delivery_count_exceeded",
    }
    assert by("triage_reloads_total", "outcome") == {"succeeded": 0, "failed": 0}
    assert by("triage_shadow_dropped_total", "reason") == {"full": 0, "shutdown": 0}
    assert by("triage_queue_acknowledgements_total", "type") == {"accept": 0, "reject": 0, "release": 0}
    assert set(by("triage_shadow_fallbacks_total", "reason")) == set(typing.get_args(FallbackReason))

    class _Inner:
        def planned(self, plan: object) -> None: ...

        def settled(self, report: object) -> None: ...

    replay = CollectorRegistry()
    replay.register(ReplayMetrics(_Inner()))
    outcomes = {
        dict(labels)["outcome"]: v for (n, labels), v in _samples(replay).items() if n.endswith("_total")
    }
    assert outcomes == dict.fromkeys([outcome.value for outcome in ReplayOutcome], 0)


def test_latency_buckets_have_the_default_and_the_configured_deadline_as_bounds() -> None:
    assert 2.0 in LATENCY_BUCKETS_S  # the default deadline_ms, and the latency alert's threshold
    metrics = PipelineMetrics.for_deadline(1.5)
    for histogram in (metrics.end_to_end, metrics.model_latency, metrics.queue_wait):
        assert 1.5 in histogram.bounds and list(histogram.bounds) == sorted(histogram.bounds)
    metrics.end_to_end.observe(1.5)
    metrics.end_to_end.observe(1.6)
    probes = WorkerProbes(60.0, HealthyBroker(), _Clock())  # type: ignore[arg-type]
    probes.metrics = metrics
    registry = CollectorRegistry()
    registry.register(PipelineCollector(probes, {}))
    samples = _samples(registry)
    assert samples[("triage_end_to_end_latency_seconds_bucket", (("le", "1.5"),))] == 1
    assert samples[("triage_end_to_end_latency_seconds_bucket", (("le", "2.0"),))] == 2
    assert PipelineMetrics.for_deadline(2.0).end_to_end.bounds == LATENCY_BUCKETS_S


def test_shadow_disagreement_is_exported_per_primary_intent_only() -> None:
    shadow = ShadowMetrics()
    for primary, other in [("a", "x"), ("a", "y"), ("a", "y"), ("b", "x")]:
        shadow.compared(primary, other)
    shadow.compared("b", "b")
    probes = WorkerProbes(60.0, HealthyBroker(), _Clock())  # type: ignore[arg-type]
    probes.metrics = PipelineMetrics(shadow=shadow)
    registry = CollectorRegistry()
    registry.register(PipelineCollector(probes, {}))
    disagreed = {
        labels: v for (n, labels), v in _samples(registry).items() if n == "triage_shadow_disagreed_total"
    }
    assert disagreed == {(("primary_intent", "a"),): 3, (("primary_intent", "b"),): 1}
    assert shadow.snapshot()["top_disagreements"]["a->y"] == 2  # the pairs stay in the log event


def test_model_processes_are_exported_per_context_with_cpu_and_memory() -> None:
    # A process that has used 0.3 s of CPU (however long that takes on a loaded machine), then idles.
    burn = "import time\nwhile time.process_time() < 0.3: pass\nprint('burnt', flush=True)\ntime.sleep(60)"
    busy = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout is not None and busy.stdout.readline() == "burnt\n"
        collector = ModelProcessCollector()
        collector.pools["primary"] = lambda: [busy.pid, os.getpid()]
        collector.pools["shadow"] = lambda: [999_999_999]  # gone: no series, no error
        registry = CollectorRegistry()
        registry.register(collector)
        samples = _samples(registry)
    finally:
        busy.kill()
        busy.wait()
    cpu = {
        dict(labels)["context"]: v
        for (n, labels), v in samples.items()
        if n == "triage_model_process_cpu_seconds_total"
    }
    rss = {
        dict(labels)["context"]: v
        for (n, labels), v in samples.items()
        if n == "triage_model_process_resident_memory_bytes"
    }
    assert set(cpu) == set(rss) == {"0", "1"}
    assert cpu["0"] >= 0.29 and rss["0"] > 1_000_000  # clock ticks of 10 ms
    assert all(
        dict(labels)["pool"] == "primary" for (n, labels) in samples if n.startswith("triage_model_process")
    )


TOKEN = "s3cret-reload-token-for-the-units"


def _token_file(tmp_path: Path, content: str | bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "reload-token"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def test_the_reload_token_is_read_from_its_file_and_only_a_fit_file_is_taken(tmp_path: Path) -> None:
    path = _token_file(tmp_path, TOKEN + "\n", mode=0o440)  # echo's newline; a Secret's defaultMode 0440
    access = ReloadAccess.configured(MetricsSettings(reload_token_file=str(path)))
    assert not access.closed and access.refusal(f"Bearer {TOKEN}") is None
    unfit: list[tuple[str | bytes | None, int, str]] = [
        (None, 0o600, "cannot be read: No such file or directory"),
        ("", 0o600, "is empty"),
        ("\n \n", 0o600, "is empty"),
        ("short-token", 0o600, "fewer than 16 characters"),
        ("two halves of " + TOKEN, 0o600, "holds a space"),
        (TOKEN + "\n" + TOKEN, 0o600, "a line break"),
        ("x" * 5000, 0o600, "larger than 4096 bytes"),
        (TOKEN, 0o644, "can be read or written by any user (mode 0644)"),
        (TOKEN, 0o602, "can be read or written by any user (mode 0602)"),
    ]
    for content, mode, problem in unfit:
        path.unlink(missing_ok=True)
        if content is not None:
            _token_file(tmp_path, content, mode)
        with pytest.raises(UserError) as raised:
            ReloadAccess.configured(MetricsSettings(reload_token_file=str(path)))
        message = str(raised.value)
        assert message.startswith(f"config error: metrics.reload_token_file: {path} ") and problem in message
        assert "\n" not in message and TOKEN not in message and "short-token" not in message
    for not_a_file in (str(tmp_path), "/dev/zero"):  # /dev/zero must not be read without end
        with pytest.raises(UserError, match="is not a regular file"):
            ReloadAccess.configured(MetricsSettings(reload_token_file=not_a_file))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "TRIAGE_"))}
    command = [sys.executable, "-m", "worker", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_an_unfit_token_file_stops_run_at_start_and_config_show_prints_only_its_path(tmp_path: Path) -> None:
    path = _token_file(tmp_path, TOKEN, mode=0o644)
    # Port 9 answers nothing: the token file is checked before the broker (and before the model loads).
    result = _cli("run", "--bootstrap-servers", "127.0.0.1:9", "--reload-token-file", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"triage-worker: error: config error: metrics.reload_token_file: {path} can be read or written by "
        f"any user (mode 0644); chmod o-rw {path}"
    )
    assert "Traceback" not in result.stderr and TOKEN not in result.stdout + result.stderr
    path.chmod(0o600)
    shown = _cli("config", "show", "--set", f"metrics.reload_token_file={path}")
    assert shown.returncode == 0, shown.stderr
    assert f"reload_token_file = {json.dumps(str(path))}" in shown.stdout and TOKEN not in shown.stdout


def _connect(server: TelemetryServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def _seconds_until_closed(connection: socket.socket, limit_s: float) -> float:
    """How long until the server closed `connection` (end of file or a reset), reading what it sends; fails
    when it is still open after `limit_s`."""
    started = time.monotonic()
    connection.settimeout(limit_s)
    try:
        while connection.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server still holds the connection open after {limit_s:g} s")
    return time.monotonic() - started


def test_idle_connections_are_closed_and_one_over_the_cap_at_once_and_the_port_still_answers() -> None:
    """Clients that connect and say nothing hold a thread each: closed after the idle timeout, and never more
    of them at once than the cap, so the probes and the scrape get through once the idle ones are gone."""
    probes = WorkerProbes(60.0, HealthyBroker(), _Clock())  # type: ignore[arg-type]
    with _serve(probes) as server, capture_logs() as logs:
        assert _get(server, "/healthz")[0] == 200
        idle = [_connect(server) for _ in range(MAX_CONNECTIONS)]
        opened = time.monotonic()
        try:
            time.sleep(0.5)  # the server has taken each of them
            assert _seconds_until_closed(_connect(server), limit_s=2.0) < 2.0
            for connection in idle:
                _seconds_until_closed(connection, limit_s=IDLE_TIMEOUT_S + 3.0)
            assert time.monotonic() - opened > IDLE_TIMEOUT_S - 0.5
        finally:
            for connection in idle:
                connection.close()
        assert [log["event"] for log in logs] == ["telemetry_connection_refused"]
        assert _get(server, "/healthz")[0] == 200
        status, text = _get(server, "/metrics")
        assert status == 200 and "triage_reloads_total" in text


def test_a_client_that_trickles_its_request_is_cut_off_at_the_request_deadline() -> None:
    """A header line a second keeps every read inside the idle timeout: the request's deadline ends it."""
    probes = WorkerProbes(60.0, HealthyBroker(), _Clock())  # type: ignore[arg-type]
    with _serve(probes) as server:
        slow = _connect(server)
        started = time.monotonic()
        slow.sendall(b"GET /healthz HTTP/1.0\r\n")
        slow.settimeout(1.0)
        closed_after = None
        while closed_after is None and time.monotonic() - started < REQUEST_DEADLINE_S + 5.0:
            try:
                slow.sendall(b"X-Slow: 1\r\n")
                if slow.recv(4096) == b"":
                    closed_after = time.monotonic() - started
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed_after = time.monotonic() - started
        slow.close()
        assert closed_after is not None, "the server kept reading the trickled request"
        assert REQUEST_DEADLINE_S - 1.0 < closed_after < REQUEST_DEADLINE_S + 2.0
        assert _get(server, "/healthz")[0] == 200
