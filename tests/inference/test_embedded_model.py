"""The shipped default model `models/triage-mini`: it loads, answers valid records, and is accurate.

No training here (CI has no torch): these tests run the committed model through the real engine and CLI.
The accuracy floors sit a few points under the figures measured with `triage-worker model eval` (see the
model card), so that they catch a broken or mismatched model, not noise.
"""

from __future__ import annotations

import csv
import json
import time

import msgspec
import pytest

from tools import REPO
from worker.classification import ClassifyRequest
from worker.cli.cli import main
from worker.inference.engine import GenAIEngine
from worker.inference.loading import resolve_taxonomy
from worker.inference.prompt import INTENT_OPENING
from worker.learning.evaluation import canonical_label
from worker.messages import TriageResult
from worker.settings import DEFAULT_MODEL_DIR, InferenceSettings

TEST_CSV = REPO / "data" / "banking77" / "test.csv"
SAMPLE_SIZE = 200
# Measured on these fixed samples with the shipped model (v2): score 90.5 % (181/200), generate 90 % (36/40);
# the floors leave room for a few tickets decided differently by another CPU's int4 kernels.
SCORE_ACCURACY_FLOOR = 0.87
GENERATE_SAMPLE_SIZE = 40
GENERATE_ACCURACY_FLOOR = 0.85


def _sample(size: int) -> list[tuple[str, str]]:
    """An evenly spaced, fixed sample of test.csv (the file is grouped by intent, so every intent shows)."""
    with TEST_CSV.open(encoding="utf-8", newline="") as handle:
        rows = [(row["text"], canonical_label(row["category"])) for row in csv.DictReader(handle)]
    return rows[:: len(rows) // size][:size]


@pytest.fixture(scope="module")
def engine() -> GenAIEngine:
    settings = InferenceSettings()
    return GenAIEngine(settings, *resolve_taxonomy(settings))


def test_the_default_model_is_the_embedded_one_and_fits_the_size_budget() -> None:
    assert DEFAULT_MODEL_DIR == REPO / "models" / "triage-mini"
    files = {path.name for path in DEFAULT_MODEL_DIR.iterdir()}
    assert {"genai_config.json", "tokenizer.json", "taxonomy.toml", "README.md"} <= files
    assert sum(path.stat().st_size for path in DEFAULT_MODEL_DIR.iterdir()) <= 30_000_000


def test_every_intent_is_one_token_so_score_mode_is_one_step(engine: GenAIEngine) -> None:
    assert len(engine.labels) == 77
    assert all(len(ids) == 1 for ids in engine.label_ids)
    assert len({ids[0] for ids in engine.label_ids}) == 77


def test_score_mode_is_accurate_on_a_fixed_test_sample(engine: GenAIEngine) -> None:
    context = engine.new_context("score")
    sample = _sample(SAMPLE_SIZE)
    correct = 0
    for index, (text, intent) in enumerate(sample):
        result = context.classify(ClassifyRequest(index, text, time.monotonic() + 30.0))
        assert not result.fallback
        assert result.priority == engine.taxonomy.policy_priority(result.intent)
        assert abs(sum(context.label_distribution(text).values()) - 1.0) < 1e-6
        correct += result.intent == intent
    assert correct / len(sample) >= SCORE_ACCURACY_FLOOR


def test_generate_mode_answers_valid_json_and_agrees_with_the_labels(engine: GenAIEngine) -> None:
    context = engine.new_context("generate")
    sample = _sample(GENERATE_SAMPLE_SIZE)
    correct = 0
    for index, (text, intent) in enumerate(sample):
        result = context.classify(ClassifyRequest(index, text, time.monotonic() + 30.0))
        assert not result.fallback and result.intent in engine.labels
        assert result.priority in engine.taxonomy.priorities
        correct += result.intent == intent
    assert correct / len(sample) >= GENERATE_ACCURACY_FLOOR


def test_classify_with_no_flags_escalates_a_stolen_card(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["classify", "my card was stolen yesterday"]) == 0
    result = msgspec.json.decode(capsys.readouterr().out.strip(), type=TriageResult)
    # No flags: the embedded model answers first, and the default cascade may ask its stage for a second
    # opinion (this ticket's first confidence is close to the 0.8 threshold).
    assert result.model == ("triage-encoder" if result.stage == "escalation" else "triage-mini")
    assert result.intent in {"lost_or_stolen_card", "compromised_card"}
    assert result.priority in {"High", "Critical"}
    assert not result.fallback and result.confidence > 0.5


def test_ort_genai_encodes_every_test_prompt_as_the_trainer_did(engine: GenAIEngine) -> None:
    """Training tokenised with HF `tokenizers`, serving with ORT GenAI, which ignores some tokenizer.json
    settings: every rendered test prompt must give the same ids in both (the ticket normalisation lives in
    the taxonomy for this reason)."""
    tokenizers = pytest.importorskip("tokenizers")
    trained = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    with TEST_CSV.open(encoding="utf-8", newline="") as handle:
        texts = [row["text"] for row in csv.DictReader(handle)]
    mismatched = []
    for text in texts:
        prompt = engine.builder.full(engine.builder.prepare(text)) + INTENT_OPENING
        if trained.encode(prompt, add_special_tokens=False).ids != engine.encode(prompt):
            mismatched.append(text)
    assert not mismatched, f"{len(mismatched)} of {len(texts)} differ, e.g. {mismatched[0]!r}"


def test_the_taxonomy_ships_with_the_model_and_documents_the_policy() -> None:
    shipped = (DEFAULT_MODEL_DIR / "taxonomy.toml").read_text(encoding="utf-8")
    assert shipped == (REPO / "taxonomies" / "banking77.toml").read_text(encoding="utf-8")
    assert "Priority policy" in shipped
    training = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text(encoding="utf-8"))
    assert training["precision"] in {"int4", "int8", "fp32"}
