"""The worker's /metrics, /healthz and /readyz, scraped from a running worker against the real broker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools import REPO
from tools.harness import Worker, audit, make_topics, publish, wait_until_committed
from worker.dev.local_broker import LocalBroker
from worker.kafka.dead_letters import dead_letter_headers

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    status, body = _get(port, path)
    return status, json.loads(body)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    status, text = _get(port, "/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    """Sum of a metric over all its label sets."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


def _settled(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], count: int) -> bool:
    return samples[("triage_committed_total", ())] >= count and total(samples, "triage_consumer_lag") == 0


def _start(
    bootstrap: str, topics: Any, tmp_path: Path, group: str = "", slow_model_s: float = 0.0
) -> tuple[Worker, int]:
    worker = Worker(
        bootstrap,
        topics,
        group or f"triage-test-{uuid.uuid4().hex[:8]}",
        tmp_path,
        args=("--metrics-port", "0", "--metrics-host", "127.0.0.1"),
        slow_model_s=slow_model_s,
    )
    port = int(worker.wait_for("telemetry_listening", timeout=60)["port"])
    return worker, port


def test_scraped_counters_account_for_every_record(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = make_topics(unique_topic)
    count = 300
    publish(kafka_bootstrap, topics, count, malformed_ratio=0.1, seed=31)
    group = f"triage-test-{uuid.uuid4().hex[:8]}"
    worker, port = _start(kafka_bootstrap, topics, tmp_path, group)
    try:
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=180, worker=worker)
        # The commit callback that releases the last offsets may land just after the broker has them, and
        # partition gauges (lag) are copied about once a second: both settle within moments.
        deadline = time.monotonic() + 10
        while not _settled(samples := scrape(port), count) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert worker.stop() == 0
    finally:
        worker.kill()

    report = audit(kafka_bootstrap, topics)
    results = sum(map(len, report.results.values()))
    dead_letters = sum(map(len, report.dead.values()))
    assert report.lost == [] and report.duplicates == 0
    consumed = samples[("triage_consumed_total", ())]
    assert consumed == count == results + dead_letters
    fallbacks = total(samples, "triage_fallbacks_total")
    assert samples[("triage_classified_total", ())] + fallbacks == results
    assert fallbacks == sum(1 for records in report.results.values() for r in records if r.fallback)
    # Dead letters by error type match the error types written to the dead-letter topic.
    by_type: dict[str, int] = {}
    for types in report.dead.values():
        for error_type in types:
            by_type[error_type] = by_type.get(error_type, 0) + 1
    scraped_types = {
        dict(labels)["error_type"]: value
        for (name, labels), value in samples.items()
        if name == "triage_dead_letters_total"
    }
    # Every known type is exported, at 0 until it happens.
    assert {t: v for t, v in scraped_types.items() if v} == by_type and len(by_type) >= 3
    assert set(scraped_types) > set(by_type)
    assert samples[("triage_produced_total", ())] == count
    assert samples[("triage_committed_total", ())] == count
    # Every acknowledged record was timed end to end; every classified ticket went through the model.
    assert samples[("triage_end_to_end_latency_seconds_count", ())] == count
    assert samples[("triage_model_latency_seconds_count", ())] >= samples[("triage_classified_total", ())]
    assert samples[("triage_end_to_end_latency_seconds_bucket", (("le", "+Inf"),))] == count
    assert samples[("triage_in_flight", ())] == 0
    assert samples[("triage_assigned_partitions", ())] == 3
    lags = {dict(labels)["partition"]: v for (n, labels), v in samples.items() if n == "triage_consumer_lag"}
    assert lags == {"0": 0, "1": 0, "2": 0}
    info = next(dict(labels) for (name, labels), _ in samples.items() if name == "triage_worker_info")
    assert info["model"] and info["mode"] == "score" and info["provider"] == "cpu"


