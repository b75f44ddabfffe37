"""No connection leaves a classifying worker but to its broker and its own metrics port (docs/privacy.md): the
worker, with the embedded model and its pools' processes, run for over a minute under `strace`."""

from __future__ import annotations

import collections
import ipaddress
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tools import REPO
from tools.harness import Publisher, Worker, audit, make_topics, wait_until_committed

# A release check (`make test-release`, which CI runs): what would phone home is a library, and what the
# worker's libraries do changes with the versions a release pins, not with the worker's own code.
pytestmark = [pytest.mark.kafka, pytest.mark.release]

EMBEDDED_MODEL = REPO / "models" / "triage-mini"
# Model processes by model: the embedded model's pool, and the cascade's (on for the shipped taxonomy).
MODELS = {"triage-mini": 2, "triage-encoder": 1}
# Longer than the minute asked for, and than the 40 s in which onnxruntime-genai's telemetry was measured
# to make 14 look-ups of its collector.
CLASSIFYING_S = 65.0
RATE = 20  # tickets a second

# strace -ff -k: one file per process and thread, each call on one line, then its stack a frame a line.
_ADDRESS = re.compile(r"^connect\(\d+, \{sa_family=(?P<family>\w+), (?P<address>[^}]*)\}")
_INET = re.compile(r'sin6?_port=htons\((?P<port>\d+)\).*?"(?P<host>[0-9a-fA-F.:]+)"')
_NSCD = 'sun_path="/var/run/nscd/socket"'
# librdkafka resolves the broker's address with AI_ADDRCONFIG, for which glibc asks nscd (when there is one)
# which address families the machine's interfaces have: no name is looked up (the address is numeric, checked
# below), so that connect() alone is let through, known by its caller.
_ADDRESS_FAMILIES_PROBE = "(rd_getaddrinfo+"


@dataclass
class _Connect:
    task: int  # the process or thread that called it
    call: str
    stack: list[str] = field(default_factory=list)


def _strace() -> str:
    """strace's path, or the test skips saying why it cannot run (CI installs strace: .ci/run)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace): no look at the worker's connections")
    probe = subprocess.run(
        [strace, "-f", "-k", "-e", "trace=connect", "-o", "/dev/null", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here (ptrace, or stacks): {probe.stderr.strip()[-200:]}")
    return strace


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name
        return False


def _connects(folder: Path) -> list[_Connect]:
    """Every connect() in the trace files `trace.TASK` in `folder`, with its stack."""
    found: list[_Connect] = []
    for path in folder.glob("trace.*"):
        current: _Connect | None = None
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(" > "):
                if current is not None:
                    current.stack.append(line)
                continue
            current = _Connect(int(path.suffix[1:]), line) if line.startswith("connect(") else None
            if current is not None:
                found.append(current)
    return found


def _allowed(connect: _Connect, ports: set[int]) -> bool:
    address = _ADDRESS.match(connect.call)
    if address is None:
        return False
    inet = _INET.search(address["address"])
    if address["family"] in ("AF_INET", "AF_INET6") and inet is not None:
        return _is_loopback_address(inet["host"]) and int(inet["port"]) in ports
    return address["address"].startswith(_NSCD) and any(_ADDRESS_FAMILIES_PROBE in f for f in connect.stack)


def test_a_classifying_worker_connects_to_nothing_but_its_broker_and_its_metrics_port(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """onnxruntime and onnxruntime-genai send telemetry to a vendor collector unless told not to: the worker
    tells them itself, in every process that loads a model, whatever its environment says. A name look-up (a
    connect() to a resolver's port 53, or to nscd's socket for one) fails this as any other address does."""
    strace = _strace()
    broker_host, broker_port = kafka_bootstrap.rsplit(":", 1)
    if not _is_loopback_address(broker_host):
        pytest.skip(f"the session's broker is at {broker_host}, not a loopback address (its look-up counts)")
    # Not inherited from this test's process (whose imports of worker.inference set it): the worker's own.
    monkeypatch.delenv("ORT_DISABLE_TELEMETRY", raising=False)
    topics = make_topics(unique_topic)
    group = f"triage-test-{uuid.uuid4().hex[:8]}"
    traces = tmp_path / "traces"
    traces.mkdir()
    worker = Worker(
        kafka_bootstrap,
        topics,
        group,
        tmp_path,
        settings={"inference.pool_size": str(MODELS[EMBEDDED_MODEL.name])},
        args=("--metrics-port", "0", "--metrics-host", "127.0.0.1"),
        model=EMBEDDED_MODEL,
        tracer=(strace, "-ff", "-k", "-e", "trace=connect", "-o", str(traces / "trace"), "--"),
    )
    publisher = Publisher(kafka_bootstrap, topics, count=0, rate=RATE, seed=43)
    try:
        metrics_port = int(worker.wait_for("telemetry_listening", timeout=180)["port"])
        worker.wait_for("pipeline_started", timeout=180)
        publisher.start()
        time.sleep(CLASSIFYING_S)
        publisher.end()
        publisher.finish(timeout=60)
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=180, worker=worker)
        model_processes = {int(e["pid"]): e["model"] for e in worker.events("classifier worker ready")}
        assert worker.stop() == 0
    finally:
        worker.kill()

    report = audit(kafka_bootstrap, topics)
    classified = [r for records in report.results.values() for r in records if not r.fallback]
    assert report.lost == [] and len(classified) >= CLASSIFYING_S * RATE * 0.5
    # The embedded model (ORT GenAI) and, for the tickets it is unsure of, the cascade's encoder stage (plain
    # onnxruntime) answered, each from processes of its own pool, and the trace followed every one of them.
    assert {r.model.split("@")[0] for r in classified} == set(MODELS)
    assert collections.Counter(model_processes.values()) == MODELS
    traced = {int(path.suffix[1:]) for path in traces.glob("trace.*")}
    assert set(model_processes) <= traced
    connects = _connects(traces)
    disallowed = [c for c in connects if not _allowed(c, {int(broker_port), metrics_port})]
    assert disallowed == [], f"{len(disallowed)} connect() calls elsewhere:\n" + "\n".join(
        f"task {c.task}: {c.call}\n" + "\n".join(c.stack[:12]) for c in disallowed[:10]
    )
    assert any(f"htons({broker_port})" in c.call for c in connects), "the trace saw no broker connection"
