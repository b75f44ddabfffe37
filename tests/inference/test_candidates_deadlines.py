"""The escalation LLM over the encoder's top candidates (worker/inference/candidates.py) when it is slow: a
turn its ticket's deadline cuts short is counted among its turns, so the next tickets with less time left
skip it, and the answer that stands (the encoder's) says how long the ticket spent at the stage."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import cast

import numpy as np

from worker.classification import Classification, ClassifyRequest
from worker.inference.candidates import CandidatesContext, CandidatesEngine, RecentTurns
from worker.inference.engine import DeadlineExceeded, FloatArray

ENCODER, LLM = "encoder@test", "llm@test"
PROPOSED = Classification(
    intent="card_arrival",
    priority="Medium",
    confidence=0.4,
    scores={"card_arrival": 0.4, "card_lost": 0.3, "lost_or_stolen_card": 0.1},
    model=ENCODER,
    latency_ms=1.0,
    truncated=False,
)


class _Encoder:
    def classify(self, request: ClassifyRequest) -> Classification:
        return PROPOSED


class _SlowLlm:
    """Slower than any deadline: scores until the request's deadline passes (raising as the engine's
    `score_among` does), or answers after `turn_s` when the deadline allows it."""

    def __init__(self, turn_s: float) -> None:
        self.turn_s = turn_s
        self.asked = 0

    def score_among(self, turn: str, labels: Sequence[str], deadline: float = math.inf) -> FloatArray:
        self.asked += 1
        started = time.monotonic()
        while time.monotonic() - started < self.turn_s:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded
            time.sleep(0.005)
        return np.full(len(labels), 1.0 / len(labels))


class _Models:
    """The part of a `CandidatesEngine` a context uses."""

    def __init__(self, llm: _SlowLlm) -> None:
        self.top_k, self.model_id, self._llm = 2, LLM, llm
        self.encoder = self.llm = self
        self.taxonomy = self

    def new_context(self, mode: object = None) -> _SlowLlm | _Encoder:
        return self._llm if mode == "score" else _Encoder()

    def user_turn(self, text: str, candidates: Sequence[str]) -> tuple[str, bool]:
        return text, False

    def policy_priority(self, intent: str) -> str:
        return "High"


def _context(llm: _SlowLlm) -> CandidatesContext:
    return CandidatesContext(cast(CandidatesEngine, _Models(llm)))


def test_a_turn_its_deadline_cut_short_is_learnt_and_the_next_ticket_with_less_time_skips_the_llm() -> None:
    llm = _SlowLlm(turn_s=10.0)
    context = _context(llm)
    cut = context.classify(ClassifyRequest(0, "a ticket", time.monotonic() + 0.3))
    assert llm.asked == 1
    # The encoder's answer stands, and says so: its model, and the whole time the ticket spent here.
    assert (cut.model, cut.intent, cut.confidence, cut.fallback) == (ENCODER, "card_arrival", 0.4, False)
    assert cut.latency_ms >= 300.0
    assert context.expected_llm_s >= 0.29  # at least that slow
    started = time.monotonic()
    skipped = context.classify(ClassifyRequest(1, "a ticket", started + 0.2))
    assert llm.asked == 1 and time.monotonic() - started < 0.15  # not tried: it would not have answered
    assert (skipped.model, skipped.latency_ms) == (ENCODER, PROPOSED.latency_ms)


def test_an_llm_that_answers_in_time_is_the_answer_with_the_stage_s_whole_time() -> None:
    llm = _SlowLlm(turn_s=0.05)
    context = _context(llm)
    answer = context.classify(ClassifyRequest(0, "a ticket", time.monotonic() + 5.0))
    assert answer.model == LLM and answer.latency_ms >= 50.0
    assert 0.04 < context.expected_llm_s < 5.0


def test_recent_turns_are_the_slowest_young_one_and_age_out() -> None:
    turns = RecentTurns(window=4, max_age_s=30.0)
    assert turns.slowest(0.0) == 0.0
    turns.observe(10.0, 2.0)  # one slow turn (cut by its deadline, say)
    turns.observe(20.0, 0.3)
    assert turns.slowest(35.0) == 2.0
    assert turns.slowest(41.0) == 0.3  # the slow one aged out: the LLM is tried again
    assert turns.slowest(51.0) == 0.0
    for at in range(5):
        turns.observe(60.0 + at, float(at))
    assert turns.slowest(65.0) == 4.0  # at most `window` kept
