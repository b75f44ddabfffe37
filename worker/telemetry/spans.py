"""The OpenTelemetry side of per-ticket traces (see `tracing.py`, which imports this module only when tracing
is on: it imports the SDK at once).

`provider_for(settings, environ)` builds the SDK provider and its OTLP exporter; `OtelTracing` gives each
taken record its CONSUMER span `process <topic>` and the spans of its steps (`_Ticket`), started with an
explicit parent and held on the ticket's work object, never made "current": 64 tickets in flight finish in
any order. A ticket the sampler leaves out (`_Unsampled`) records nothing and only passes its context on.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import (
    Link,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker import __version__
from worker.errors import UserError
from worker.pipeline.tracing import TRACE_HEADERS, Attribute, Step, TicketTrace, Tracing
from worker.settings import TracingSettings
from worker.telemetry.tracing import MISSING_EXTRA

if TYPE_CHECKING:
    from worker.pipeline.work import Headers, Work

# How the model steps appear in the GenAI conventions (the worker classifies with a local ONNX Runtime model).
GEN_AI_OPERATION = "classify"
GEN_AI_PROVIDER = "onnxruntime"
# How long the end of a run waits for its last spans at the least (a collector at hand answers in
# milliseconds).
_CLOSE_AT_LEAST_S = 1.0
# The propagator's inject: the context's trace headers written into a carrier.
_Inject = Callable[[dict[str, str], Context], None]


def provider_for(settings: TracingSettings, environ: Mapping[str, str]) -> TracerProvider:
    """An SDK provider exporting in batches on its own thread, sampling parent-based at
    `tracing.sample_ratio` (None: as `OTEL_TRACES_SAMPLER` says)."""
    resource = Resource.create({SERVICE_VERSION: __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "triage-worker"}))
    ratio = settings.sample_ratio
    sampler = None if ratio is None else sampling.ParentBasedTraceIdRatio(ratio)
    provider = TracerProvider(sampler=sampler, resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_exporter(settings, environ)))
    return provider


def _exporter(settings: TracingSettings, environ: Mapping[str, str]) -> SpanExporter:
    protocol = (
        settings.protocol
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc(endpoint=settings.endpoint)
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

            endpoint = settings.endpoint
            return Http(endpoint=None if endpoint is None else f"{endpoint.rstrip('/')}/v1/traces")
    except ImportError as error:
        raise UserError(MISSING_EXTRA.format(why=f"protocol {protocol}", error=error)) from None
    raise UserError(f"OTLP protocol {protocol!r}: the worker sends http/protobuf or grpc")


class OtelTracing(Tracing):
    """Spans of every taken record through `provider` (see the module docstring). `replay`: a record's trace
    context is the original ticket's (a dead letter carries the span that dead-lettered it), so the span
    is linked to it, as the messaging conventions say of a message processed again, rather than its child.

    A record's key is never in a span (the conventions' `messaging.kafka.message.key` is left out): keys are
    often a customer's e-mail address or phone number, and a span goes to a collector outside the
    privacy settings' reach. Showing it only where the privacy detector found nothing made it depend on
    `privacy.detect` (narrowed to cards, an e-mail key was shown) and on the detector's recall; a trace is
    found by its partition and offset instead."""

    def __init__(self, provider: TracerProvider, consumer_group: str | None, *, replay: bool = False) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("worker.pipeline", __version__)
        self._propagator = TraceContextTextMapPropagator()
        self._group = consumer_group
        self._replay = replay

    def ticket(self, work: Work) -> TicketTrace:
        parent = self._propagator.extract(_trace_context(work.headers))
        links: list[Link] = []
        if self._replay:
            original = get_current_span(parent).get_span_context()
            links = [Link(original)] if original.is_valid else []
            parent = Context()  # a trace of its own
        span = self._tracer.start_span(
            f"process {work.topic}", parent, SpanKind.CONSUMER, self._process_attributes(work), links
        )
        context = set_span_in_context(span)
        if not span.is_recording():  # sampled out: only its context goes on, to the outputs
            return _Unsampled(self._propagator.inject, context)
        return _Ticket(self._tracer, span, context, self._propagator.inject)

    def _process_attributes(self, work: Work) -> dict[str, Attribute]:
        """The messaging conventions' attributes of a record's process span: its position, never its key
        (see the class docstring)."""
        attributes: dict[str, Attribute] = {
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": work.topic,
            "messaging.destination.partition.id": str(work.partition),
            "messaging.kafka.offset": work.offset,
        }
        if self._group is not None:
            attributes["messaging.system"] = "kafka"
            attributes["messaging.consumer.group.name"] = self._group
        return attributes

    def close(self, timeout_s: float) -> None:
        """The spans not exported yet are sent on a thread of their own, waited for up to `timeout_s` (at
        least `_CLOSE_AT_LEAST_S`): the SDK's flush waits out the exporter's retries (measured: 6.7 s with
        the collector away), which must not hold a worker's shutdown past its limit. What is not sent by
        then is lost."""
        closing = threading.Thread(target=self._provider.shutdown, name="tracing-close", daemon=True)
        closing.start()
        closing.join(max(_CLOSE_AT_LEAST_S, timeout_s))


def _trace_context(headers: Headers | None) -> dict[str, str]:
    """The record's W3C trace-context headers, the only ones a trace reads (an invalid one is ignored by
    the propagator: the ticket then starts a trace of its own)."""
    return {
        name: value.decode("ascii", errors="replace")
        for name, value in headers or ()
        if name in TRACE_HEADERS and value is not None
    }


class _Injects:
    """What both kinds of ticket traces share: the ticket's context written into an output's headers."""

    def __init__(self, inject: _Inject, context: Context) -> None:
        self._inject, self._context = inject, context

    def carried(self, headers: Headers | None) -> Headers:
        carrier: dict[str, str] = {}
        self._inject(carrier, self._context)
        kept = [(name, value) for name, value in headers or () if name not in TRACE_HEADERS]
        return kept + [(name, value.encode("ascii")) for name, value in carrier.items()]


class _Unsampled(TicketTrace):
    """A ticket the sampler left out: nothing is recorded, its (unsampled) context still goes on."""

    def __init__(self, inject: _Inject, context: Context) -> None:
        self._injects = _Injects(inject, context)

    def headers(self, headers: Headers | None) -> Headers | None:
        return self._injects.carried(headers)


class _Ticket(TicketTrace):
    """One sampled ticket: its process span and the spans of its open steps; the process span's ids are its
    `trace_ids`, the exemplar its latency observations carry."""

    recording = True

    def __init__(self, tracer: Tracer, span: Span, context: Context, inject: _Inject) -> None:
        self._tracer, self._span, self._context = tracer, span, context
        ids = span.get_span_context()
        self.trace_ids = {"trace_id": format(ids.trace_id, "032x"), "span_id": format(ids.span_id, "016x")}
        self._injects = _Injects(inject, context)
        self._steps: dict[Step, Span] = {}
        self._finished = False

    def begin(self, step: Step, **attributes: Attribute) -> None:
        if self._finished:
            return
        self.end(step)
        name, kind, described = _step(step, attributes)
        span_kind = SpanKind.PRODUCER if kind == "producer" else SpanKind.INTERNAL
        self._steps[step] = self._tracer.start_span(name, self._context, span_kind, described)

    def end(self, step: Step, **attributes: Attribute) -> None:
        span = self._steps.pop(step, None)
        if span is None:
            return
        span.set_attributes(_ended(attributes))
        span.end()

    def outcome(self, kind: str, reason: str) -> None:
        if self._finished:
            return
        self._span.add_event(f"triage.{kind}", {"triage.reason": reason})
        if kind != "given_up":  # its next owner (or try) traces it anew: not this ticket's failure
            self._span.set_status(Status(StatusCode.ERROR, f"{kind}: {reason}"))
            self._span.set_attribute("error.type", kind)

    def headers(self, headers: Headers | None) -> Headers | None:
        return self._injects.carried(headers)

    def finish(self) -> None:
        if self._finished:
            return
        for step in list(self._steps):
            self.end(step)
        self._finished = True
        self._span.end()


def _step(step: Step, attributes: Mapping[str, Attribute]) -> tuple[str, str, dict[str, Attribute]]:
    """A step's span name, kind ("internal" or "producer") and starting attributes, from what the loop
    said of it (`model`: the model id; `topic`: an output's topic)."""
    if step in ("model", "escalation"):
        model = str(attributes.get("model", ""))
        return (
            f"{GEN_AI_OPERATION} {model}",
            "internal",
            {
                "gen_ai.operation.name": GEN_AI_OPERATION,
                "gen_ai.provider.name": GEN_AI_PROVIDER,
                "gen_ai.request.model": model,
                "triage.stage": "first" if step == "model" else "escalation",
            },
        )
    if step == "produce":
        topic = str(attributes.get("topic", ""))
        return (
            f"send {topic}",
            "producer",
            {"messaging.operation.type": "send", "messaging.destination.name": topic},
        )
    if step == "settle":
        return "settle", "internal", {"messaging.operation.type": "settle"}
    return ("dispatch queue" if step == "queue" else step), "internal", {}


def _ended(attributes: Mapping[str, Attribute]) -> dict[str, Attribute]:
    """What a step's end says (`model`: the model that answered, `confidence`: bucketed to a tenth,
    `fallback`, `escalated`, `settled_by`)."""
    ended: dict[str, Attribute] = {}
    for name, value in attributes.items():
        if name == "model":
            ended["gen_ai.response.model"] = value
        elif name == "confidence" and isinstance(value, float):
            low = min(9, max(0, math.floor(value * 10)))
            ended["triage.confidence_bucket"] = f"{low / 10:.1f}-{(low + 1) / 10:.1f}"
        else:
            ended[f"triage.{name}"] = value
    return ended
