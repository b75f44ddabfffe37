"""`triage-worker demo` (what `make run` calls) on a laptop that already runs something on Kafka's port."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.kafka import local_broker
from worker.ops.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "models" / "tiny"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something listens on, as another Kafka would."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="the demo's local broker needs Java 17+")
def test_demo_starts_its_broker_on_a_free_port_when_the_usual_one_is_taken(
    taken_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 9092 on a user's laptop; here any port that is really taken stands for it, so that the test never
    # touches a Kafka another program runs on this machine.
    monkeypatch.setattr(local_broker, "DEFAULT_PORT", taken_port)
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    state = tmp_path / "broker"
    code = main(
        [
            *("demo", "--state-dir", str(state), "--model", str(TINY)),
            *("--count", "6", "--rate", "20", "--linger", "60", "--malformed-ratio", "0"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    moved = re.search(rf"port {taken_port} is taken \(another Kafka\?\); using port (\d+)", out)
    assert moved, out[:2000]
    assert f"starting the local Kafka broker on port {moved[1]}" in out
    assert re.search(r"results 6 ", out), out[-2000:]
    assert not local_broker.LocalBroker(state).status().running  # it stopped the broker it started


def test_demo_with_a_taken_port_says_so_in_one_line(
    taken_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    assert main(["demo", "--state-dir", str(tmp_path), "--port", str(taken_port)]) == 2
    assert f"port {taken_port} on 127.0.0.1 is already in use" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_passes_its_port_to_the_demo() -> None:
    def planned(*args: str) -> str:
        dry = subprocess.run(
            ["make", "-n", "run", *args], cwd=REPO, capture_output=True, text=True, check=True
        )
        return next(line for line in dry.stdout.splitlines() if "triage-worker demo" in line)

    assert "demo --port 9093" in planned("PORT=9093")
    assert "--port" not in planned()  # the demo's own choice: 9092, or a free port when it is taken
