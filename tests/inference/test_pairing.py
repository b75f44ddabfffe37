"""Model and taxonomy stay a pair (worker/inference/pairing.py), with the real models: score mode refuses a
taxonomy the model was not trained for at every start (classify, run with a shadow; reload is in
tests/app/test_reload_units.py), generate mode warns once and marks its records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tools import REPO
from worker.cli.cli import main
from worker.inference.pairing import read_trained_labels, taxonomy_version, write_trained_labels
from worker.inference.taxonomy import load_taxonomy
from worker.messages import TriageResult

TINY = REPO / "tests" / "models" / "tiny"
FOREIGN = REPO / "taxonomies" / "default.toml"
CLI = [sys.executable, "-m", "worker"]


def test_score_mode_refuses_a_taxonomy_the_model_was_not_trained_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["classify", "--taxonomy", str(FOREIGN), "my card was stolen"])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert "has 14 label(s) the model" in captured.err and "was not trained on" in captured.err
    assert "account_access, account_change" in captured.err and "security_incident" in captured.err


def test_generate_mode_warns_once_and_marks_records_with_the_taxonomy_version(tmp_path: Path) -> None:
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_text(
        "\n".join(json.dumps({"ticket_id": f"t{i}", "body": "I was charged twice"}) for i in range(3)) + "\n"
    )
    output = tmp_path / "results.jsonl"
    done = subprocess.run(
        [
            *CLI, "classify", "--input", str(tickets), "--output", str(output), "--mode", "generate",
            "--taxonomy", str(FOREIGN), "--deadline-ms", "30000",
            "--set", "inference.pool=process", "--set", "inference.pool_size=2",
        ],
        capture_output=True,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr.decode().count("taxonomy_not_trained_for") == 1  # not once per model process
    results = [msgspec.json.decode(line, type=TriageResult) for line in output.read_text().splitlines()]
    version = taxonomy_version(load_taxonomy(FOREIGN))
    assert version.startswith("customer-support@")
    assert [r.taxonomy for r in results] == [version] * 3


def test_a_model_and_its_own_taxonomy_write_no_taxonomy_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["classify", "Where is my card?", "--model", str(TINY), "--mode", "generate"]) == 0
    assert '"taxonomy"' not in capsys.readouterr().out


def test_the_committed_models_record_the_labels_they_were_trained_for(tmp_path: Path) -> None:
    """`model export` writes this record; the committed models carry it, matching their taxonomy files."""
    for folder in (TINY, REPO / "models" / "triage-mini"):
        record = read_trained_labels(folder)
        assert record is not None
        assert record.labels == load_taxonomy(folder / "taxonomy.toml").labels
    copy = tmp_path / "model"
    copy.mkdir()
    written = write_trained_labels(copy, load_taxonomy(TINY / "taxonomy.toml"))
    assert written.read_bytes() == (TINY / "trained_labels.json").read_bytes()


def test_run_refuses_a_shadow_taxonomy_its_model_was_not_trained_for_before_contacting_kafka(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Port 9 (discard) answers nothing: the refusal must come first, and fast.
    code = main(["run", "--shadow-taxonomy", str(FOREIGN), "--bootstrap-servers", "127.0.0.1:9"])
    assert code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()  # the `settings` log event, then the error line
    assert (
        lines[-1].startswith("triage-worker: error: inference.taxonomy:")
        and "label(s) the model" in lines[-1]
    )
    assert "Kafka" not in err and "Traceback" not in err
