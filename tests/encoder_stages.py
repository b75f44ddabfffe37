"""Serving an encoder-stage folder for real, as the worker does, in tests of more than one module (the
out-of-scope detector's and the neighbour vote's): BANKING77 rows and a stage's answers to texts."""

from __future__ import annotations

import csv
import time
from pathlib import Path

from tools import REPO
from worker.classification import Classification, ClassifyRequest
from worker.inference.encoder import EncoderEngine
from worker.inference.loading import resolve_taxonomy
from worker.learning.evaluation import canonical_label
from worker.settings import InferenceSettings


def banking77_rows(split: str) -> list[tuple[str, str]]:
    """(text, intent) of data/banking77/`split`.csv."""
    with (REPO / "data" / "banking77" / f"{split}.csv").open(encoding="utf-8", newline="") as handle:
        return [(row["text"], canonical_label(row["category"])) for row in csv.DictReader(handle)]


def serve_stage(folder: Path, texts: list[str]) -> list[Classification]:
    """The encoder stage of `folder` answering `texts`, 64 to a batch, as a batching pool calls it."""
    settings = InferenceSettings(model=str(folder), taxonomy=str(folder / "taxonomy.toml"))
    engine = EncoderEngine(settings, *resolve_taxonomy(settings))
    deadline = time.monotonic() + 300
    answers: list[Classification] = []
    for start in range(0, len(texts), 64):
        batch = texts[start : start + 64]
        answers += engine.classify_batch([ClassifyRequest(i, text, deadline) for i, text in enumerate(batch)])
    return answers
