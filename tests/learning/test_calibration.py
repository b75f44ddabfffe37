"""`triage-worker model calibrate`: a folder's confidence fitted on labelled tickets, used where it applies.

Against the real random-weight test model (tests/models/tiny, whose labels mix one-token and several-token
names) copied into a temporary folder; the published-model figures are in docs/model.md."""

from __future__ import annotations

import csv
import json
import math
import shutil
import time
from pathlib import Path

import pytest

from tools import REPO
from worker.classification import ClassifyRequest
from worker.cli.cli import main
from worker.inference.answer_trie import weigh
from worker.inference.engine import GenAIEngine
from worker.inference.loading import resolve_taxonomy
from worker.settings import InferenceSettings

TINY = REPO / "tests" / "models" / "tiny"
TICKETS = [
    ("Where is my new card? It has not arrived.", "card_arrival"),
    ("Someone stole my card yesterday", "lost_or_stolen_card"),
    ("My PIN is blocked after three tries", "pin_blocked"),
    ("What exchange rate do you use for euros?", "exchange_rate"),
    ("I want my money back for this purchase", "refund"),
    ("My transfer never reached my friend", "transfer_not_received_by_recipient"),
    ("Top up failed again", "top_up_failed"),
    ("card question", "card"),
]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    copy = tmp_path / "tiny"
    shutil.copytree(TINY, copy)
    return copy


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    path = tmp_path / "labelled.csv"
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label"])
        writer.writerows(TICKETS)
    return path


def _engine(folder: Path, taxonomy: Path | None = None) -> GenAIEngine:
    settings = InferenceSettings(
        model=str(folder), mode="generate", taxonomy=str(taxonomy) if taxonomy else None
    )
    return GenAIEngine(settings, *resolve_taxonomy(settings))


def test_calibrate_writes_a_temperature_that_the_engine_then_answers_with(
    folder: Path, labelled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = TICKETS[0][0]
    before = _engine(folder).new_context().classify(ClassifyRequest(0, text, time.monotonic() + 30))
    argv = [
        "model",
        "calibrate",
        "--model",
        str(folder),
        "--data",
        str(labelled),
        "--modes",
        "generate,score",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "generate: temperature" in out and "score: temperature" in out
    record = json.loads((folder / "calibration.json").read_text(encoding="utf-8"))
    assert record["taxonomy"] == "test-banking" and record["modes"]["generate"]["tickets"] == len(TICKETS)
    temperature = record["modes"]["generate"]["temperature"]
    assert temperature != 1.0  # a random-weight model is far from calibrated

    engine = _engine(folder)
    context = engine.new_context()
    after = context.classify(ClassifyRequest(0, text, time.monotonic() + 30))
    assert after.intent == before.intent  # a temperature never moves the answer
    _, decisions = context.walk(text, math.inf)
    assert math.isclose(after.confidence, weigh(decisions, temperature)[0], rel_tol=1e-9)
    assert not math.isclose(after.confidence, before.confidence, rel_tol=1e-6)


def test_a_calibration_for_other_labels_is_left_unused(folder: Path, labelled: Path, tmp_path: Path) -> None:
    assert main(["model", "calibrate", "--model", str(folder), "--data", str(labelled)]) == 0
    other = tmp_path / "other.toml"
    # The same model serving fewer labels: the fitted temperature says nothing about them.
    text = (TINY / "taxonomy.toml").read_text(encoding="utf-8")
    other.write_text(text[: text.index('[[intents]]\nname = "card"\n')], encoding="utf-8")
    assert _engine(folder, other).temperatures == {"score": 1.0, "generate": 1.0}
    assert _engine(folder).temperatures["generate"] != 1.0


def test_calibrate_refuses_in_one_line(
    folder: Path, labelled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shipped = REPO / "models" / "triage-mini"
    for argv, says in [
        (["--model", str(folder), "--data", str(labelled), "--modes", "beam"], "unknown mode 'beam'"),
        (["--model", str(folder), "--data", str(labelled), "--limit", "0"], "--limit must be at least 1"),
        (["--model", str(shipped), "--data", str(labelled)], "shipped model"),
    ]:
        assert main(["model", "calibrate", *argv]) == 2
        error = capsys.readouterr().err.strip()
        assert says in error and len(error.splitlines()) == 1
    assert not (shipped / "calibration.json").exists()
