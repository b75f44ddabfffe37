"""The escalation LLM over the encoder stage's top candidates (worker/inference/candidates.py), with real
models: the shipped encoder stage (models/triage-encoder) proposes, the embedded triage-mini (an ORT GenAI
model with one token per intent) decides among its top k."""

from __future__ import annotations

import csv
import math
import time

import msgspec
import pytest

from tools import REPO
from worker.classification import ClassifyRequest
from worker.errors import UserError
from worker.inference.candidates import CandidatesEngine
from worker.inference.escalation import choose_escalation
from worker.inference.loading import model_id, resolve_taxonomy
from worker.inference.pool import Result, open_pool
from worker.settings import DEFAULT_ESCALATION_DIR, DEFAULT_MODEL_DIR, InferenceSettings

FIRST = InferenceSettings(escalation_llm=str(DEFAULT_MODEL_DIR), escalation_top_k=3)


def _stage(top_k: int = 3) -> InferenceSettings:
    """The escalation stage's settings as `run` derives them from the first stage's."""
    taxonomy_path = resolve_taxonomy(FIRST)[1]
    stage = msgspec.structs.replace(FIRST, escalation_top_k=top_k).escalation_settings(str(taxonomy_path))
    assert stage is not None
    return stage


def _texts(count: int) -> list[str]:
    with (REPO / "data" / "banking77" / "test.csv").open(encoding="utf-8") as handle:
        return [row["text"] for row in list(csv.DictReader(handle))[::40][:count]]


@pytest.fixture(scope="module")
def engine() -> CandidatesEngine:
    stage = _stage()
    return CandidatesEngine(stage, *resolve_taxonomy(stage))


def test_the_llm_answers_one_of_the_encoders_top_k_with_its_probability_over_the_taxonomy(
    engine: CandidatesEngine,
) -> None:
    context = engine.new_context()
    encoder = engine.encoder.new_context()
    llm_id = model_id(DEFAULT_MODEL_DIR)
    changed = 0
    for index, text in enumerate(_texts(40)):
        proposed = encoder.classify(ClassifyRequest(index, text, math.inf))
        answer = context.classify(ClassifyRequest(index, text, math.inf))
        candidates = list(proposed.scores)[:3]
        if proposed.out_of_scope:  # "none of these": no candidate to choose among
            assert (answer.model, answer.intent, answer.out_of_scope) == (
                proposed.model,
                proposed.intent,
                True,
            )
            continue
        assert not answer.fallback and answer.model == llm_id
        assert answer.intent in candidates and sorted(answer.scores) == sorted(proposed.scores)
        assert 0.0 < answer.confidence <= 1.0 and answer.confidence == max(answer.scores.values())
        # The candidates share the encoder's mass on them; the other labels keep the encoder's scores.
        mass = sum(proposed.scores[label] for label in candidates)
        assert math.isclose(sum(answer.scores[label] for label in candidates), mass, rel_tol=1e-6)
        assert answer.confidence <= mass + 1e-9
        assert answer.priority == engine.taxonomy.policy_priority(answer.intent)
        changed += answer.intent != proposed.intent
    assert changed > 0  # the LLM decides, it does not echo the encoder


def test_the_answer_weighs_the_llms_probabilities_by_the_encoders(engine: CandidatesEngine) -> None:
    """The served distribution is the LLM's among the k times the encoder's, sharing the encoder's mass on
    the k (a probability over the whole taxonomy, not over the k alone)."""
    context, llm = engine.new_context(), engine.llm.new_context("score")
    for index, text in enumerate(_texts(5)):
        proposed = engine.encoder.new_context().classify(ClassifyRequest(index, text, math.inf))
        if proposed.out_of_scope:  # the encoder's answer stands (see the test above)
            continue
        candidates = list(proposed.scores)[:3]
        alone = llm.score_among(engine.user_turn(text, candidates)[0], candidates)
        weighed = {label: p * proposed.scores[label] for label, p in zip(candidates, alone, strict=True)}
        mass = sum(proposed.scores[label] for label in candidates)
        answer = context.classify(ClassifyRequest(index, text, math.inf))
        for label, value in weighed.items():
            assert answer.scores[label] == pytest.approx(mass * value / sum(weighed.values()), abs=1e-6)


def test_a_ticket_whose_deadline_is_near_keeps_the_encoders_answer(engine: CandidatesEngine) -> None:
    context = engine.new_context()
    text = _texts(1)[0]
    context.classify(ClassifyRequest(0, text, math.inf))  # one LLM turn measured
    assert context.expected_llm_s > 0.0
    proposed = engine.encoder.new_context().classify(ClassifyRequest(1, text, math.inf))
    near = context.classify(ClassifyRequest(2, text, time.monotonic() + context.expected_llm_s / 2))
    assert not near.fallback
    assert (near.model, near.intent, near.scores) == (proposed.model, proposed.intent, proposed.scores)


def test_the_stage_runs_in_a_classifier_pool() -> None:
    stage = _stage(top_k=2)
    with open_pool(stage, *resolve_taxonomy(stage)) as pool:
        assert pool.model_id == model_id(DEFAULT_MODEL_DIR)
        pool.submit(ClassifyRequest(7, "I still have not received my new card", time.monotonic() + 30.0))
        answers: list[Result] = []
        while not answers:
            answers = pool.poll(5.0)
    ((request_id, answer),) = answers
    assert request_id == 7 and not answer.fallback and answer.intent in list(answer.scores)[:2]


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (
            {"escalation_llm": "/nonexistent/llm"},
            "inference.escalation_llm: /nonexistent/llm is not an ORT GenAI model folder",
        ),
        (
            {"escalation": str(DEFAULT_MODEL_DIR)},
            "decides among an encoder stage's candidates, but the escalation stage",
        ),
        ({"escalation": "off"}, "inference.escalation_llm needs the cascade"),
    ],
)
def test_an_llm_that_cannot_decide_is_refused_in_one_line(overrides: dict[str, str], refusal: str) -> None:
    first = msgspec.structs.replace(FIRST, **overrides)
    with pytest.raises(UserError, match=refusal) as raised:
        choose_escalation(first, *resolve_taxonomy(first))
    assert "\n" not in str(raised.value)


def test_without_an_llm_the_stage_is_the_encoder_alone() -> None:
    choice = choose_escalation(InferenceSettings(), *resolve_taxonomy(InferenceSettings()))
    assert choice.settings is not None and choice.settings.candidates_llm_settings() is None
    assert choice.settings.model == str(DEFAULT_ESCALATION_DIR)


def test_a_long_ticket_is_cut_and_the_llm_still_sees_every_candidate() -> None:
    stage = _stage(top_k=5)
    engine = CandidatesEngine(stage, *resolve_taxonomy(stage))
    text = " ".join(["I ordered a new card weeks ago and it never arrived, where is it?"] * 200)
    answer = engine.new_context().classify(ClassifyRequest(0, text, math.inf))
    assert answer.truncated and not answer.fallback
    assert answer.model == model_id(DEFAULT_MODEL_DIR) and len(answer.scores) == 5
