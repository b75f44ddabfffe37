"""The shipped encoder stage (models/triage-encoder), run for real: onnxruntime + tokenizers, no fakes."""

from __future__ import annotations

import csv
import functools
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tools import REPO
from worker.classification import ClassifyRequest
from worker.errors import UserError
from worker.inference.encoder import EncoderEngine, ordered_labels_sha256, read_manifest
from worker.inference.escalation import EscalationChoice, choose_escalation
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import Result, measure_turnaround, open_pool
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.learning.artifacts import fetch_encoder
from worker.learning.evaluation import canonical_label, stratified_split
from worker.settings import DEFAULT_ESCALATION_DIR, InferenceSettings, escalation_dir, load_settings

BANKING77 = REPO / "taxonomies" / "banking77.toml"
TINY_TAXONOMY = REPO / "tests" / "models" / "tiny" / "taxonomy.toml"
ENCODER = "models/triage-encoder/model.onnx"


def _settings(**overrides: object) -> InferenceSettings:
    fields: dict[str, object] = {
        "model": str(DEFAULT_ESCALATION_DIR),
        "taxonomy": str(BANKING77),
        **overrides,
    }
    return InferenceSettings(**fields)  # type: ignore[arg-type]


@functools.cache
def _engine() -> EncoderEngine:
    return _encoder_engine(_settings())


def _encoder_engine(settings: InferenceSettings) -> EncoderEngine:
    """The stage as the worker assembles it: its taxonomy resolved, then its engine loaded."""
    return EncoderEngine(settings, *resolve_taxonomy(settings))


