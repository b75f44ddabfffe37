"""`triage-worker classify` with the real test model, and the argument text checks it shares with `send`."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from worker.messages import TriageResult
from worker.ops.cli import main

TINY = Path(__file__).parent / "models" / "tiny"


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
    assert code == 0
    err = capsys.readouterr().err
    assert "tickets.jsonl:2:" in err and "tickets.jsonl:4:" in err
    assert "classified 3 tickets" in err and "bad lines skipped: 2" in err and "fallbacks: none" in err
    assert "3/3" in err  # the progress bar
    results = [msgspec.json.decode(line, type=TriageResult) for line in output.read_text().splitlines()]
    assert [(r.ticket_id, r.source.offset) for r in results] == [("a", 0), ("b", 2), ("c", 4)]


def test_classify_needs_text_or_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["classify", "--model", str(TINY)]) == 2
    assert "either a ticket TEXT or --input" in capsys.readouterr().err


def test_classify_with_cuda_missing_names_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["classify", "hi", "--model", str(TINY), "--provider", "cuda"]) == 2
    assert "onnxruntime-genai-cuda" in capsys.readouterr().err


REPO = Path(__file__).resolve().parents[1]
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


def _banking77_test_texts(count: int) -> list[str]:
    with (Path(__file__).parents[1] / "data" / "banking77" / "test.csv").open(encoding="utf-8") as handle:
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
