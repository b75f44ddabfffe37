"""The training-time teacher and its `model eval` row: pure logic, no network, no model files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from worker.errors import UserError
from worker.inference.encoder import mean_pool
from worker.learning import evaluation


def test_mean_pool_ignores_padding_and_normalises() -> None:
    states = np.array([[[3.0, 0.0], [3.0, 8.0], [100.0, 100.0]]], dtype=np.float32)
    pooled = mean_pool(states, np.array([[1, 1, 0]]))
    np.testing.assert_allclose(pooled, [[0.6, 0.8]], rtol=1e-6)  # mean of the first two: (3, 4)


def test_mean_pool_of_an_all_padding_row_is_zero_not_nan() -> None:
    pooled = mean_pool(np.ones((1, 2, 3), dtype=np.float32), np.zeros((1, 2), dtype=np.int64))
    assert not np.isnan(pooled).any()


def test_fetch_teacher_without_maven_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("worker.learning.artifacts.shutil.which", lambda _name: None)
    with pytest.raises(UserError, match="mvn"):
        evaluation.fetch_teacher(lambda _line: None)
    assert not (evaluation.teacher_dir() / ".complete").exists()


def test_a_teacher_that_could_not_run_is_a_row_that_says_so() -> None:
    row = evaluation.Figures("TF-IDF", 0.9, 0.9, 0.95, 0.1, 0.0, 1000.0, 10)
    context = {
        "command": "triage-worker model eval",
        "model": "triage-mini",
        "machine": "x86_64",
        "date": "2026-12-01",
        "test_tickets": 10,
        "train_tickets": 100,
        "deadline_ms": 2000,
        "unavailable": {evaluation.TEACHER_NAME: "`mvn` was not found on PATH"},
    }
    table = evaluation.render_markdown([row], context)
    assert f"| {evaluation.TEACHER_NAME} | not measured: `mvn` was not found on PATH |" in table
    assert "| TF-IDF | 90.00% |" in table


def test_fit_temperature_undoes_a_known_overconfidence() -> None:
    rng = np.random.default_rng(0)
    calibrated = rng.normal(size=(4000, 5)) * 2
    probabilities = np.exp(calibrated) / np.exp(calibrated).sum(axis=1, keepdims=True)
    labels = np.array([rng.choice(5, p=row) for row in probabilities])
    assert abs(evaluation.fit_temperature(calibrated * 2.0, labels) - 2.0) < 0.15
