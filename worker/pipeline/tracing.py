"""Each ticket's trace as the loop sees it: the seam the OpenTelemetry tracer (`worker/telemetry/tracing.py`)
plugs into, and the default that records nothing.

A taken record gets a `TicketTrace` from the door's `Tracing` (`Engine._take`) and carries it on its `Work`
until it is settled: tickets finish out of order, 64 at a time, so a ticket's spans live on its own work
object and never in a thread's "current" context. The loop's parts mark the steps of the ticket's way on it,
each where the step happens:

- `decode`: from the intake reading the record (`triage/stage.py`) to its ticket or dead-letter reason;
- `queue`: the wait for the model (`triage/dispatch_queue.py`), until it goes there or its deadline passes;
- `model`, `escalation`: from the submit to a stage until its answer is taken (`triage/model_stage.py`);
- `produce`: from its output handed to the settlement (`triage/outputs.py`) to the broker's acknowledgement
  (in input order, exactly once and offline, this includes the wait for the records before it);
- `settle`: from the acknowledgement until a confirmed commit passes its offset, or its share-group
  acknowledgement is sent (`settlements/`).

Nothing of the ticket's text or key is ever handed to a trace: only positions, step names, model ids, reasons
and buckets. With tracing off every call is a no-op on the shared `NO_TRACE` (no OpenTelemetry import).

A sampled ticket's `trace_ids` go with its latency observations (`metrics.LatencyHistogram.observe`), which
export them as OpenMetrics exemplars: the way from a latency spike on the dashboard to the ticket's trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from worker.pipeline.work import Headers, Work

Step = Literal["decode", "queue", "model", "escalation", "produce", "settle"]
# The W3C trace-context headers: the only input headers a trace reads, those an output gets anew, and those a
# dead letter shrunk to fit its topic keeps (its link to the ticket's trace, for replay).
TRACE_HEADERS = ("traceparent", "tracestate")
# What an attribute may hold: never the ticket's text, key or personal data.
Attribute = str | int | float | bool
# A sampled ticket's ids as an exemplar's labels: `trace_id` and `span_id` (its process span's), in hex. Only
# ids: an exemplar is served to whoever scrapes the port.
TraceIds = Mapping[str, str]


class TicketTrace:
    """One ticket's trace (this one records nothing: tracing off). Every method is called on the loop's
    thread; ending a step that is not open, or anything after `finish`, does nothing."""

    recording = False
    # The ids its latency observations carry as exemplars; None: not sampled (always, with tracing off).
    trace_ids: TraceIds | None = None

    def begin(self, step: Step, **attributes: Attribute) -> None:
        """The ticket starts `step` now."""

    def end(self, step: Step, **attributes: Attribute) -> None:
        """The ticket is done with `step` now; `attributes` describe how it went."""

    def outcome(self, kind: str, reason: str) -> None:
        """Something went wrong for the ticket (`kind`: fallback, dead_letter, deadline_expired,
        delivery_failed, given_up): the ticket's span is marked an error, with an event saying `reason`."""

    def headers(self, headers: Headers | None) -> Headers | None:
        """An output's `headers` with the ticket's trace context (W3C `traceparent`) in place of the input's,
        so that whoever reads the triage record or dead letter continues this trace."""
        return headers

    def finish(self) -> None:
        """The ticket is settled (or given up): every step still open ends, then its span."""


NO_TRACE = TicketTrace()


class Tracing:
    """A door's tracer: one `TicketTrace` per taken record (this one: tracing off, `NO_TRACE` for all)."""

    def ticket(self, work: Work) -> TicketTrace:
        """The trace of `work`, taken now (its parent: the producer's context in its `traceparent` header)."""
        return NO_TRACE

    def close(self, timeout_s: float) -> None:
        """At the end of the run: spans not exported yet are sent within `timeout_s`."""


NO_TRACING = Tracing()
