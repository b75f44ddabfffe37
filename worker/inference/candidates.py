"""An escalation stage where the encoder stage proposes and an LLM decides: the encoder's `top_k` best
intents, with their descriptions, are listed in the LLM's user turn, and the LLM's answer is scored over
them alone.

Why: a small instruction model is a poor 77-way classifier on its own (9-23 % on BANKING77 for 135M-0.5B
models, issue #45), but deciding among a few candidates with their descriptions is an easier question, and
the encoder's top few usually hold the right intent. Whether it pays is measured per model and taxonomy
(`make bench-llm-topk`, results/llm-topk.md).

The LLM runs as score mode does (worker/inference/engine.py): its system prompt (the taxonomy's
instructions; no intent list, the candidates are in the user turn) is prefilled once per context and reused
with `rewind_to`; each candidate label's tokens after `{"intent": "` are scored and the probabilities
renormalised over the k candidates (`Context.score_among`). The LLM only says how the k compare: whether
the right intent is among them at all is the encoder's estimate, its probability mass on them (`weighed`).
That mass is shared among the k by both opinions, the LLM's probabilities times the encoder's
(independent ones: measured better than the LLM's alone on every row of the bench), so `confidence` is a
probability over the whole taxonomy: never above the encoder's mass on the k, the encoder's own where the
LLM cannot tell them apart, and low where both are unsure (renormalised over the k alone it was never under
1/k: 0.5 for the default two). `scores` are the k with those probabilities and the encoder's other top
labels with its own; the answer is always one of the candidates.

The encoder's answer stands, with its own `model`, when the LLM cannot add anything in time: a ticket the
encoder answers as a fallback or out of scope, one whose time left is under the LLM's recent slowest turn
(`RecentTurns`), one whose deadline passes while the LLM scores, or an LLM error. So a record's `model` says
which of the two decided (the LLM's id, or the encoder stage's), and its `latency_ms` what the ticket spent
here: the LLM's time included when it ran and gave no answer. A turn its deadline cut short counts among the
LLM's turns with the time it took, so an LLM slower than the deadlines is learnt as slow and skipped.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np
import structlog

from worker.classification import Classification, ClassifyRequest
from worker.errors import UserError
from worker.inference.encoder import EncoderEngine
from worker.inference.engine import DeadlineExceeded, FloatArray, GenAIEngine
from worker.inference.escalation import check_candidates_llm
from worker.inference.prompt import normalize, truncate_ticket
from worker.inference.taxonomy import Intent, Taxonomy
from worker.settings import InferenceSettings

log = structlog.get_logger(__name__)

CANDIDATES_HEADING = "Candidate intents (answer with one of them):"
# The LLM's recent turns kept to judge whether a ticket's time left affords one more, and for how long.
_RECENT_TURNS = 32
_TURN_MAX_AGE_S = 30.0


def candidates_turn(ticket: str, intents: Sequence[Intent]) -> str:
    """The LLM's user turn: the ticket, then the candidate intents with their descriptions, best first."""
    lines = "\n".join(f"- {intent.name}: {intent.description}" for intent in intents)
    return f"{ticket}\n\n{CANDIDATES_HEADING}\n{lines}"


def weighed(encoder: Mapping[str, float], candidates: Sequence[str], llm: FloatArray) -> dict[str, float]:
    """The answer's scores, best first: the `candidates` (some of the encoder's `scores`, each > 0) with the
    encoder's probability mass on them shared by both opinions (the LLM's probabilities among them, `llm`,
    times the encoder's), then the encoder's other labels as it had them. Each is a probability over the
    whole taxonomy; the first is always a candidate (each candidate's share of the mass is at least the mass
    over k, so at least any other label's; on a tie the candidate comes first)."""
    prior = np.array([encoder[label] for label in candidates], dtype=np.float64)
    joint = np.asarray(llm, dtype=np.float64) * prior
    total = joint.sum()
    shared = joint / total if total > 0.0 else prior / prior.sum()  # an LLM that put nothing on any of them
    scores = {label: float(p) for label, p in zip(candidates, prior.sum() * shared, strict=True)}
    for label, p in encoder.items():
        scores.setdefault(label, p)
    chosen = set(candidates)
    return dict(sorted(scores.items(), key=lambda item: (-item[1], item[0] not in chosen)))


def _candidates_budget(taxonomy: Taxonomy, top_k: int) -> int:
    """Tokens enough for the longest candidate block of `top_k` intents (a token is at least one character,
    so the block's characters bound its tokens)."""
    lines = sorted((len(f"- {i.name}: {i.description}\n") for i in taxonomy.intents), reverse=True)
    return len(f"\n\n{CANDIDATES_HEADING}\n") + sum(lines[:top_k])


class RecentTurns:
    """The LLM's recent turns, in seconds: the slowest of those younger than `max_age_s` is what a ticket's
    time left must afford (0 before the first). A turn its ticket's deadline cut short counts with the time
    it had taken, the least the LLM needed: left out, an LLM slower than every deadline was never learnt as
    slow, and each ticket escalated to it waited out its deadline for the encoder's answer. Turns age out, as
    the cascade's own estimate's do (`StageLatency`, worker/pipeline/triage/cascade.py): tickets the LLM is
    skipped for add none, so one slow turn would otherwise keep it skipped for good."""

    def __init__(self, window: int = _RECENT_TURNS, max_age_s: float = _TURN_MAX_AGE_S) -> None:
        self._turns: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._max_age_s = max_age_s

    def observe(self, now: float, seconds: float) -> None:
        self._turns.append((now, seconds))

    def slowest(self, now: float) -> float:
        while self._turns and now - self._turns[0][0] > self._max_age_s:
            self._turns.popleft()
        return max((seconds for _, seconds in self._turns), default=0.0)


