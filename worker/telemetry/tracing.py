"""Per-ticket OpenTelemetry traces, sent over OTLP (docs/operations.md#tracing): the tracer behind the loop's
`worker.pipeline.tracing` seam.

`tracing_for(settings, consumer_group)` is called once where a door is assembled. Off (the default) it
returns the pipeline's `NO_TRACING` without importing OpenTelemetry at all; on (`[tracing] exporter = "otlp"`,
or the standard `OTEL_TRACES_EXPORTER=otlp`) it builds an SDK `TracerProvider` whose `BatchSpanProcessor`
exports on its own thread, so the loop never waits for the collector. What `[tracing]` leaves unset comes
from the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`,
`OTEL_TRACES_SAMPLER(_ARG)`, `OTEL_SERVICE_NAME`, ...), as the SDK reads them.

In `spans.py` (imported only when tracing is on), each taken record gets a CONSUMER span `process <topic>`
with the messaging conventions' attributes, parented on the producer's context in its `traceparent` header;
the loop's steps are its children (see `worker/pipeline/tracing.py`). Spans are started with an explicit
parent and held on the ticket's work object, never made "current": 64 tickets in flight finish in any order.
Spans carry positions, model ids, step names, reasons and buckets only: never the ticket's text, its key
(whatever `privacy.detect` says) or its other headers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from worker.errors import UserError
from worker.pipeline.tracing import NO_TRACING, Tracing
from worker.settings import TracingSettings

MISSING_EXTRA = (
    "tracing is on ({why}) but OpenTelemetry is not installed: pip install 'triage-worker[otel]' ({error})"
)


def enabled_by(settings: TracingSettings, environ: Mapping[str, str]) -> str | None:
    """What turns tracing on (`tracing.exporter` or `OTEL_TRACES_EXPORTER`), or None: off.
    `OTEL_SDK_DISABLED=true` turns it off whatever else says, as in every OpenTelemetry SDK."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if settings.exporter == "otlp":
        return 'tracing.exporter = "otlp"'
    exporters = {name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",")}
    return "OTEL_TRACES_EXPORTER=otlp" if "otlp" in exporters else None


def tracing_for(
    settings: TracingSettings,
    consumer_group: str | None,
    environ: Mapping[str, str] = os.environ,
    *,
    replay: bool = False,
) -> Tracing:
    """The door's tracer: `NO_TRACING` when tracing is off (nothing of OpenTelemetry imported), else spans
    exported over OTLP. `consumer_group`: the Kafka door's group (None: an offline door, which reads no
    topic); `replay`: the records are dead letters replayed, each span a trace of its own linked to the
    original ticket's. Raises UserError (one line) when tracing is on and the `otel` extra is not installed,
    or the protocol is one the worker does not send."""
    why = enabled_by(settings, environ)
    if why is None:
        return NO_TRACING
    try:
        from opentelemetry.sdk.trace import TracerProvider  # noqa: F401 (checks the extra is there)

        from worker.telemetry.spans import OtelTracing, provider_for
    except ImportError as error:
        raise UserError(MISSING_EXTRA.format(why=why, error=error)) from None
    return OtelTracing(provider_for(settings, environ), consumer_group, replay=replay)
