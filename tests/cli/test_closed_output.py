"""Every command survives the reader of its output going away (`| head`): no traceback, exit 141 as a tool
that SIGPIPE ended, its children stopped, and the broker it started stopped too."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import REPO
from worker.cli.pipes import READER_GONE_EXIT
from worker.dev import local_broker

TINY = REPO / "tests" / "models" / "tiny"
CLI = shlex.join([sys.executable, "-m", "worker"])


def _piped(command: str, reader: str, tmp_path: Path) -> tuple[int, str, str, int]:
    """`triage-worker COMMAND | READER` in a bash of its own session: the command's exit code, what the
    reader printed, the command's stderr, and the session (where any child the command left would be)."""
    err_file = tmp_path / "command.err"
    script = f'{CLI} {command} 2>{shlex.quote(str(err_file))} | {reader}; echo "exit=${{PIPESTATUS[0]}}"'
    shell = subprocess.Popen(
        ["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    out, _ = shell.communicate(timeout=600)
    shown, _, code = out.rpartition("exit=")
    return int(code), shown, err_file.read_text(errors="replace"), shell.pid


def _left_in(session: int) -> list[int]:
    """Processes still alive in `session` a few seconds after it ended (children a command left behind)."""
    deadline = time.monotonic() + 10
    while True:
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                members.append(int(stat.parent.name))
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.5)


@pytest.mark.parametrize(
    "command",
    [
        "--help",
        "config show",
        "schemas --check",
        "broker status --state-dir {tmp}",
        f"classify 'where is my card?' --model {TINY}",
    ],
    ids=lambda command: command.split(" --", 1)[0] or command,
)
def test_a_command_whose_reader_is_gone_exits_141_without_a_traceback(command: str, tmp_path: Path) -> None:
    code, _, err, session = _piped(command.format(tmp=tmp_path), "head -n 0", tmp_path)
    assert (code, err) == (READER_GONE_EXIT, "")
    assert _left_in(session) == []


def test_classify_streaming_into_head_stops_its_model_processes(tmp_path: Path) -> None:
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_text(
        "".join(
            json.dumps({"ticket_id": f"t{i}", "body": f"where is my card {i}?"}) + "\n" for i in range(5000)
        )
    )
    code, shown, err, session = _piped(
        f"classify --input {tickets} --model {TINY} --set inference.pool=process --set inference.pool_size=2",
        "head -n 3",
        tmp_path,
    )
    assert len(shown.splitlines()) == 3
    assert code == READER_GONE_EXIT and "Traceback" not in err, err
    assert _left_in(session) == []  # no model process outlived the command


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="the demo's local broker needs Java 17+")
def test_demo_into_head_stops_its_worker_and_its_broker_and_the_next_fresh_start_works(
    tmp_path: Path,
) -> None:
    """`demo | head -n 8` (and `make run | tee log` + Ctrl-C) left the broker's JVM running, adopted by PID 1,
    so the tour's next `broker start --fresh` was refused."""
    state = tmp_path / "broker"
    port = local_broker.free_port()
    demo = (
        f"demo --state-dir {state} --port {port} --model {TINY} --rate 20 "
        "--set inference.escalation=off --set inference.pool_size=1"
    )
    try:
        code, shown, err, _ = _piped(demo, "head -n 8", tmp_path)
        assert not local_broker.LocalBroker(state).status().running, "the broker the demo started runs on"
        worker = re.search(r"^worker pid (\d+)", shown, flags=re.MULTILINE)
        assert worker is not None, shown
        assert not Path(f"/proc/{worker[1]}").exists()  # the demo's worker was stopped
        assert code == READER_GONE_EXIT and "Traceback" not in err, err

        start = f"broker start --fresh --state-dir {state} --port {port}"
        code, shown, err, _ = _piped(start, "head -n 1", tmp_path)
        assert code in (0, READER_GONE_EXIT) and "Traceback" not in err, err
        assert "broker ready" in shown
        assert local_broker.LocalBroker(state).status().running  # `broker start` keeps what it started
    finally:
        local_broker.LocalBroker(state).stop()
