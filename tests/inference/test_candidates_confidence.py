"""The escalation LLM's answer over the encoder's top candidates (worker/inference/candidates.py), with
stand-ins for both models fed generated score vectors: its confidence is a probability over the whole
taxonomy (the encoder's mass on the candidates, shared by both opinions), not one renormalised over the k
candidates alone, which could never be under 1/k however unsure both models were."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest

from worker.classification import Classification, ClassifyRequest
from worker.inference.candidates import CandidatesContext, CandidatesEngine
from worker.inference.engine import FloatArray

LABELS = [f"intent_{index:02d}" for index in range(77)]  # as many as BANKING77's
ENCODER, LLM = "encoder@test", "llm@test"
TOP_SCORES = 5  # the encoder stage's `scores`: its top 5 (worker/inference/encoder.py)


def _encoder_answer(probabilities: FloatArray) -> Classification:
    """What the encoder stage answers for a ticket with these probabilities over `LABELS`."""
    order = np.argsort(-probabilities)[:TOP_SCORES]
    return Classification(
        intent=LABELS[int(order[0])],
        priority="Medium",
        confidence=float(probabilities[order[0]]),
        scores={LABELS[int(i)]: float(probabilities[i]) for i in order},
        model=ENCODER,
        latency_ms=1.0,
        truncated=False,
    )


class _Said:
    """A model context that says what it is told to: the encoder's answer, or the LLM's probabilities among
    the candidates it is asked about."""

    def __init__(self) -> None:
        self.answer: Classification | None = None
        self.among: FloatArray | None = None
        self.asked: list[Sequence[str]] = []

    def classify(self, request: ClassifyRequest) -> Classification:
        assert self.answer is not None
        return self.answer

    def score_among(self, turn: str, labels: Sequence[str], deadline: float = math.inf) -> FloatArray:
        assert self.among is not None and len(self.among) == len(labels)
        self.asked.append(labels)
        return self.among


class _Taxonomy:
    def policy_priority(self, intent: str) -> str:
        return "High"


class _Models:
    """The part of a `CandidatesEngine` a context uses, over `_Said` models."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.model_id = LLM
        self.taxonomy = _Taxonomy()
        self.encoder_said, self.llm_said = _Said(), _Said()
        self.encoder = self.llm = self

    def new_context(self, mode: object = None) -> _Said:
        return self.llm_said if mode == "score" else self.encoder_said

    def user_turn(self, text: str, candidates: Sequence[str]) -> tuple[str, bool]:
        return text, False


def _answer(encoder: FloatArray, llm: FloatArray, top_k: int) -> tuple[Classification, Classification]:
    """The encoder's answer and the served one for a ticket with these opinions."""
    models = _Models(top_k)
    proposed = models.encoder_said.answer = _encoder_answer(encoder)
    models.llm_said.among = llm
    context = CandidatesContext(cast(CandidatesEngine, models))
    answer = context.classify(ClassifyRequest(0, "a ticket", math.inf))
    assert answer.model == LLM and models.llm_said.asked == [list(proposed.scores)[:top_k]]
    return proposed, answer


def _generated(
    seed: int, count: int, encoder_alpha: float, llm_alpha: float, top_k: int
) -> list[tuple[FloatArray, FloatArray]]:
    """`count` pairs of opinions: the encoder's over all of `LABELS`, the LLM's over `top_k` candidates, each
    from a Dirichlet (a large alpha: a flat, unsure opinion; a small one: a peaked one)."""
    rng = np.random.default_rng(seed)
    return [
        (rng.dirichlet([encoder_alpha] * len(LABELS)), rng.dirichlet([llm_alpha] * top_k))
        for _ in range(count)
    ]


@pytest.mark.parametrize("top_k", [2, 3, 5])
def test_where_both_models_are_unsure_the_confidence_is_low(top_k: int) -> None:
    """Flat opinions, both: the served confidence stays near the encoder's own (a few per cent over 77
    intents), far under 1/k, which renormalising over the k candidates made its floor."""
    for encoder, llm in _generated(7 + top_k, 300, encoder_alpha=2.0, llm_alpha=20.0, top_k=top_k):
        proposed, answer = _answer(encoder, llm, top_k)
        assert proposed.confidence < 0.15 and llm.max() < 0.5 + 0.5 / top_k  # both unsure
        assert answer.confidence < 0.15 < 1.0 / top_k


@pytest.mark.parametrize("top_k", [2, 3, 5])
@pytest.mark.parametrize(("encoder_alpha", "llm_alpha"), [(0.05, 0.3), (0.3, 3.0), (2.0, 0.3), (0.05, 20.0)])
def test_the_confidence_is_a_probability_over_the_whole_taxonomy(
    top_k: int, encoder_alpha: float, llm_alpha: float
) -> None:
    """Whatever the opinions: the answer is a candidate, its confidence its score and the best of them; the
    candidates' scores sum to the encoder's mass on them and every score to at most 1; the LLM can raise the
    encoder's probability of an answer by at most its own best-to-worst ratio among the candidates."""
    for encoder, llm in _generated(top_k, 200, encoder_alpha, llm_alpha, top_k):
        proposed, answer = _answer(encoder, llm, top_k)
        candidates = list(proposed.scores)[:top_k]
        mass = sum(proposed.scores[label] for label in candidates)
        assert answer.intent in candidates and answer.confidence == answer.scores[answer.intent]
        assert answer.confidence >= max(answer.scores.values()) - 1e-12
        assert sum(answer.scores[label] for label in candidates) == pytest.approx(mass, rel=1e-9)
        assert answer.confidence <= mass + 1e-12 and sum(answer.scores.values()) <= 1.0 + 1e-9
        chosen = candidates.index(answer.intent)
        lifted = proposed.scores[answer.intent] * llm[chosen] / llm.min()
        assert answer.confidence <= lifted * (1 + 1e-9)
        # Labels outside the candidates keep the encoder's probabilities.
        for label in set(proposed.scores) - set(candidates):
            assert answer.scores[label] == proposed.scores[label]


@pytest.mark.parametrize("top_k", [2, 5])
def test_an_llm_that_cannot_tell_the_candidates_apart_leaves_the_encoder_s_confidence(top_k: int) -> None:
    for encoder, _ in _generated(3, 100, encoder_alpha=0.3, llm_alpha=1.0, top_k=top_k):
        proposed, answer = _answer(encoder, np.full(top_k, 1.0 / top_k), top_k)
        assert answer.intent == proposed.intent
        assert answer.confidence == pytest.approx(proposed.confidence, rel=1e-9)


def test_an_llm_agreeing_with_the_encoder_s_first_choice_never_lowers_its_confidence() -> None:
    for encoder, llm in _generated(5, 200, encoder_alpha=0.2, llm_alpha=1.0, top_k=3):
        proposed, answer = _answer(encoder, np.sort(llm)[::-1], 3)  # its best: the encoder's first
        assert answer.intent == proposed.intent
        assert answer.confidence >= proposed.confidence * (1 - 1e-9)
