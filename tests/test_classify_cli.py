"""`triage-worker classify` with the real test model."""

from __future__ import annotations

import json
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
