"""The contract between the pipeline and the inference room, without ONNX Runtime: the pipeline imports this.

A `Classifier` takes `ClassifyRequest`s without blocking (`submit`) and hands back one `Classification` per
request (`poll`), in any order; an answer is either a classification or a fallback tagged with its reason.
Every fallback answer, whoever gives it (the engine, the process pool for a dead worker, the pipeline for a
ticket whose deadline passed while it waited), is built by `fallback_answer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from worker.messages import EscalationSkip, FallbackReason, Priority, Stage


def ticket_text(subject: str | None, body: str) -> str:
    """The text a classifier gets for a ticket (a TicketEvent, or a review record that copies one): the
    subject on its own line (when there is one), then the body."""
    return f"{subject}\n{body}" if subject else body


class ClassifyRequest(msgspec.Struct, frozen=True, array_like=True):
    """One ticket to classify; `deadline` is an absolute `time.monotonic()` value (system-wide on Linux,
    so it means the same instant in a worker process)."""

    request_id: int
    text: str
    deadline: float


class Classification(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The answer for one ticket: a classification, or a fallback with its reason."""

    intent: str
    priority: Priority
    confidence: float
    scores: dict[str, float]
    model: str
    latency_ms: float
    truncated: bool
    fallback: bool = False
    fallback_reason: FallbackReason | None = None
    # Set by the cascade (worker/pipeline/triage/cascade.py), never by a classifier; see TriageResult.
    stage: Stage | None = None
    first_intent: str | None = None
    first_confidence: float | None = None
    escalation_skipped: EscalationSkip | None = None
    # Set only when the model runs a taxonomy it was not trained for (generate mode; see
    # worker/inference/pairing.py): that taxonomy's version, carried into the record.
    taxonomy: str | None = None
    # Set by an encoder stage whose folder has out-of-scope statistics (worker/inference/out_of_scope.py):
    # the ticket's out-of-scope score (its distance to the nearest training ticket, plus the head's weighted
    # doubt), and whether it fits none of the intents. When it does, `intent` is the taxonomy's out-of-scope
    # intent and `confidence` 0.0 (no intent is claimed), and the head's answer is kept for reviewers in
    # `nearest_intent` / `nearest_confidence`.
    out_of_scope: bool = False
    out_of_scope_score: float | None = None
    nearest_intent: str | None = None
    nearest_confidence: float | None = None
    # Set only by a process pool (worker/inference/pool.py) on the `model_error` of a request whose worker
    # process died under it, never written into a record: queue mode gives such a ticket another try
    # (another process may well answer it), where a model that raised or answered `model_error` itself is
    # answered `model_error` as in every other door. Last, with its default: the struct crosses the pool's
    # pipes as a msgpack array.
    process_died: bool = False


@dataclass(frozen=True)
class FallbackLabel:
    """The taxonomy's answer when the model gives none."""

    intent: str
    priority: Priority


def fallback_answer(
    reason: FallbackReason,
    label: FallbackLabel,
    model: str,
    latency_ms: float,
    truncated: bool = False,
    process_died: bool = False,
) -> Classification:
    """A fallback claims no confidence and no scores (`process_died`: see `Classification`)."""
    return Classification(
        intent=label.intent,
        priority=label.priority,
        confidence=0.0,
        scores={},
        model=model,
        latency_ms=max(0.0, latency_ms),
        truncated=truncated,
        fallback=True,
        fallback_reason=reason,
        process_died=process_died,
    )


class Classifier(Protocol):
    """What the pipeline needs from an inference pool."""

    @property
    def model_id(self) -> str: ...

    def submit(self, request: ClassifyRequest) -> None:
        """Queue one request; never blocks on the model."""

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        """Answers that are ready, as (request_id, answer); waits up to `timeout` for the first one."""