class CandidatesEngine:
    """The encoder stage of `settings.model` and the LLM of `settings.escalation_llm`, with the stage's
    `taxonomy` from `taxonomy_path`; `new_context` as the other engines have. A UserError when either cannot
    serve (see `check_candidates_llm`; in score mode an LLM trained for other labels is refused too)."""

    def __init__(self, settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path) -> None:
        llm_settings = settings.candidates_llm_settings()
        if llm_settings is None:
            raise UserError("the escalation stage has no inference.escalation_llm")
        check_candidates_llm(settings, llm_settings.model)
        self.settings = settings
        self.taxonomy = taxonomy
        self.top_k = settings.escalation_top_k
        self.encoder = EncoderEngine(settings, taxonomy, taxonomy_path)
        budgets = [settings.max_ticket_tokens, taxonomy.prompt.max_ticket_tokens]
        self.ticket_tokens = min(b for b in budgets if b is not None)
        # The LLM's user turn is the ticket and the candidates: the engine sizes its cache for that budget,
        # and its system prompt lists no intents (the candidates are in the user turn).
        turn_tokens = self.ticket_tokens + _candidates_budget(taxonomy, self.top_k)
        llm_settings = msgspec.structs.replace(llm_settings, max_ticket_tokens=turn_tokens)
        prompt = msgspec.structs.replace(taxonomy.prompt, list_intents=False, max_ticket_tokens=turn_tokens)
        self.llm = GenAIEngine(llm_settings, msgspec.structs.replace(taxonomy, prompt=prompt), taxonomy_path)
        self.model_id = self.llm.model_id
        self._intents = {intent.name: intent for intent in taxonomy.intents}

    def new_context(self, mode: object = None) -> CandidatesContext:
        return CandidatesContext(self)

    def user_turn(self, text: str, candidates: Sequence[str]) -> tuple[str, bool]:
        """The LLM's user turn for ticket `text` and the candidate labels, normalised as the taxonomy says,
        and whether the ticket was cut: it is cut to its own budget first, so the candidates never are."""
        ticket = normalize(text, self.taxonomy.prompt.ticket_normalization)
        ticket, truncated = truncate_ticket(ticket, self.llm.tokenizer, self.ticket_tokens)
        turn = candidates_turn(ticket, [self._intents[label] for label in candidates])
        return normalize(turn, self.taxonomy.prompt.ticket_normalization), truncated


class CandidatesContext:
    """Classifies one ticket at a time: the encoder's answer, then the LLM's choice among its top candidates
    (the `Context` interface of the pools; not thread-safe: one per thread)."""

    def __init__(self, engine: CandidatesEngine) -> None:
        self.engine = engine
        self._encoder = engine.encoder.new_context()
        self._llm = engine.llm.new_context("score")
        self._turns = RecentTurns()

    @property
    def expected_llm_s(self) -> float:
        """The LLM's slowest recent turn (0 before the first; see `RecentTurns`): a ticket with less time
        left keeps the encoder's answer, which would otherwise most likely be lost to the deadline."""
        return self._turns.slowest(time.monotonic())

    def classify(self, request: ClassifyRequest) -> Classification:
        """Never raises; see the module for when the encoder's answer stands."""
        started = time.monotonic()
        proposed = self._encoder.classify(request)
        candidates = [label for label, p in proposed.scores.items() if p > 0.0][: self.engine.top_k]
        if proposed.fallback or proposed.out_of_scope or len(candidates) < 2:
            return proposed
        llm_started = time.monotonic()
        if request.deadline - llm_started < self.expected_llm_s:
            return proposed
        try:
            turn, truncated = self.engine.user_turn(request.text, candidates)
            llm = self._llm.score_among(turn, candidates, request.deadline)
        except DeadlineExceeded:
            now = time.monotonic()
            self._turns.observe(now, now - llm_started)  # the LLM needs at least this long
            return _encoder_stands(proposed, started, now)
        except Exception:
            log.exception("candidates llm error", request_id=request.request_id)
            return _encoder_stands(proposed, started, time.monotonic())
        now = time.monotonic()
        self._turns.observe(now, now - llm_started)
        # Both opinions, as independent ones: measured better than the LLM's alone (make bench-llm-topk).
        scores = weighed(proposed.scores, candidates, llm)
        intent = next(label for label in scores if label in candidates)
        return msgspec.structs.replace(
            proposed,
            intent=intent,
            priority=self.engine.taxonomy.policy_priority(intent),
            confidence=scores[intent],
            scores=scores,
            model=self.engine.model_id,
            latency_ms=(now - started) * 1000.0,
            truncated=proposed.truncated or truncated,
        )


def _encoder_stands(proposed: Classification, started: float, now: float) -> Classification:
    """The encoder's answer, after the LLM ran and gave none: its `model`, with the stage's whole time."""
    return msgspec.structs.replace(proposed, latency_ms=(now - started) * 1000.0)