def test_a_fresh_worker_exports_what_on_call_needs_before_the_first_ticket(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """Known label values at 0, the configured deadline as a bucket bound, and CPU and memory of each model
    process, scraped from a worker that has seen no ticket yet."""
    topics = make_topics(unique_topic)
    worker = Worker(
        kafka_bootstrap,
        topics,
        f"triage-test-{uuid.uuid4().hex[:8]}",
        tmp_path,
        args=("--metrics-port", "0", "--metrics-host", "127.0.0.1", "--deadline-ms", "1500"),
        settings={"inference.pool": "process", "inference.pool_size": "2"},
    )
    try:
        port = int(worker.wait_for("telemetry_listening", timeout=60)["port"])
        _wait_status(port, "/readyz", 200, timeout=90)
        samples = scrape(port)
        assert worker.stop() == 0
    finally:
        worker.kill()

    def by(name: str, label: str) -> dict[str, float]:
        return {dict(labels)[label]: value for (n, labels), value in samples.items() if n == name}

    assert by("triage_fallbacks_total", "reason") == dict.fromkeys(
        ["deadline_exceeded", "expired_on_arrival", "invalid_output", "model_error", "overloaded"], 0.0
    )
    dead = by("triage_dead_letters_total", "error_type")
    assert {"invalid_json", "empty_ticket", "internal_error", "key_too_large"} <= set(dead)
    assert set(dead.values()) == {0.0}
    assert by("triage_reloads_total", "outcome") == {"failed": 0.0, "succeeded": 0.0}
    for histogram in ("end_to_end_latency", "model_latency", "queue_wait"):
        bounds = set(by(f"triage_{histogram}_seconds_bucket", "le"))
        assert {"1.5", "2.0"} <= bounds, (histogram, bounds)  # the configured and the default deadline
    cpu = by("triage_model_process_cpu_seconds_total", "context")
    rss = by("triage_model_process_resident_memory_bytes", "context")
    assert set(cpu) == set(rss) == {"0", "1"}
    # Each model process loaded the model and answered its warm-up ticket: it has used CPU and memory.
    assert all(value > 0 for value in cpu.values()) and all(value > 20e6 for value in rss.values()), (
        cpu,
        rss,
    )


def test_readiness_follows_pool_warm_up_and_group_join_and_liveness_holds(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = make_topics(unique_topic)
    # The warm-up request sleeps this long too: a slow model load, seen from outside.
    worker, port = _start(kafka_bootstrap, topics, tmp_path, slow_model_s=3.0)
    try:
        status, body = _probe(port, "/readyz")
        assert status == 503, body
        assert body["checks"]["pool"] == {"ok": False, "detail": "warming up"}
        assert body["checks"]["group"]["ok"] is False
        # A loading worker is alive: restarting it would only start the load again.
        assert _probe(port, "/healthz")[0] == 200
        seen_ready = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and seen_ready is None:
            status, body = _probe(port, "/readyz")
            if status == 200:
                seen_ready = body
            time.sleep(0.1)
        assert seen_ready is not None, body
        assert seen_ready["checks"]["broker"]["ok"] and seen_ready["checks"]["group"]["ok"]
        assert worker.events("classifier pool ready"), "ready before the pool was warm"
        status, body = _probe(port, "/healthz")
        assert status == 200 and body["checks"]["loop"]["ok"]
        assert worker.stop() == 0
    finally:
        worker.kill()


def test_readiness_fails_while_the_broker_is_down(
    local_kafka_broker: LocalBroker, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = make_topics(unique_topic)
    worker, port = _start(local_kafka_broker.bootstrap, topics, tmp_path)
    try:
        _wait_status(port, "/readyz", 200, timeout=60)
        local_kafka_broker.stop()
        try:
            # The group check may fail first (the coordinator is gone); the broker check follows within
            # one probe interval plus its timeout.
            status, body = _wait_until(port, "/readyz", lambda body: not body["checks"]["broker"]["ok"], 30)
            assert status == 503
            assert body["checks"]["broker"]["detail"].startswith("unreachable")
            # The loop keeps turning without a broker: alive, so Kubernetes must not restart it.
            assert _probe(port, "/healthz")[0] == 200
        finally:
            local_kafka_broker.start(fresh=False, echo=lambda _line: None)
        _wait_status(port, "/readyz", 200, timeout=90)
        assert worker.stop() == 0
    finally:
        worker.kill()


def _wait_until(
    port: int, path: str, predicate: Callable[[dict[str, Any]], bool], timeout: float
) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    status, body = _probe(port, path)
    while not predicate(body) and time.monotonic() < deadline:
        time.sleep(0.2)
        status, body = _probe(port, path)
    assert predicate(body), body
    return status, body


def _wait_status(port: int, path: str, wanted: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    status, body = _probe(port, path)
    while status != wanted and time.monotonic() < deadline:
        time.sleep(0.2)
        status, body = _probe(port, path)
    assert status == wanted, body
    return body


def test_replay_serves_its_progress_while_it_runs(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    for index in range(40):
        # The client's header type takes str values too (and list is invariant).
        headers: list[tuple[str, str | bytes | None]] = [
            *dead_letter_headers([], "invalid_json", "bad", source, 0, index)
        ]
        producer.produce(dlq, value=f"v{index}".encode(), partition=0, headers=headers)
    assert producer.flush(30) == 0
    command = [
        sys.executable, "-m", "worker", "replay", "--dlq", dlq, "--from-beginning", "--json",
        "--set", f"kafka.bootstrap.servers={kafka_bootstrap}", "--rate", "10/s",
        "--metrics-port", "0", "--set", "metrics.host=127.0.0.1",
    ]  # fmt: skip
    replay = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert replay.stderr is not None
        # librdkafka may print connection noise first; the endpoint's line names the port.
        while not (line := replay.stderr.readline()).startswith("replay metrics on"):
            assert line, "replay exited before serving metrics"
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        deadline = time.monotonic() + 30
        while (samples := scrape(port)).get(
            ("triage_replay_records_total", (("outcome", "replayed"),)), 0
        ) < 5:
            assert time.monotonic() < deadline, samples
            time.sleep(0.2)
        assert samples[("triage_replay_planned_records", ())] == 40
        # Rate-limited to 10/s: well before the end, the count is short of the plan.
        assert samples[("triage_replay_records_total", (("outcome", "replayed"),))] < 40
        out, _ = replay.communicate(timeout=60)
    finally:
        replay.kill()
    assert replay.returncode == 0
    assert json.loads(out)["counts"]["replayed"] == 40
