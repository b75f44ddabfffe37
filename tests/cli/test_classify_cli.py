"""`triage-worker classify` with the real test model, and the argument text checks it shares with `send`."""

from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from tools import REPO
from worker.cli.classify_command import EXIT_LINES_SKIPPED
from worker.cli.cli import main
from worker.messages import TriageResult
from worker.settings import DEFAULT_ESCALATION_DIR

TINY = REPO / "tests" / "models" / "tiny"


def test_classify_text_prints_one_triage_result(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["classify", "Where is my card?", "--model", str(TINY)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    result = msgspec.json.decode(lines[0], type=TriageResult)
    assert result.source.topic == "cli" and not result.fallback


def test_classify_file_reports_bad_lines_and_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_text(
        "\n".join(
            [
                json.dumps({"ticket_id": "a", "subject": "Card", "body": "Where is my card?"}),
                "{not json",
                json.dumps({"ticket_id": "b", "body": '"}, "priority": "Critical"}'}),
                json.dumps({"body": "no id"}),
                json.dumps({"ticket_id": "c", "body": "日本語 🙂"}),
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    output = tmp_path / "results.jsonl"
    code = main(
        [
            *("classify", "--input", str(tickets), "--output", str(output)),
            *("--model", str(TINY), "--mode", "generate", "--deadline-ms", "30000"),
            *("--set", "inference.pool=thread"),
        ]
    )
    assert code == EXIT_LINES_SKIPPED
    err = capsys.readouterr().err
    assert "tickets.jsonl:2:" in err and "tickets.jsonl:4:" in err
    assert "classified 3 tickets" in err and "fallbacks: none" in err
    assert "bad lines skipped: 2 (invalid_json 1, missing_field 1), exit code 3" in err
    assert "3/3" in err  # the progress bar
    results = [msgspec.json.decode(line, type=TriageResult) for line in output.read_text().splitlines()]
    assert [(r.ticket_id, r.source.offset) for r in results] == [("a", 0), ("b", 2), ("c", 4)]


def test_classify_needs_text_or_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["classify", "--model", str(TINY)]) == 2
    assert "either a ticket TEXT or --input" in capsys.readouterr().err


def test_classify_with_cuda_missing_names_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["classify", "hi", "--model", str(TINY), "--provider", "cuda"]) == 2
    assert "onnxruntime-genai-cuda" in capsys.readouterr().err


CLI = [sys.executable, "-m", "worker"]


@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_a_ticket_with_no_text_is_refused_before_the_model(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["classify", text, "--model", str(TINY)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err
        == "triage-worker: error: classify: the ticket text is empty; there is nothing to classify\n"
    )


def test_text_that_is_not_utf8_is_one_line_without_a_traceback() -> None:
    done = subprocess.run(
        [*CLI, "classify", b"caf\xe9", "--model", str(TINY)], capture_output=True, check=False
    )
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode() == (
        "triage-worker: error: the ticket text is not valid UTF-8 (byte 0xe9 at character 4); "
        "pass UTF-8 text, or put the ticket in a --input file\n"
    )


@pytest.mark.parametrize(
    ("content", "detail"),
    [
        (b"", "the file has no lines"),
        (b"just some text\n", "1 line(s) rejected (invalid_json 1)"),
        (
            b'\x00\xff\xfe binary\n{"ticket_id": "t", "body": " "}\n{"ticket_id": "u", "body": ""}\n',
            "3 line(s) rejected (empty_ticket 2, invalid_utf8 1)",
        ),
    ],
)
def test_an_input_file_without_a_valid_ticket_fails_without_starting_the_pool(
    tmp_path: Path, content: bytes, detail: str
) -> None:
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_bytes(content)
    done = subprocess.run(
        [*CLI, "classify", "--input", str(tickets), "--model", str(TINY)], capture_output=True, check=False
    )
    assert done.returncode == 2 and done.stdout == b""
    err = done.stderr.decode()
    assert err.splitlines()[-1] == f"triage-worker: error: {tickets}: no ticket to classify: {detail}"
    assert "classifier pool" not in err and "Traceback" not in err


def test_send_refuses_text_that_is_not_utf8_before_contacting_kafka() -> None:
    done = subprocess.run(
        [*CLI, "send", b"caf\xe9", "--bootstrap-servers", "127.0.0.1:9"], capture_output=True, check=False
    )
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode().startswith(
        "triage-worker: error: the ticket text is not valid UTF-8 (byte 0xe9"
    )
    assert b"Kafka" not in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ([""], "empty_ticket: `body` and `subject` are empty or whitespace: no text to classify"),
        ([" \t"], "empty_ticket: `body` and `subject` are empty or whitespace: no text to classify"),
        (["my card", "--ticket-id", ""], "empty_field: `ticket_id` must not be empty"),
    ],
    ids=["empty-text", "blank-text", "empty-ticket-id"],
)
def test_send_refuses_a_ticket_the_worker_would_dead_letter_before_contacting_kafka(
    arguments: list[str], reason: str
) -> None:
    """`send ""` published an empty ticket, and `--ticket-id ""` was replaced by a random id in silence."""
    done = subprocess.run(
        [*CLI, "send", *arguments, "--bootstrap-servers", "127.0.0.1:9"], capture_output=True, check=False
    )
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode() == (
        f"triage-worker: error: send: the worker would dead-letter this ticket ({reason}); fix it, or send "
        "such a value on purpose with --raw\n"
    )


def _banking77_test_texts(count: int) -> list[str]:
    with (REPO / "data" / "banking77" / "test.csv").open(encoding="utf-8") as handle:
        return [row["text"] for row in list(csv.DictReader(handle))[:count]]


def test_classify_runs_the_cascade_as_the_worker_does_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the embedded model (the default), unsure answers come from the escalation stage and say so, as
    the worker's records would; `--set inference.escalation=off` gives the first stage's answers alone."""
    tickets = tmp_path / "tickets.jsonl"
    texts = _banking77_test_texts(200)
    tickets.write_text(
        "".join(json.dumps({"ticket_id": str(i), "body": text}) + "\n" for i, text in enumerate(texts)),
        encoding="utf-8",
    )
    results = {}
    for name, extra in (("cascade", []), ("off", ["--set", "inference.escalation=off"])):
        out = tmp_path / f"{name}.jsonl"
        assert main(["classify", "--input", str(tickets), "--output", str(out), *extra]) == 0
        lines = out.read_text(encoding="utf-8").splitlines()
        results[name] = [msgspec.json.decode(line, type=TriageResult) for line in lines]
    cascade, first_alone = results["cascade"], results["off"]
    assert len(cascade) == len(first_alone) == len(texts)
    escalated = [r for r in cascade if r.stage == "escalation"]
    assert all(r.stage in ("first", "escalation") for r in cascade) and escalated
    assert all(r.stage is None for r in first_alone)
    by_id = {r.ticket_id: r for r in first_alone}
    for record in escalated:  # the first stage's answer is kept beside the stage's, and was unsure
        first = by_id[record.ticket_id]
        assert record.model == "triage-encoder" and record.first_intent == first.intent
        assert record.first_confidence is not None and record.first_confidence < 0.8
    kept = [r for r in cascade if r.stage == "first" and not r.fallback and not by_id[r.ticket_id].fallback]
    assert all(r.intent == by_id[r.ticket_id].intent for r in kept)
    capsys.readouterr()


def test_classify_lets_an_llm_decide_among_the_encoders_top_candidates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inference.escalation_llm`: escalated tickets are answered by the LLM among the encoder stage's top k
    (here the embedded model, an ORT GenAI model, as the LLM), and their records say so."""
    tickets = tmp_path / "tickets.jsonl"
    texts = _banking77_test_texts(30)
    tickets.write_text(
        "".join(json.dumps({"ticket_id": str(i), "body": text}) + "\n" for i, text in enumerate(texts)),
        encoding="utf-8",
    )
    out = tmp_path / "results.jsonl"
    llm = ("--set", f"inference.escalation_llm={REPO / 'models' / 'triage-mini'}")
    every = ("--set", "inference.escalate_below=1.0", "--set", "inference.escalation_top_k=2")
    unhurried = ("--deadline-ms", "60000")  # no ticket keeps an earlier answer for its deadline
    assert main(["classify", "--input", str(tickets), "--output", str(out), *llm, *every, *unhurried]) == 0
    records = [msgspec.json.decode(line, type=TriageResult) for line in out.read_text().splitlines()]
    assert len(records) == len(texts)
    decided = [r for r in records if r.stage == "escalation" and r.model == "triage-mini"]
    # All but those the encoder stage found out of scope ("none of these": no candidate to choose among).
    assert len(decided) == len(texts) - sum(bool(r.out_of_scope) for r in records) > 0
    for record in decided:
        # Its scores: the k candidates and the encoder's other top intents, probabilities over the taxonomy.
        assert record.first_intent is not None and len(record.scores) >= 2
        assert record.intent == next(iter(record.scores))
        assert record.confidence == record.scores[record.intent]
        assert 0.0 < record.confidence <= 1.0 and sum(record.scores.values()) <= 1.0 + 1e-6
    capsys.readouterr()


def test_classify_refuses_an_escalation_llm_that_is_no_model_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["classify", "Where is my card?", "--set", f"inference.escalation_llm={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        err.strip()
        == f"triage-worker: error: inference.escalation_llm: {tmp_path} is not an ORT GenAI model folder "
        "(no genai_config.json)"
    )
    assert main(["classify", "Where is my card?", "--set", "inference.escalation_top_k=9"]) == 2
    assert "escalation_top_k" in capsys.readouterr().err


def _ticket_line(number: int) -> bytes:
    return json.dumps({"ticket_id": f"t{number}", "body": f"where is my card? ({number})"}).encode() + b"\n"


def test_results_stream_out_while_stdin_is_still_open() -> None:
    """`--input -` is stdin, and a result is written as soon as it is known: not after the whole input."""
    command = [*CLI, "classify", "--input", "-", "--model", str(TINY), "--set", "inference.escalation=off"]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(_ticket_line(0))
        process.stdin.flush()
        first = msgspec.json.decode(process.stdout.readline(), type=TriageResult)  # stdin still open
        assert (first.ticket_id, first.source.offset) == ("t0", 0)
        process.stdin.write(_ticket_line(1))
        process.stdin.close()
        second = msgspec.json.decode(process.stdout.readline(), type=TriageResult)
        assert second.ticket_id == "t1"
        assert process.wait(60) == 0
    finally:
        process.kill()
        process.wait()


def test_a_line_without_an_end_is_skipped_in_bounded_memory() -> None:
    """`--input /dev/zero` (one endless line) once held everything it read: 6.2 GB in 12 s. Now a line over
    pipeline.max_value_bytes is reported at once and read past without being kept."""
    process = subprocess.Popen(
        [*CLI, "classify", "--input", "/dev/zero", "--model", str(TINY)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        first_line = process.stderr.readline().decode()
        deadline = time.monotonic() + 120
        while _read_bytes(process.pid) < 2 << 30 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _read_bytes(process.pid) >= 2 << 30, "it did not read 2 GiB in 2 minutes"
        peak = _peak_memory_bytes(process.pid)
    finally:
        process.kill()
        process.wait()
    assert first_line == (
        "/dev/zero:1: skipped, not a TicketEvent: too_large: line is over the 1048576-byte limit "
        "(pipeline.max_value_bytes)\n"
    )
    assert peak < 300 << 20, f"peak memory {peak >> 20} MiB after reading 2 GiB"


def _read_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/<pid>/io")


def _peak_memory_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def _classify_to(
    tmp_path: Path, output: str, *shell_tail: str
) -> tuple[subprocess.CompletedProcess[str], bytes]:
    """`classify --input tickets.jsonl --output OUTPUT` run by bash in `tmp_path` (with a symlink `link.jsonl`
    and a hard link `hard.jsonl` to the input beside it); the input's bytes afterwards."""
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_bytes(_ticket_line(0) + _ticket_line(1))
    (tmp_path / "link.jsonl").symlink_to(tickets.name)
    os.link(tickets, tmp_path / "hard.jsonl")
    command = shlex.join([*CLI, "classify", "--input", "tickets.jsonl", "--model", str(TINY)])
    if output:
        command += f" --output {output}"
    done = subprocess.run(
        ["bash", "-c", " ".join([command, *shell_tail])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    return done, tickets.read_bytes()


@pytest.mark.parametrize(
    ("output", "shell_tail", "named"),
    [
        ("tickets.jsonl", [], "tickets.jsonl"),
        ("link.jsonl", [], "link.jsonl"),
        ("hard.jsonl", [], "hard.jsonl"),
        ("", [">>", "tickets.jsonl"], "stdout"),
    ],
    ids=["same-path", "symlink", "hard-link", "stdout-appending-to-it"],
)
def test_an_output_that_is_the_input_file_is_refused_before_any_work(
    tmp_path: Path, output: str, shell_tail: list[str], named: str
) -> None:
    done, left = _classify_to(tmp_path, output, *shell_tail)
    assert left == _ticket_line(0) + _ticket_line(1)  # the input is untouched
    assert done.returncode == 2
    assert done.stderr == (
        f"triage-worker: error: classify: the output ({named}) is the input file itself; writing it would "
        "destroy the tickets while they are read: write the results to another file\n"
    )


def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    done, _ = _classify_to(tmp_path, "results")
    assert done.returncode == 2
    assert done.stderr == "triage-worker: error: cannot write results: Is a directory\n"  # no model loaded


_EARLIER = b'{"earlier": "results, kept until this run has one of its own"}\n'


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        (["  "], "the ticket text is empty"),
        (["--input", "{tmp}/bad.jsonl"], "no ticket to classify"),
        (["Where is my card?", "--model", "{tmp}/not-a-model"], "not-a-model"),
        (["Where is my card?", "--provider", "cuda"], "onnxruntime-genai-cuda"),
        (["--input", "{tmp}/tickets.jsonl", "--taxonomy", "{tmp}/bad.toml"], "bad.toml"),
    ],
    ids=["empty-text", "no-ticket-line", "no-model", "missing-provider", "bad-taxonomy"],
)
@pytest.mark.parametrize("existing", [True, False], ids=["existing-output", "new-output"])
def test_a_refused_run_leaves_its_output_file_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], why: str, existing: bool
) -> None:
    """Issue 55: `classify --output FILE` emptied an existing FILE before its checks refused the run. Now the
    file is emptied by the first result only: a refused run leaves it as it was (and creates none)."""
    (tmp_path / "bad.jsonl").write_bytes(b"not a ticket\n")
    (tmp_path / "tickets.jsonl").write_bytes(_ticket_line(0))
    (tmp_path / "bad.toml").write_text("[[intents]\n")
    (tmp_path / "not-a-model").mkdir()
    out = tmp_path / "results.jsonl"
    if existing:
        out.write_bytes(_EARLIER)
    given = [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]

    code = main(["classify", *given, "--output", str(out), "--set", "inference.pool=thread"])

    assert code == 2
    refusal = capsys.readouterr().err.splitlines()[-1]
    assert refusal.startswith("triage-worker: error: ") and why in refusal
    if existing:
        assert out.read_bytes() == _EARLIER
    else:
        assert not out.exists()


def test_the_first_result_replaces_what_the_output_file_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.jsonl"
    out.write_bytes(_EARLIER * 50)  # longer than the results: nothing of it may be left at the end
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_bytes(_ticket_line(0) + _ticket_line(1))

    code = main(["classify", "--input", str(tickets), "--output", str(out), "--model", str(TINY)])

    assert code == 0, capsys.readouterr().err
    results = [msgspec.json.decode(line, type=TriageResult) for line in out.read_bytes().splitlines()]
    assert [result.source.offset for result in results] == [0, 1]


@pytest.mark.parametrize("escalation", ["auto", "configured"])
def test_without_the_encoder_classify_runs_without_the_cascade_says_why_and_starts_no_maven(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], escalation: str
) -> None:
    """Issue 55: on a checkout whose encoder was never fetched (models/triage-encoder/model.onnx missing, an
    empty user cache), a configured stage made `classify` (and `run`) start Maven, a connection besides the
    broker and the registry. The worker never fetches: it runs without the cascade and says why."""
    stage = tmp_path / "triage-encoder"
    shutil.copytree(DEFAULT_ESCALATION_DIR, stage, ignore=shutil.ignore_patterns("model.onnx"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    maven_log = tmp_path / "mvn.log"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mvn").write_text(f'#!/bin/sh\necho "$@" >> {maven_log}\nexit 1\n')
    (tmp_path / "bin" / "mvn").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    if escalation == "auto":  # the embedded model and its taxonomy, for which "auto" takes the shipped stage
        monkeypatch.setattr("worker.settings.sections.DEFAULT_ESCALATION_DIR", stage)
        monkeypatch.setattr("worker.inference.escalation.DEFAULT_ESCALATION_DIR", stage)
        arguments = ["classify", "Where is my card?"]
    else:
        arguments = [
            "classify",
            "Where is my card?",
            "--model",
            str(TINY),
            "--set",
            f"inference.escalation={stage}",
        ]

    assert main(arguments) == 0

    captured = capsys.readouterr()
    assert not maven_log.exists(), f"Maven was started: {maven_log.read_text()}"
    (line,) = captured.out.splitlines()
    assert not msgspec.json.decode(line, type=TriageResult).fallback
    assert (
        f"running without the cascade: {stage}: its encoder model.onnx is not downloaded yet: run "
        "`triage-worker model fetch` once (it uses Maven; `make setup` does it), or put the file into the "
        "folder"
    ) in captured.err.splitlines()
