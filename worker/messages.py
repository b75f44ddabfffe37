"""Message contracts: the one source of truth for what crosses Kafka.

`schemas/*.schema.json` are generated from these Structs (`triage-worker schemas --write`) and a test fails
when the files drift from them.
"""

from __future__ import annotations

import datetime
from typing import Annotated, Literal

import msgspec

from worker.privacy.detector import Kind

SCHEMA_VERSION = 1

# A kind of personal data a ticket held (worker/privacy/detector.py); a result's `pii` lists them.
PiiKind = Kind

Priority = Literal["Low", "Medium", "High", "Critical"]
PRIORITIES: tuple[Priority, ...] = ("Low", "Medium", "High", "Critical")

# `expired_on_arrival`: the producer's `metadata.deadline_at` had passed when the worker took the ticket (not
# a capacity problem, unlike `overloaded`).
FallbackReason = Literal[
    "deadline_exceeded", "model_error", "invalid_output", "overloaded", "expired_on_arrival"
]
# The cascade (worker/pipeline/triage/cascade.py): which stage answered a ticket, and why a ticket the first
# stage was unsure of kept its first answer.
Stage = Literal["first", "escalation"]
EscalationSkip = Literal["deadline", "overloaded", "error"]
# Why a ticket was answered "none of these" (worker/inference/out_of_scope.py): no training ticket of any
# intent is near it in the encoder stage's feature space.
OutOfScopeReason = Literal["no_similar_training_ticket"]

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]

# RFC 3339 date-time shape (offset required). The decoder also checks the calendar (no 2024-02-30).
RFC3339_PATTERN = r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"


def _timestamp(description: str) -> msgspec.Meta:
    return msgspec.Meta(
        pattern=RFC3339_PATTERN, description=description, extra_json_schema={"format": "date-time"}
    )


# The metadata key with which a producer asks for an earlier deadline (worker/pipeline/triage/deadlines.py):
# an RFC 3339 timestamp; a value that is not one makes the record a dead letter (`invalid_timestamp`).
DEADLINE_METADATA_KEY = "deadline_at"

# Ids are copied into every triage record: a bound keeps each record small enough for any sane topic limit.
MAX_TICKET_ID_CHARS = 256


class TicketEvent(msgspec.Struct, kw_only=True, frozen=True):
    """A raw support ticket as producers publish it (JSON object; unknown fields are tolerated)."""

    ticket_id: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_TICKET_ID_CHARS,
            description="Producer's id of the ticket (copied into its triage record, hence the limit).",
        ),
    ]
    body: Annotated[
        str,
        msgspec.Meta(
            description="Free text of the ticket; may be empty when `subject` has text (a ticket with "
            "neither is dead-lettered as `empty_ticket`)."
        ),
    ]
    subject: str | None = None
    customer_id: str | None = None
    channel: str | None = None
    created_at: Annotated[str, _timestamp("RFC 3339 timestamp set by the producer.")] | None = None
    metadata: dict[str, str] | None = None


class SourcePosition(msgspec.Struct, kw_only=True, frozen=True):
    """Where the ticket was read from, so a record can be traced back to its input offset."""

    topic: NonEmptyStr
    partition: NonNegativeInt
    offset: NonNegativeInt


