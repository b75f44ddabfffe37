"""`worker.learning.first_stage`: train a tiny first stage on a small made-up taxonomy in seconds, then serve
the folder through the real engine in score mode.

Needs the `export` extra (torch, transformers, tokenizers, onnx, onnx_ir, safetensors), which the main CI
venv does not install: the training tests skip there, saying so. The augmentation test runs everywhere.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from worker.classification import ClassifyRequest
from worker.inference.engine import GenAIEngine
from worker.inference.loading import resolve_taxonomy
from worker.inference.pairing import read_trained_labels
from worker.inference.taxonomy import load_taxonomy
from worker.learning import first_stage
from worker.learning.first_stage import Recipe, Shape, augment, train_first_stage
from worker.settings import InferenceSettings

needs_train_extra = pytest.mark.skipif(
    bool(first_stage.missing_modules()),
    reason=f"training needs {', '.join(first_stage.missing_modules())} (the `export` extra: "
    "pip install 'triage-worker[export]'), which this venv does not have",
)

TAXONOMY = """
name = "helpdesk"
fallback_intent = "unclassified"
fallback_priority = "Medium"
priorities = ["Low", "Medium", "High", "Critical"]

[prompt]
instructions = "Classify the ticket. Answer with JSON only."
list_intents = false
ticket_normalization = "nfkc_lower"
score_priority = false
"""
# Each intent's words; a ticket is a few of them inside neutral filler, so the words decide the intent.
WORDS = {
    "printer_jam": ["printer", "paper", "jammed", "tray", "toner", "prints"],
    "vpn_down": ["vpn", "tunnel", "remote", "connect", "gateway", "offline"],
    "password_reset": ["password", "reset", "locked", "login", "forgot", "expired"],
    "laptop_request": ["laptop", "new", "hardware", "order", "machine", "replacement"],
    "email_quota": ["mailbox", "full", "quota", "email", "storage", "inbox"],
}
FILLERS = [
    "hi team, {} since this morning",
    "hello, {} please help",
    "urgent: {}",
    "{} - can someone look at it",
    "my manager says {} again",
    "not sure who to ask but {}",
]


def _tickets(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        intent = list(WORDS)[index % len(WORDS)]
        words = rng.sample(WORDS[intent], 3)
        rows.append((rng.choice(FILLERS).format(" ".join(words)), intent))
    return rows


def _keyword_teacher(labels: Sequence[str]) -> first_stage.Teacher:
    """Probabilities from keyword counts: a stand-in for the encoder stage's head, which knows the words."""

    def teacher(texts: Sequence[str]) -> np.ndarray:
        scores = np.array(
            [
                [sum(word in text.lower().split() for word in WORDS[label]) for label in labels]
                for text in texts
            ],
            dtype=np.float64,
        )
        exp = np.exp(2.0 * scores)
        result: np.ndarray = exp / exp.sum(axis=1, keepdims=True)
        return result

    return teacher


def _taxonomy_file(tmp_path: Path) -> Path:
    intents = "".join(
        f'\n[[intents]]\nname = "{name}"\ndescription = "Tickets about {", ".join(words)}."\n'
        f'priority = "{"High" if name == "vpn_down" else "Low"}"\n'
        for name, words in WORDS.items()
    )
    path = tmp_path / "helpdesk.toml"
    path.write_text(TAXONOMY + intents, encoding="utf-8")
    return path


TINY = Shape(vocab_size=600, hidden=64, layers=1, heads=2, kv_heads=2, intermediate=128)


