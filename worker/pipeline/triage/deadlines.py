"""Per-ticket deadlines: when the worker must give up on the model and publish a fallback instead.

A ticket's deadline is its loop's, set once (`Engine._take`): the moment it was taken plus its door's
`Limits.deadline_s` (`pipeline.deadline_ms` for `run`). A producer may ask for an earlier one with the
metadata key ``deadline_at`` (an RFC 3339 timestamp, e.g. a chat session's SLA), applied here, once; a later
one is ignored, so a producer cannot make the worker hold a slot longer than configured. The decoder
dead-letters a ``deadline_at`` that is not an RFC 3339 timestamp (`invalid_timestamp`), so one is never
silently ignored; one already past when the ticket is taken is answered `expired_on_arrival`. Deadlines are
kept on the monotonic clock so that a wall-clock jump cannot expire or prolong every ticket at once.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.decoding import rfc3339_moment
from worker.messages import DEADLINE_METADATA_KEY


def ticket_deadline(
    polled_monotonic: float,
    polled_wall: float,
    deadline: float,
    metadata: Mapping[str, str] | None,
) -> float:
    """Absolute deadline on `time.monotonic()`'s clock for a ticket polled at the given instants whose loop
    gave it `deadline` (on the same clock): that one, or the producer's `deadline_at` when it is earlier."""
    requested = _requested_wall_deadline(metadata)
    if requested is not None:
        deadline = min(deadline, polled_monotonic + (requested - polled_wall))
    return deadline


def _requested_wall_deadline(metadata: Mapping[str, str] | None) -> float | None:
    text = metadata.get(DEADLINE_METADATA_KEY) if metadata else None
    if not text:
        return None
    try:
        # What the decoder accepted, read the same way: lower-case t and z included (issue 55: fromisoformat
        # refused `2024-05-01t12:30:00z`, so the deadline was dropped).
        moment = rfc3339_moment(text)
    except ValueError:
        return None  # the decoder dead-letters such a value (`invalid_timestamp`) before it gets here
    return moment.timestamp()