def _validation(count: int) -> list[tuple[str, str]]:
    with (REPO / "data" / "banking77" / "train.csv").open(encoding="utf-8", newline="") as handle:
        rows = [(row["text"], canonical_label(row["category"])) for row in csv.DictReader(handle)]
    _, validation = stratified_split(rows, lambda row: row[1])
    return validation[:: len(validation) // count][:count]


def test_the_folder_records_the_labels_it_was_trained_for_and_its_encoder_is_the_one_it_names() -> None:
    manifest = read_manifest(DEFAULT_ESCALATION_DIR)
    assert manifest.labels == load_taxonomy(DEFAULT_ESCALATION_DIR / "taxonomy.toml").labels
    assert manifest.labels == load_taxonomy(BANKING77).labels
    assert manifest.labels_sha256 == ordered_labels_sha256(manifest.labels)
    # Too large for git: in the folder, where `make setup` copied it from the user cache, with its digest.
    ignored = subprocess.run(["git", "check-ignore", "-q", ENCODER], cwd=REPO, check=False)
    assert ignored.returncode == 0, f"{ENCODER} must stay out of git"
    encoder = fetch_encoder(DEFAULT_ESCALATION_DIR)
    assert encoder == DEFAULT_ESCALATION_DIR / manifest.encoder
    assert hashlib.sha256(encoder.read_bytes()).hexdigest() == manifest.encoder_sha256


def _stage_without_encoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the shipped stage without its encoder, and an empty user cache."""
    folder = tmp_path / "triage-encoder"
    shutil.copytree(DEFAULT_ESCALATION_DIR, folder, ignore=shutil.ignore_patterns("model.onnx"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return folder


def test_without_its_encoder_the_stage_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _stage_without_encoder(tmp_path, monkeypatch)
    with pytest.raises(UserError, match=r"not downloaded yet: run `triage-worker model fetch`"):
        _encoder_engine(_settings(model=str(folder)))


def _first_stage(taxonomy: Path, escalation: str = "auto") -> tuple[InferenceSettings, Taxonomy]:
    settings = load_settings(env={}, overrides={"inference.escalation": escalation}).inference
    return settings, load_taxonomy(taxonomy)


def test_by_default_the_shipped_stage_escalates_for_the_banking77_taxonomy() -> None:
    assert load_settings(env={}).inference.escalation == "auto"
    first, taxonomy = _first_stage(BANKING77)
    choice = choose_escalation(first, taxonomy, BANKING77)
    assert choice.why_off is None and choice.settings is not None
    assert Path(choice.settings.model) == DEFAULT_ESCALATION_DIR
    assert choice.settings.taxonomy == str(BANKING77) and choice.settings.pool_size == 1


def test_by_default_another_taxonomy_runs_without_a_cascade_and_says_why() -> None:
    """The tests' tiny taxonomy has 8 BANKING77 intents: the shipped head would run (it knows them), but its
    threshold and figures were measured on all 77, so "auto" does not guess."""
    first, taxonomy = _first_stage(TINY_TAXONOMY)
    choice = choose_escalation(first, taxonomy, TINY_TAXONOMY)
    assert choice.settings is None
    assert choice.why_off is not None and "77 BANKING77 intents, not the 8 of taxonomy 'test-banking'" in (
        choice.why_off
    )
    # Asked for by name, it runs for those labels all the same.
    named = choose_escalation(_first_stage(TINY_TAXONOMY, "triage-encoder")[0], taxonomy, TINY_TAXONOMY)
    assert named.settings is not None and named.why_off is None


def test_by_default_a_missing_encoder_means_no_cascade_rather_than_a_fetch_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _stage_without_encoder(tmp_path, monkeypatch)
    monkeypatch.setattr("worker.inference.escalation.DEFAULT_ESCALATION_DIR", folder)
    first, taxonomy = _first_stage(BANKING77)
    choice = choose_escalation(first, taxonomy, BANKING77)
    assert choice.settings is None
    assert choice.why_off is not None and "`triage-worker model fetch`" in choice.why_off


@pytest.mark.parametrize("configured", ["folder", "shipped-by-name"])
def test_a_configured_stage_whose_encoder_was_never_fetched_means_no_cascade_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, configured: str
) -> None:
    """Issue 55: a configured stage (not "auto") ran as configured, so a missing encoder was fetched with
    Maven at the worker's start: a connection besides the broker and the registry. Now it is no cascade, and
    the reason says what to run."""
    folder = _stage_without_encoder(tmp_path, monkeypatch)
    if configured == "shipped-by-name":
        monkeypatch.setattr("worker.settings.sections.DEFAULT_ESCALATION_DIR", folder)
    first, taxonomy = _first_stage(BANKING77, str(folder) if configured == "folder" else "triage-encoder")
    choice = choose_escalation(first, taxonomy, BANKING77)
    assert choice.settings is None
    assert choice.why_off == (
        f"{folder}: its encoder model.onnx is not downloaded yet: run `triage-worker model fetch` once "
        "(it uses Maven; `make setup` does it), or put the file into the folder"
    )


@pytest.mark.parametrize("off", ["off", ""])
def test_off_or_empty_runs_no_cascade(off: str) -> None:
    first, taxonomy = _first_stage(BANKING77, off)
    assert choose_escalation(first, taxonomy, BANKING77) == EscalationChoice(None)


def test_it_answers_validation_tickets_as_its_training_measured() -> None:
    """200 tickets of the validation split (never trained on), through one context, one at a time."""
    engine = _engine()
    context = engine.new_context()
    tickets = _validation(200)
    answers = [
        context.classify(ClassifyRequest(i, text, time.monotonic() + 60))
        for i, (text, _) in enumerate(tickets)
    ]
    accuracy = sum(a.intent == label for a, (_, label) in zip(answers, tickets, strict=True)) / len(tickets)
    assert accuracy >= 0.88, accuracy
    first = answers[0]
    assert first.model == "triage-encoder" and not first.fallback
    assert first.priority == engine.taxonomy.policy_priority(first.intent)
    assert len(first.scores) == 5 and abs(max(first.scores.values()) - first.confidence) < 1e-9
    # An answer out of scope claims no intent (confidence 0.0); the head's is kept as the nearest intent.
    assert all(0.0 < a.confidence <= 1.0 for a in answers if not a.out_of_scope)
    assert all(a.nearest_intent in engine.taxonomy.labels for a in answers if a.out_of_scope)


def test_a_batch_gives_the_same_answers_as_one_ticket_at_a_time() -> None:
    """Padding to the batch's longest text must not change the intent: the pads are masked out of the pooling.
    Not the confidence bit for bit: the int8 encoder quantizes its activations with one scale per batch, pads
    included, so a short text padded to a long one moves (0.643 alone vs 0.572 batched for "pin?", measured).
    The worker's process pool runs one ticket per call, so its answers are the unbatched ones."""
    engine = _engine()
    texts = [
        "my card was stolen",
        "How long does a transfer from the UK take? I sent money on Monday.",
        "pin?",
    ]
    deadline = time.monotonic() + 60
    batched = engine.classify_batch([ClassifyRequest(i, t, deadline) for i, t in enumerate(texts)])
    alone = [engine.classify_batch([ClassifyRequest(0, t, deadline)])[0] for t in texts]
    for one, other in zip(batched, alone, strict=True):
        assert one.intent == other.intent
        assert one.confidence == pytest.approx(other.confidence, abs=0.1)


def test_a_request_past_its_deadline_is_answered_overloaded_without_running() -> None:
    answer = _engine().new_context().classify(ClassifyRequest(1, "my card was stolen", time.monotonic() - 1))
    assert answer.fallback and answer.fallback_reason == "overloaded"
    assert answer.intent == "unclassified"


def test_a_ticket_longer_than_the_encoder_takes_is_cut_and_says_so() -> None:
    long = "I lost my card on the bus and somebody has been using it since then. " * 60
    answer = _engine().new_context().classify(ClassifyRequest(1, long, time.monotonic() + 60))
    assert answer.truncated and not answer.fallback


def test_a_taxonomy_with_labels_the_head_never_saw_stops_at_load_naming_them() -> None:
    with pytest.raises(UserError, match=r"without card, refund of .*taxonomy.toml"):
        _encoder_engine(_settings(taxonomy=str(TINY_TAXONOMY)))


def test_a_head_that_is_not_the_one_the_manifest_describes_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "broken-encoder"
    folder.mkdir()
    for item in DEFAULT_ESCALATION_DIR.iterdir():
        (folder / item.name).symlink_to(item)
    manifest = msgspec.json.decode((DEFAULT_ESCALATION_DIR / "encoder.json").read_bytes())
    (folder / "encoder.json").unlink()
    (folder / "encoder.json").write_bytes(
        msgspec.json.encode({**manifest, "labels": manifest["labels"][:-1]})
    )
    with pytest.raises(UserError, match="labels_sha256 does not match"):
        _encoder_engine(_settings(model=str(folder)))


def test_the_process_pool_runs_it_and_its_warm_turnaround_is_measured() -> None:
    """The pool the worker gives the escalation stage (one process by default)."""
    settings = load_settings(env={}, overrides={"inference.escalation": "triage-encoder"}).inference
    escalation = settings.escalation_settings(str(BANKING77))
    assert escalation is not None and escalation.pool_size == 1
    # The stage answers with the first stage's taxonomy, as the worker hands it over.
    with open_pool(escalation, load_taxonomy(BANKING77), BANKING77) as pool:
        assert pool.model_id == "triage-encoder" and pool.size == 1
        turnaround = measure_turnaround(pool, samples=4)
        assert 0.0 < turnaround < 30.0
        pool.submit(
            ClassifyRequest(
                7, "I still have not received my new card, when will it arrive?", time.monotonic() + 60
            )
        )
        answers: list[Result] = []
        while not answers:
            answers = pool.poll(1.0)
        assert answers[0][0] == 7 and answers[0][1].intent == "card_arrival"


def test_the_shipped_stage_is_found_by_its_name_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert escalation_dir("triage-encoder") == DEFAULT_ESCALATION_DIR
    os.mkdir("triage-encoder")  # a folder of that name where the worker runs wins: it is a path
    assert escalation_dir("triage-encoder") == Path("triage-encoder")


def test_embeddings_are_unit_vectors() -> None:
    embeddings = _engine().embedder.embed(["card", "where is my money", ""])
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
