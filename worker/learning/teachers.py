"""Teachers for `first_stage.train_first_stage`: callables from texts to intent probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from worker.inference.encoder import SentenceEmbedder, encoder_file, read_manifest
from worker.learning.first_stage import Teacher


def encoder_stage_teacher(folder: Path, labels: Sequence[str], threads: int = 1) -> Teacher:
    """The encoder stage in `folder` (encoder.json, its encoder, tokenizer and head) as a teacher: its
    calibrated probabilities (the head's temperature applied), columns in `labels` order. Every label must
    be one of the head's."""
    manifest = read_manifest(folder)
    unknown = [label for label in labels if label not in manifest.labels]
    if unknown:
        raise ValueError(f"{folder}: its head does not know {', '.join(unknown[:5])}")
    embedder = SentenceEmbedder(
        encoder_file(folder, manifest), folder / manifest.tokenizer, threads, max_tokens=manifest.max_tokens
    )
    head = np.load(folder / manifest.head, allow_pickle=False)
    order = [manifest.labels.index(label) for label in labels]
    weight = np.asarray(head["weight"], dtype=np.float32)[order]
    bias = np.asarray(head["bias"], dtype=np.float32)[order]

    def teacher(texts: Sequence[str]) -> np.ndarray[Any, Any]:
        logits = (embedder.embed(texts) @ weight.T + bias) / manifest.temperature
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities: np.ndarray[Any, Any] = exp / exp.sum(axis=1, keepdims=True)
        return probabilities

    return teacher
