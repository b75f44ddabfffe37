"""The cascade: the first stage answers every ticket; the ones it is unsure of go to an escalation stage when
their deadline leaves time for it.

The escalation stage is any `Classifier` (its own bounded pool: an encoder stage or another ORT GenAI model,
see worker/inference/). The pipeline asks `gate` for each ticket the first stage classified with a
confidence under `escalate_below` (a fallback is never escalated):

- `deadline`: the ticket's time left is under the stage's recent p95 turnaround (`StageLatency`): the
  answer would most likely come too late, so the first answer stands;
- `overloaded`: the stage already holds `window` tickets (its bound), or the first stage is under pressure
  (`first_stage_pressed`, from the dispatch queue's figures the pipeline passes: it shed a ticket in the last
  `SHED_MEMORY_S`, or the tickets waiting for it would not all start before the earliest of their deadlines).
  Escalations are the first thing shed: never a first-stage ticket's deadline for a second opinion.

Otherwise the ticket goes to the stage and its record waits for the answer. The record then carries the
stage's answer (`stage = "escalation"`, its `model`, `intent`, `confidence`, `scores`), the first stage's
intent and confidence, and the model time of both stages in `latency_ms`. A stage answer that is a fallback
(error, or its own deadline check) leaves the first answer standing (`escalation_skipped = "deadline"` or
`"error"`, the first stage's `model`), its `latency_ms` with the time the stage spent on it added: a stage
too slow for the deadlines shows in the records, not only in `StageLatency`, which counts every turnaround,
those ended by a deadline too. Every ticket still gets exactly one record: an escalated ticket stays in
flight, so rebalances, shutdown and both delivery guarantees treat it like one at the first stage.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec

from worker.classification import Classification, Classifier, ClassifyRequest
from worker.messages import EscalationSkip
from worker.pipeline.metrics import EscalationMetrics
from worker.pipeline.tracing import TraceIds

Result = tuple[int, Classification]

# After the first stage shed a ticket (`overloaded`), escalations stay shed this long.
SHED_MEMORY_S = 1.0


class _Submitted(NamedTuple):
    """A request at the stage: when it was submitted, and its ticket's trace ids (None: not sampled)."""

    at: float
    trace_ids: TraceIds | None


def is_unsure(answer: Classification, escalate_below: float) -> bool:
    """Whether a first-stage answer is one a cascade escalates (fallbacks never are)."""
    return not answer.fallback and answer.confidence < escalate_below


def first_standing(first: Classification, skipped: EscalationSkip | None = None) -> Classification:
    """The record's answer when the first stage's stands (`skipped`: why the gate kept it)."""
    return msgspec.structs.replace(first, stage="first", escalation_skipped=skipped)


class StageLatency:
    """p95 of the escalation stage's recent turnarounds (submit → answer seen by the loop), in seconds.

    Turnaround rather than the stage's own model time: it includes the wait in the stage's pool, which is
    what the ticket's deadline pays. Samples older than `max_age_s` drop out, so a stage that was slow once
    (a burst, a restart) is tried again once the slow samples have aged: skipped tickets give no samples, and
    without ageing one slow minute would stop every escalation for good. Until `min_samples` recent samples
    exist, the `prior_s` measured at start stands in.
    """

    def __init__(
        self, prior_s: float, window: int = 128, max_age_s: float = 30.0, min_samples: int = 8
    ) -> None:
        self._prior_s = prior_s
        self._max_age_s = max_age_s
        self._min_samples = min_samples
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._sorted: list[float] | None = None  # the p95 is recomputed only after a change

    def observe(self, now: float, seconds: float) -> None:
        self._samples.append((now, seconds))
        self._sorted = None

    def p95(self, now: float) -> float:
        while self._samples and now - self._samples[0][0] > self._max_age_s:
            self._samples.popleft()
            self._sorted = None
        if len(self._samples) < self._min_samples:
            return self._prior_s
        if self._sorted is None:
            self._sorted = sorted(seconds for _, seconds in self._samples)
        return self._sorted[min(len(self._sorted) - 1, math.ceil(0.95 * len(self._sorted)) - 1)]


