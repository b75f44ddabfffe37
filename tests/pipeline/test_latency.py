"""The expected model latency the pipeline refuses hopeless tickets with: a median of recent answers."""

from __future__ import annotations

from worker.classification import Classification, FallbackLabel, fallback_answer
from worker.messages import FallbackReason
from worker.pipeline.triage.latency import LatencyEstimate

LABEL = FallbackLabel("unclassified", "Medium")


def _answer(latency_ms: float, reason: FallbackReason | None = None) -> Classification:
    if reason is not None:
        return fallback_answer(reason, LABEL, "m", latency_ms)
    return Classification(
        intent="card_arrival",
        priority="Low",
        confidence=0.9,
        scores={"card_arrival": 0.9},
        model="m",
        latency_ms=latency_ms,
        truncated=False,
    )


def test_no_estimate_until_a_few_answers_were_seen() -> None:
    estimate = LatencyEstimate(min_samples=8)
    for _ in range(7):
        estimate.observe(_answer(300.0))
    assert estimate.expected_s == 0.0  # 0: every ticket is still tried
    estimate.observe(_answer(300.0))
    assert estimate.expected_s == 0.3


def test_one_slow_outlier_does_not_move_the_estimate() -> None:
    estimate = LatencyEstimate(window=16, min_samples=8, refresh=1)
    for _ in range(15):
        estimate.observe(_answer(100.0))
    estimate.observe(_answer(60_000.0))
    assert estimate.expected_s == 0.1


def test_the_estimate_follows_a_lasting_change_within_its_window() -> None:
    estimate = LatencyEstimate(window=16, min_samples=4, refresh=4)
    for _ in range(16):
        estimate.observe(_answer(100.0))
    for _ in range(16):
        estimate.observe(_answer(900.0))
    assert estimate.expected_s == 0.9


def test_answers_that_ran_no_model_step_are_left_out_and_cut_short_ones_count() -> None:
    estimate = LatencyEstimate(min_samples=4, refresh=1)
    for _ in range(20):
        estimate.observe(_answer(0.0, "overloaded"))  # refused before the model: says nothing of it
    assert estimate.expected_s == 0.0
    for _ in range(4):
        estimate.observe(_answer(500.0, "deadline_exceeded"))  # the model took at least this long
    assert estimate.expected_s == 0.5
