"""What a running worker and the lag exporter log while the broker is away (issue #31): the session's broker
stopped for 20 s under both, every line they write meanwhile counted (`pytest -s` prints the counts). Before,
librdkafka's reconnect attempts came out one line each: 455 client lines from the worker (structured, but one
per attempt every ~50 ms) and raw `%3|...` lines from the exporter; now 14 and 4 structured ones."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tools import REPO
from tools.harness import Worker, make_topics
from worker.dev.local_broker import LocalBroker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

OUTAGE_S = 20.0
# A busy Prometheus: each scrape makes the exporter try the broker again.
SCRAPE_EVERY_S = 2.0
# What the clients' lines may add up to in the outage: each cause once per interval (3 intervals in 20 s),
# for the dozen causes an outage gives (connection refused, disconnected, session timed out, transport
# failure, all brokers down, ...; each at its level, from the worker's clients and its readiness probe).
WORKER_LINES_AT_MOST = 40
EXPORTER_LINES_AT_MOST = 15
_CLIENT_EVENTS = ("librdkafka", "kafka_client_error")


def _exporter_port(log: Path, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"the lag exporter did not start:\n{log.read_text(errors='replace')}")


def _scrape(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


def _lines_since(path: Path, offset: int) -> list[str]:
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace").splitlines()


def _client_events(lines: list[str]) -> list[dict[str, Any]]:
    """The Kafka clients' structured lines among `lines`."""
    events = (json.loads(line) for line in lines if line.startswith("{"))
    return [event for event in events if event["event"] in _CLIENT_EVENTS]


def _unstructured(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith("{")]


def test_a_broker_outage_is_a_few_structured_lines_per_cause_from_the_worker_and_the_lag_exporter(
    local_kafka_broker: LocalBroker, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    bootstrap = local_kafka_broker.bootstrap
    topics = make_topics(unique_topic)
    group = f"triage-test-{uuid.uuid4().hex[:8]}"
    # With a metrics port: the readiness probe's own client is one more that sees the outage.
    worker = Worker(
        bootstrap, topics, group, tmp_path, args=("--metrics-port", "0", "--metrics-host", "127.0.0.1")
    )
    exporter_log = tmp_path / "lag-exporter.log"
    with exporter_log.open("wb") as output:
        command = [
            sys.executable, "-m", "worker", "lag-exporter", "--bootstrap-servers", bootstrap,
            "--group", group, "--topic", topics.input, "--port", "0", "--host", "127.0.0.1",
            "--set", "log.format=json",
        ]  # fmt: skip
        exporter = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    try:
        worker.wait_for("partitions_assigned", timeout=90)
        port = _exporter_port(exporter_log)
        assert _scrape(port) == 200
        worker_mark, exporter_mark = worker.log_path.stat().st_size, exporter_log.stat().st_size
        local_kafka_broker.stop()
        try:
            stopped = time.monotonic()
            while time.monotonic() - stopped < OUTAGE_S:
                _scrape(port)
                time.sleep(SCRAPE_EVERY_S)
            worker_lines = _lines_since(worker.log_path, worker_mark)
            exporter_lines = _lines_since(exporter_log, exporter_mark)
        finally:
            local_kafka_broker.start(fresh=False, echo=lambda _line: None)
        assert worker.stop() == 0
        exporter.terminate()
        assert exporter.wait(30) == 0
    finally:
        worker.kill()
        exporter.kill()

    worker_events, exporter_events = _client_events(worker_lines), _client_events(exporter_lines)
    print(
        f"\n[outage {OUTAGE_S:.0f} s] worker: {len(worker_lines)} lines, {len(worker_events)} from its "
        f"clients {dict(Counter(e['event'] for e in worker_events))}; lag exporter: {len(exporter_lines)} "
        f"lines, {len(exporter_events)} from its client, {len(_unstructured(exporter_lines))} unstructured"
    )
    assert _unstructured(worker_lines) == []
    assert len(worker_events) <= WORKER_LINES_AT_MOST, worker_events[:5]
    assert _unstructured(exporter_lines) == []
    assert len(exporter_events) <= EXPORTER_LINES_AT_MOST, exporter_events[:5]
    # Both saw the outage, and each line that stands for others says how many.
    for events in (worker_events, exporter_events):
        assert any(e["event"] == "librdkafka" and e["facility"] == "FAIL" for e in events), events
    assert all("suppressed_since_last" in event for event in worker_events + exporter_events)
    assert sum(e["suppressed_since_last"] for e in worker_events) > 0