class Cascade:
    """The escalation stage as the pipeline sees it: the gate, the outstanding requests and the records'
    cascade fields. Driven by the consumer's thread only."""

    def __init__(
        self,
        classifier: Classifier,
        escalate_below: float,
        window: int,
        prior_latency_s: float,
        first_contexts: int,
        labels: Sequence[str] = (),
    ) -> None:
        """`window`: most tickets at the stage at once (its bound); `prior_latency_s`: its turnaround as
        measured at start; `first_contexts`: how many tickets the first stage runs at once (for the
        pipeline's pressure estimate); `labels`: the intents to export metrics for from the start."""
        self._classifier = classifier
        self.escalate_below = escalate_below
        self._window = max(1, window)
        self._first_contexts = max(1, first_contexts)
        self._first_shed_at = float("-inf")
        self.latency = StageLatency(prior_latency_s)
        self._submitted: dict[int, _Submitted] = {}  # request id -> when, and its ticket's trace ids
        self.metrics = EscalationMetrics.starting(labels)
        # False while a hot reload runs a first stage whose labels the stage was not started for (the
        # reloader sets it, see worker/app/reload.py): every first answer stands meanwhile.
        self.fits_first_stage = True

    @property
    def model_id(self) -> str:
        return self._classifier.model_id

    @property
    def outstanding(self) -> int:
        return len(self._submitted)

    def unsure(self, answer: Classification) -> bool:
        """Whether the first stage's answer is one the cascade would escalate (fallbacks never are)."""
        return self.fits_first_stage and is_unsure(answer, self.escalate_below)

    def gate(self, time_left_s: float, now: float, first_stage_pressed: bool) -> EscalationSkip | None:
        """Why an unsure ticket with `time_left_s` before its deadline keeps its first answer, or None
        when it goes to the stage."""
        if time_left_s <= 0.0 or time_left_s < self.latency.p95(now):
            return "deadline"
        if first_stage_pressed or len(self._submitted) >= self._window:
            return "overloaded"
        return None

    def first_stage_shed(self, now: float) -> None:
        """The first stage answered a ticket `overloaded`: escalations are shed for `SHED_MEMORY_S`."""
        self._first_shed_at = now

    def first_stage_pressed(
        self, now: float, waiting: int, earliest_deadline: float | None, first_expected_s: float
    ) -> bool:
        """Whether the first stage is under pressure, so that escalations must wait: it shed a ticket within
        `SHED_MEMORY_S`, or the `waiting` tickets (each `first_expected_s` on one of its contexts) would not
        all have started, with an escalation's time added, before the earliest of their deadlines.
        Deliberately pessimistic (EDF serves that earliest one first): a second opinion never costs a first
        answer its deadline."""
        if now - self._first_shed_at < SHED_MEMORY_S:
            return True
        if earliest_deadline is None:
            return False
        drain_s = waiting * first_expected_s / self._first_contexts
        return now + drain_s + self.latency.p95(now) >= earliest_deadline

    def submit(self, request: ClassifyRequest, now: float, trace_ids: TraceIds | None = None) -> None:
        """Send `request` to the stage at `now`; `trace_ids` (a sampled ticket's) go with its latencies."""
        self._submitted[request.request_id] = _Submitted(now, trace_ids)
        self.metrics.outstanding = len(self._submitted)
        self._classifier.submit(request)

    def poll(self, timeout: float, now: Callable[[], float]) -> list[Result]:
        """The stage's answers that are ready (waiting up to `timeout` for the first), with their turnaround
        recorded."""
        answers = list(self._classifier.poll(timeout))
        if answers:
            at = now()
            for request_id, answer in answers:
                submitted = self._submitted.pop(request_id, None)
                trace_ids = None if submitted is None else submitted.trace_ids
                if submitted is not None:
                    self.latency.observe(at, at - submitted.at)
                    self.metrics.latency.observe(at - submitted.at, trace_ids)
                if answer.fallback_reason != "overloaded":  # queued past its deadline: no model time
                    self.metrics.model_latency.observe(answer.latency_ms / 1000.0, trace_ids)
            self.metrics.outstanding = len(self._submitted)
        return answers

    def first_stands(self, first: Classification, skipped: EscalationSkip | None = None) -> Classification:
        """The record's answer when the first stage's stands: confident, a fallback, or `skipped` by the
        gate."""
        if skipped is not None:
            self.metrics.skipped[skipped] += 1
        return first_standing(first, skipped)

    def escalated(self, first: Classification, answer: Classification) -> Classification:
        """The record's answer once the stage answered an escalated ticket."""
        if answer.fallback:
            skipped: EscalationSkip = (
                "deadline" if answer.fallback_reason in ("deadline_exceeded", "overloaded") else "error"
            )
            self.metrics.outcome(first.intent, "failed")
            spent = msgspec.structs.replace(first, latency_ms=first.latency_ms + answer.latency_ms)
            return first_standing(spent, skipped)
        self.metrics.outcome(first.intent, "confirmed" if answer.intent == first.intent else "changed")
        return msgspec.structs.replace(
            answer,
            latency_ms=first.latency_ms + answer.latency_ms,
            truncated=first.truncated or answer.truncated,
            stage="escalation",
            first_intent=first.intent,
            first_confidence=first.confidence,
        )