@needs_train_extra
def test_a_tiny_first_stage_trains_in_its_budget_and_serves_the_taxonomy(tmp_path: Path) -> None:
    taxonomy_path = _taxonomy_file(tmp_path)
    taxonomy = load_taxonomy(taxonomy_path)
    train, validation, held_out = _tickets(300, 1), _tickets(60, 2), _tickets(100, 3)
    out = tmp_path / "model"
    steps: list[tuple[int, int]] = []
    max_seconds = 45.0
    started = time.monotonic()
    report = train_first_stage(
        train, validation, taxonomy, taxonomy_path, _keyword_teacher(taxonomy.labels), out,
        unlabelled=[text for text, _ in _tickets(50, 4)], max_seconds=max_seconds, seed=3,
        progress=lambda done, total: steps.append((done, total)), shape=TINY,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    # The budget holds (export included), with some room for a machine whose load changes under the run.
    assert elapsed <= max_seconds * 1.1 + 3, report
    assert report.steps == steps[-1][0] == steps[-1][1] and report.steps >= 10
    assert report.precision == "int4" and 0 < report.parameters < 500_000
    assert report.validation_accuracy is not None and report.ece is not None

    files = {path.name for path in out.iterdir()}
    assert {"genai_config.json", "model.onnx", "tokenizer.json", "taxonomy.toml", "training.json"} <= files
    record = read_trained_labels(out)
    assert record is not None and record.labels == taxonomy.labels

    settings = InferenceSettings(model=str(out), mode="score", escalation="off")
    context = GenAIEngine(settings, *resolve_taxonomy(settings)).new_context("score")
    answers = [context.classify(ClassifyRequest(i, text, time.monotonic() + 10)) for i, (text, _) in
               enumerate(held_out)]  # fmt: skip
    assert all(answer.intent in taxonomy.labels for answer in answers)
    correct = [a.intent == intent for a, (_, intent) in zip(answers, held_out, strict=True)]
    accuracy = sum(correct) / len(held_out)
    # Chance is 20 %; the words decide the intent, so a model that learnt anything is far above it.
    assert accuracy >= 0.7, accuracy
    assert report.validation_accuracy >= 0.7
    assert all(0.0 < a.confidence <= 1.0 for a in answers)


@needs_train_extra
def test_zero_shot_from_the_taxonomy_texts_gives_a_valid_folder_quickly(tmp_path: Path) -> None:
    """Day 0: the taxonomy's own texts are the labelled rows; no validation rows; the teacher decides."""
    taxonomy_path = _taxonomy_file(tmp_path)
    taxonomy = load_taxonomy(taxonomy_path)
    labelled = [(intent.description, intent.name) for intent in taxonomy.intents]
    labelled += [(intent.name.replace("_", " "), intent.name) for intent in taxonomy.intents]
    out = tmp_path / "day0"
    report = train_first_stage(
        labelled, [], taxonomy, taxonomy_path, _keyword_teacher(taxonomy.labels), out,
        max_seconds=60.0, shape=TINY, recipe=Recipe(min_examples=600),
    )  # fmt: skip
    # A minute: the export alone (the builder imports torch in a child) took 10-18 s on the loaded machine.
    assert report.seconds <= 60 * 1.1 + 3 and report.validation_accuracy is None and report.ece is None
    assert any("few-shot" in note for note in report.notes)
    assert any("teacher's probabilities" in note for note in report.notes)
    settings = InferenceSettings(model=str(out), mode="score", escalation="off")
    context = GenAIEngine(settings, *resolve_taxonomy(settings)).new_context("score")
    held_out = _tickets(50, 5)
    predicted = [max((d := context.label_distribution(text)), key=d.__getitem__) for text, _ in held_out]
    assert sum(p == intent for p, (_, intent) in zip(predicted, held_out, strict=True)) / len(held_out) > 0.4


def test_augment_drops_and_swaps_words_reproducibly() -> None:
    text = "i lost my card on the bus yesterday evening"
    copies = [augment(text, random.Random(seed), 0.15, 0.3) for seed in range(50)]
    assert copies == [augment(text, random.Random(seed), 0.15, 0.3) for seed in range(50)]
    assert all(set(copy.split()) <= set(text.split()) for copy in copies)
    assert any(len(copy.split()) < len(text.split()) for copy in copies)
    assert augment(text, random.Random(1), 0.0, 0.0) == text
    assert augment("card declined", random.Random(3), 1.0, 0.0) in {"card", "declined"}
