"""`triage-worker demo` (what `make run` calls) on a laptop that already runs something on Kafka's port."""

from __future__ import annotations

import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools import REPO
from worker.cli.cli import main
from worker.cli.pipes import READER_GONE_EXIT
from worker.dev import local_broker

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


def _worker_pid(lines: Iterator[str]) -> int:
    """The demo's worker, once it has answered a first ticket (the demo is then fully running)."""
    pid = None
    for line in lines:
        found = re.match(r"worker pid (\d+)", line)
        if found:
            pid = int(found[1])
        elif pid is not None and re.match(r"  S[0-9a-f]{6}-\d{7} ", line):  # a sample ticket's result
            return pid
    raise AssertionError("the demo ended before its worker answered")


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("terminal_closed", [False, True], ids=["SIGTERM", "SIGHUP-terminal-closed"])
def test_a_demo_ended_by_a_signal_stops_its_worker(
    kafka_bootstrap: str, tmp_path: Path, terminal_closed: bool
) -> None:
    """SIGTERM (a supervisor, `timeout`) and SIGHUP (the terminal of `make run` closed) killed the demo on the
    spot, its worker (and a broker it started) running on; now they end it as Ctrl-C does."""
    run = uuid.uuid4().hex[:8]
    topics = {"input": f"demo.in.{run}", "output": f"demo.out.{run}", "dead_letter": f"demo.dlq.{run}"}
    command = [
        *(
            sys.executable,
            "-m",
            "worker",
            "demo",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--model",
            str(TINY),
        ),
        *("--state-dir", str(tmp_path), "--rate", "20", "--malformed-ratio", "0"),
        *("--set", "inference.escalation=off", "--set", "inference.pool_size=1"),
        *("--set", f"pipeline.group_id=demo-{run}"),
        *(f"--set=topics.{key}={name}" for key, name in topics.items()),
    ]
    terminal, output = pty.openpty() if terminal_closed else (None, subprocess.PIPE)
    demo = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        if terminal is None:
            assert demo.stdout is not None
            worker = _worker_pid(demo.stdout)
            demo.send_signal(signal.SIGTERM)
        else:
            assert isinstance(output, int)
            os.close(output)
            with open(terminal, encoding="utf-8", errors="replace", closefd=False) as screen:
                worker = _worker_pid(screen)
            os.close(terminal)  # the terminal window goes away, and its session gets SIGHUP
            demo.send_signal(signal.SIGHUP)
        _, err = demo.communicate(timeout=180)
        assert "Traceback" not in err, err
        if terminal_closed:
            # The terminal gone, what the demo printed on the way found nobody (141) - or, where the kernel
            # did not refuse its write to the closed terminal, it ended as usual
            # (0): a CI run saw both. Either way it ended on its own, cleanly, its worker stopped.
            assert demo.returncode in (READER_GONE_EXIT, 0), err
        else:
            assert demo.returncode == 0, err  # the demo's usual end
        assert not Path(f"/proc/{worker}").exists()  # its worker stopped with it
    finally:
        demo.kill()
        demo.wait()
        if worker is not None and Path(f"/proc/{worker}").exists():
            os.kill(worker, signal.SIGKILL)
