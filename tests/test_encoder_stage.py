"""The shipped encoder stage (models/triage-encoder), run for real: onnxruntime + tokenizers, no fakes."""

from __future__ import annotations

import csv
import functools
import hashlib
import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from worker.classification import ClassifyRequest
from worker.config import DEFAULT_ESCALATION_DIR, InferenceSettings, escalation_dir, load_settings
from worker.errors import UserError
from worker.inference.encoder import EncoderEngine, labels_fingerprint, read_manifest
from worker.inference.pool import measure_turnaround, open_pool
from worker.inference.taxonomy import load_taxonomy
from worker.ops.artifacts import fetch_encoder
from worker.ops.evaluation import canonical_label, stratified_split

REPO = Path(__file__).resolve().parents[1]
BANKING77 = REPO / "taxonomies" / "banking77.toml"
TINY_TAXONOMY = REPO / "tests" / "models" / "tiny" / "taxonomy.toml"


def _settings(**overrides: object) -> InferenceSettings:
    fields: dict[str, object] = {
        "model": str(DEFAULT_ESCALATION_DIR),
        "taxonomy": str(BANKING77),
        **overrides,
    }
    return InferenceSettings(**fields)  # type: ignore[arg-type]


@functools.cache
def _engine() -> EncoderEngine:
    return EncoderEngine(_settings())


def _validation(count: int) -> list[tuple[str, str]]:
    with (REPO / "data" / "banking77" / "train.csv").open(encoding="utf-8", newline="") as handle:
        rows = [(row["text"], canonical_label(row["category"])) for row in csv.DictReader(handle)]
    _, validation = stratified_split(rows, lambda row: row[1])
    return validation[:: len(validation) // count][:count]


def test_the_folder_records_the_labels_it_was_trained_for_and_its_encoder_is_the_one_it_names() -> None:
    manifest = read_manifest(DEFAULT_ESCALATION_DIR)
    assert manifest.labels == load_taxonomy(DEFAULT_ESCALATION_DIR / "taxonomy.toml").labels
    assert manifest.labels == load_taxonomy(BANKING77).labels
    assert manifest.labels_sha256 == labels_fingerprint(manifest.labels)
    # Too large for the repository: in the user cache, where `make setup` put it, with the recorded digest.
    assert not (DEFAULT_ESCALATION_DIR / manifest.encoder).exists()
    encoder = fetch_encoder(DEFAULT_ESCALATION_DIR)
    assert hashlib.sha256(encoder.read_bytes()).hexdigest() == manifest.encoder_sha256


def test_without_its_encoder_in_the_cache_the_stage_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(UserError, match=r"not downloaded yet: run `triage-worker model fetch`"):
        EncoderEngine(_settings())


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
    assert all(0.0 < a.confidence <= 1.0 for a in answers)


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
        EncoderEngine(_settings(taxonomy=str(TINY_TAXONOMY)))


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
        EncoderEngine(_settings(model=str(folder)))


def test_the_process_pool_runs_it_and_its_warm_turnaround_is_measured() -> None:
    """The pool the worker gives the escalation stage (one process by default)."""
    settings = load_settings(env={}, overrides={"inference.escalation": "triage-encoder"}).inference
    escalation = settings.escalation_settings(str(BANKING77))
    assert escalation is not None and escalation.pool_size == 1
    with open_pool(escalation) as pool:
        assert pool.model_id == "triage-encoder" and pool.size == 1
        turnaround = measure_turnaround(pool, samples=4)
        assert 0.0 < turnaround < 30.0
        pool.submit(
            ClassifyRequest(
                7, "I still have not received my new card, when will it arrive?", time.monotonic() + 60
            )
        )
        answers = []
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
