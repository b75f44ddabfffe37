"""The project's local broker: survives a restart on the same data, and fails clearly when it cannot run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from tools import REPO
from worker.cli.cli import main
from worker.dev import local_broker
from worker.errors import UserError
from worker.kafka.admin import TopicSpec, create_topics


@pytest.mark.kafka
def test_restart_on_the_same_log_dir_keeps_topics_and_records(
    local_kafka_broker: local_broker.LocalBroker,
) -> None:
    config = {"bootstrap.servers": local_kafka_broker.bootstrap}
    topic = f"test.restart.{uuid.uuid4().hex[:8]}"
    create_topics(config, [TopicSpec(topic, 1, 1)])
    producer = Producer(config)
    producer.produce(topic, key=b"k", value=b"before restart")
    assert producer.flush(15) == 0

    assert local_kafka_broker.stop()
    assert not local_kafka_broker.status().running
    local_kafka_broker.start(fresh=False, echo=lambda _line: None)
    assert local_kafka_broker.status().running

    consumer = Consumer({**config, "group.id": f"test-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + 30
        message = None
        while message is None and time.monotonic() < deadline:
            message = consumer.poll(0.5)
    finally:
        consumer.close()
    assert message is not None and message.error() is None
    assert (message.key(), message.value()) == (b"k", b"before restart")


def test_missing_java_is_named_with_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(UserError, match=r"`java` was not found on PATH.*install a Java 17\+ runtime"):
        local_broker.require_java()


def test_missing_maven_is_named_when_jars_are_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(UserError, match=r"`mvn` was not found on PATH.*install Apache Maven"):
        local_broker.fetch_jars(tmp_path / "kafka-home", echo=lambda _line: None)


def test_start_refuses_a_port_that_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        with pytest.raises(UserError, match=f"port {port} .* already in use"):
            local_broker.LocalBroker(tmp_path / "state", port).start()


def test_status_command_reports_a_stopped_broker_and_its_log_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["broker", "status", "--state-dir", str(tmp_path)]) == 3

    out = capsys.readouterr().out
    assert "not running" in out
    assert str(tmp_path / "logs" / "server.log") in out


def test_each_checkout_has_a_broker_state_folder_of_its_own(tmp_path: Path) -> None:
    """All checkouts shared ~/.cache/triage-worker/broker, so one checkout's `broker start --fresh` wiped the
    topics of the broker another one ran."""
    other_checkout = tmp_path / "other-checkout"
    shutil.copytree(REPO / "worker", other_checkout / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def log_file_of(checkout: Path) -> Path:
        done = subprocess.run(
            [sys.executable, "-m", "worker", "broker", "status"],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 3, done.stderr  # not running
        return Path(done.stdout.split("log file:")[1].strip())

    mine, theirs = log_file_of(REPO), log_file_of(other_checkout)
    assert mine != theirs
    for state_dir, checkout in ((mine.parents[1], REPO), (theirs.parents[1], other_checkout)):
        assert state_dir.parent == tmp_path / "cache" / "triage-worker" / "broker"
        assert state_dir.name.startswith(f"{checkout.name}-")