class TriageResult(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Exactly one per ticket on the output topic: a classification, or a fallback with its reason.

    The optional fields at the end are written only when set (omit_defaults): the cascade's by a worker that
    runs it, `taxonomy` for a model run with a taxonomy it was not trained for; every other record stays
    byte for byte what it was."""

    schema_version: int
    ticket_id: NonEmptyStr
    intent: NonEmptyStr
    priority: Priority
    confidence: Probability
    fallback: bool
    fallback_reason: FallbackReason | None
    scores: Annotated[dict[str, Probability], msgspec.Meta(description="Top labels and their probabilities.")]
    model: Annotated[str, msgspec.Meta(description="Id of the model that answered.")]
    latency_ms: Annotated[float, msgspec.Meta(ge=0.0)]
    classified_at: Annotated[str, _timestamp("RFC 3339 UTC time the record was made.")]
    source: SourcePosition
    truncated: bool
    pii: Annotated[
        list[PiiKind],
        msgspec.Meta(
            description="Kinds of personal data found in the ticket (empty when none), each once: routers "
            "can send such tickets to a restricted queue without reading them (docs/privacy.md)."
        ),
    ]
    stage: (
        Annotated[
            Stage,
            msgspec.Meta(
                description="Cascade only: the stage that answered (`model`, `intent`, `confidence` and "
                "`scores` are its answer's)."
            ),
        ]
        | None
    ) = None
    first_intent: (
        Annotated[str, msgspec.Meta(min_length=1, description="Escalated tickets: the first stage's intent.")]
        | None
    ) = None
    first_confidence: (
        Annotated[
            float,
            msgspec.Meta(ge=0.0, le=1.0, description="Escalated tickets: the first stage's confidence."),
        ]
        | None
    ) = None
    escalation_skipped: (
        Annotated[
            EscalationSkip,
            msgspec.Meta(
                description="Cascade only: why a ticket under the escalation threshold kept its first answer "
                "(deadline: too little time left; overloaded: the stage or the first stage was at its bound; "
                "error: the stage gave no answer)."
            ),
        ]
        | None
    ) = None
    # Written only when set (omit_defaults), so records of a model and its own taxonomy are unchanged.
    taxonomy: (
        Annotated[
            str,
            msgspec.Meta(
                description="Only when the model ran a taxonomy it was not trained for (generate mode): "
                "that taxonomy's name@label-fingerprint."
            ),
        ]
        | None
    ) = None

    # Written only for a ticket the encoder stage found out of scope ("none of these"): its `intent` is then
    # the taxonomy's out-of-scope intent with confidence 0, and the head's own answer is kept for reviewers.
    out_of_scope: (
        Annotated[
            bool,
            msgspec.Meta(
                description="Only when the ticket fits none of the taxonomy's intents (always true then): "
                "`intent` is the taxonomy's out-of-scope intent and no intent is claimed (confidence 0). "
                "Not a fallback: the model answered."
            ),
        ]
        | None
    ) = None
    out_of_scope_reason: (
        Annotated[OutOfScopeReason, msgspec.Meta(description="Out of scope only: why.")] | None
    ) = None
    nearest_intent: (
        Annotated[
            str,
            msgspec.Meta(min_length=1, description="Out of scope only: the intent the ticket came nearest."),
        ]
        | None
    ) = None
    nearest_confidence: (
        Annotated[
            float,
            msgspec.Meta(ge=0.0, le=1.0, description="Out of scope only: that intent's probability."),
        ]
        | None
    ) = None


class ShadowResult(TriageResult, kw_only=True, frozen=True):
    """On the shadow side topic: the shadow model's TriageResult for a ticket the primary classified, with the
    primary's answer alongside. A subclass rather than an optional field of TriageResult, so the primary's
    output contract (and every byte of its records) stays as it was; a reader of TriageResult ignores the
    extra fields."""

    primary_intent: Annotated[NonEmptyStr, msgspec.Meta(description="The primary model's intent.")]
    primary_priority: Priority
    primary_model: Annotated[str, msgspec.Meta(description="Id of the primary model.")]


ReviewReason = Literal["low_confidence", "fallback", "out_of_scope"]


class ReviewRecord(TriageResult, kw_only=True, frozen=True):
    """On the review side topic: a TriageResult a person should check (its confidence was under
    `review.threshold`, or it was a fallback), with the ticket's text so that a reviewer needs nothing else:
    redacted, but for the kinds of `privacy.keep` (docs/privacy.md). A subclass, like ShadowResult: the
    primary's output contract stays as it was."""

    review_reason: ReviewReason
    body: Annotated[
        str, msgspec.Meta(description="The ticket's body, as the producer sent it but for personal data.")
    ]
    subject: Annotated[
        str | None, msgspec.Meta(description="The ticket's subject, if it had one (redacted as `body`).")
    ] = None


class FeedbackEvent(msgspec.Struct, kw_only=True, frozen=True):
    """A reviewer's verdict on one ticket, on the feedback topic: the intent it should have had.

    The ticket is named by `ticket_id` and found by its `source` position (the review record's) or, for
    tickets that never went to review, carried as `text`; one of the two is required. When a ticket gets
    several, the latest `reviewed_at` wins (the later record on a tie)."""

    schema_version: int = SCHEMA_VERSION
    ticket_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TICKET_ID_CHARS)]
    intent: Annotated[NonEmptyStr, msgspec.Meta(description="The correct intent (a taxonomy label).")]
    priority: Priority | None = None
    source: SourcePosition | None = None
    text: Annotated[str | None, msgspec.Meta(description="The ticket's text, when there is no source.")] = (
        None
    )
    model_intent: Annotated[
        str | None, msgspec.Meta(description="What the model had said; equal to intent for an accept.")
    ] = None
    reviewer: NonEmptyStr
    reviewed_at: Annotated[str, _timestamp("RFC 3339 UTC time of the verdict.")]


def utc_timestamp(moment: datetime.datetime | None = None) -> str:
    """RFC 3339 UTC with milliseconds, e.g. ``2024-05-01T12:30:00.123Z``: every time the worker writes."""
    when = moment or datetime.datetime.now(datetime.UTC)
    return when.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
