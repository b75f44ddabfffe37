"""The Prometheus families the worker exports: read from the pipeline's plain counters and histograms
(`worker/pipeline/metrics.py`) when Prometheus scrapes, on the server's thread; label values known in
advance are exported at 0 from the first scrape; the model processes' CPU and memory, per pool."""

from __future__ import annotations

import collections
import os
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from worker.kafka.dead_letters import ERROR_TYPES
from worker.messages import FallbackReason
from worker.pipeline.metrics import (
    SHADOW_DROP_REASONS,
    SKIP_REASONS,
    EscalationMetrics,
    LatencyHistogram,
    ReviewMetrics,
    ShadowMetrics,
)
from worker.pipeline.side_topics.side_topic import DeliveryCounts
from worker.privacy.detector import KINDS
from worker.telemetry.probes import WorkerProbes

# Label values known in advance: exported at 0 from the first scrape.
FALLBACK_REASONS: tuple[str, ...] = typing.get_args(FallbackReason)


_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("triage_consumed", "consumed", "Records taken from the input topic."),
    (
        "triage_redelivered",
        "redelivered",
        "Records delivered again for an offset already in flight (skipped).",
    ),
    ("triage_classified", "classified", "Tickets the model classified (not fallbacks)."),
    (
        "triage_out_of_scope",
        "out_of_scope",
        "Results answered 'none of these': the ticket fits none of the taxonomy's intents.",
    ),
    ("triage_produced", "produced", "Results and dead letters the broker acknowledged."),
    ("triage_delivery_failed", "delivery_failed", "Results or dead letters whose delivery failed for good."),
    ("triage_committed", "committed", "Input offsets released by a confirmed commit."),
    ("triage_commit_failed", "commit_failed", "Commits that failed."),
    ("triage_transactions", "transactions", "Exactly-once: transactions committed."),
    ("triage_transactions_aborted", "transactions_aborted", "Exactly-once: transactions aborted and redone."),
    ("triage_discarded_after_revoke", "discarded_after_revoke", "Answers dropped: their partition moved."),
    (
        "triage_headers_left_off",
        "headers_left_off",
        "Input headers left off triage records (over pipeline.max_header_bytes).",
    ),
    ("triage_partitions_revoked", "revoked", "Partitions revoked by rebalances."),
    ("triage_partitions_lost", "lost", "Partitions lost (the group moved on without this worker)."),
    ("triage_max_poll_exceeded", "max_poll_exceeded", "Times the consumer left the group for not polling."),
)


class PipelineCollector(Collector):
    """Prometheus families built from `PipelineMetrics` at scrape time."""

    def __init__(self, probes: WorkerProbes, info: dict[str, str]) -> None:
        self._probes = probes
        self._info = info

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("triage_worker", "Build and model of this worker.")
        info.add_metric([], self._info)
        yield info
        yield gauge(
            "triage_pool_contexts",
            "Inference contexts configured (worker processes or batchers).",
            self._probes.pool_contexts,
        )
        yield gauge(
            "triage_pool_ready_contexts",
            "Contexts loaded and warmed (0 while the pool starts).",
            self._probes.warm_contexts,
        )
        yield by_label(
            "triage_reloads", "Hot reloads of the model, by outcome.", "outcome", (), self._probes.reloads
        )
        pending = self._probes.restart_pending
        yield gauge(
            "triage_restart_pending",
            "Settings changed in the configuration that only a restart applies (0: none; see "
            "triage_config_restart_pending).",
            len(pending),
        )
        per_setting = GaugeMetricFamily(
            "triage_config_restart_pending",
            "1 for each setting changed in the configuration that only a restart applies.",
            labels=["setting"],
        )
        for setting in pending:
            per_setting.add_metric([setting], 1)
        yield per_setting
        metrics = self._probes.metrics
        if metrics is None:
            return
        for name, attribute, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(metrics, attribute))
        yield gauge(
            "triage_out_of_scope_expected_ratio",
            "The share of in-scope tickets the serving out-of-scope detector was fitted to answer 'none of "
            "these' at most (its folder's card); 0: no detector serves. Against triage_out_of_scope_total / "
            "triage_classified_total: far above it means drift or new intents.",
            self._probes.out_of_scope_promise or 0.0,
        )
        yield by_label(
            "triage_fallbacks",
            "Tickets answered with the fallback label, by reason.",
            "reason",
            FALLBACK_REASONS,
            metrics.fallback,
        )
        yield by_label(
            "triage_dead_letters",
            "Records sent to the dead-letter topic, by error type.",
            "error_type",
            ERROR_TYPES,
            metrics.dead_lettered_by_type,
        )
        if metrics.queue is not None:
            yield by_label(
                "triage_queue_acknowledgements",
                "Queue mode: records acknowledged to the share group, by type (accept: its record written; "
                "reject: dead-lettered; release: handed out again).",
                "type",
                ("accept", "reject", "release"),
                {
                    "accept": metrics.queue.accepted,
                    "reject": metrics.queue.rejected,
                    "release": metrics.queue.released,
                },
            )
        yield CounterMetricFamily(
            "triage_pii_tickets", "Tickets in which personal data was found.", value=metrics.pii_tickets
        )
        yield by_label(
            "triage_pii_detections",
            "Personal data found in tickets, by kind (each occurrence; docs/privacy.md).",
            "kind",
            KINDS,
            metrics.pii_found,
        )
        yield histogram(
            "triage_end_to_end_latency_seconds",
            "Poll to broker acknowledgement of the ticket's result or dead letter.",
            metrics.end_to_end,
        )
        yield histogram(
            "triage_model_latency_seconds",
            "Model time per ticket, as the engine reports it.",
            metrics.model_latency,
        )
        yield histogram(
            "triage_queue_wait_seconds", "Poll to hand-over to the inference pool.", metrics.queue_wait
        )
        yield gauge("triage_in_flight", "Tickets between poll and confirmed commit.", metrics.in_flight)
        yield gauge("triage_in_flight_max", "Highest in-flight count seen.", metrics.in_flight_max)
        yield gauge(
            "triage_backpressure", "1 while consumption is paused at max_in_flight.", int(metrics.paused)
        )
        gauges = metrics.partitions
        yield gauge("triage_assigned_partitions", "Partitions assigned to this worker.", len(gauges.assigned))
        yield gauge("triage_paused_partitions", "Assigned partitions paused.", len(gauges.paused))
        yield gauge(
            "triage_blocked_partitions", "Partitions stopped by a failed delivery (need a restart).",
            len(gauges.blocked),
        )  # fmt: skip
        blocked = GaugeMetricFamily(
            "triage_partition_blocked",
            "1 for each partition stopped by a failed delivery, by name (what TriagePartitionBlocked names).",
            labels=["topic", "partition"],
        )
        for topic, partition in gauges.blocked:
            blocked.add_metric([topic, str(partition)], 1)
        yield blocked
        yield gauge("triage_group_member", "1 once the consumer has joined its group.", int(gauges.member))
        hanging = GaugeMetricFamily(
            "triage_hanging_transaction_suspected",
            "1 for each partition whose last stable offset has stayed behind its end longer than a live "
            "transaction may stay open (exactly-once; see triage-worker broker transactions).",
            labels=["topic", "partition"],
        )
        for topic, partition in metrics.hanging:
            hanging.add_metric([topic, str(partition)], 1)
        yield hanging
        lag = GaugeMetricFamily(
            "triage_consumer_lag",
            "Log end offset (as of the last fetch) minus the next offset this worker reads, per partition.",
            labels=["topic", "partition"],
        )
        for (topic, partition), value in gauges.lag:
            lag.add_metric([topic, str(partition)], value)
        yield lag
        yield gauge(
            "triage_loop_last_turn_age_seconds", "Seconds since the consumer loop last turned.",
            self._probes.loop_age(),
        )  # fmt: skip
        if metrics.shadow is not None:
            yield from _shadow_families(metrics.shadow)
        if metrics.escalation is not None:
            yield from _escalation_families(metrics.escalation)
        if metrics.review is not None:
            yield from _review_families(metrics.review)
        if metrics.registry is not None:  # the input format reads a Schema Registry
            yield gauge(
                "triage_schema_registry_waiting_partitions",
                "Partitions held at a record the Schema Registry could not answer for (retried, never lost).",
                len(metrics.registry.waiting),
            )
            retries = CounterMetricFamily(
                "triage_schema_registry_retries",
                "Times a record was held back because the Schema Registry gave no answer about it, by cause "
                "(outage, credentials, registry_error).",
                labels=["cause"],
            )
            for cause, count in metrics.registry.retries_by_cause.items():
                retries.add_metric([cause], count)
            yield retries


def _escalation_families(escalation: EscalationMetrics) -> Iterator[Metric]:
    """The cascade's escalation stage. Intents come from the taxonomy, so the series are bounded by its size
    times the three outcomes; all of them (and both skip reasons) exist from the start at 0."""
    escalated = CounterMetricFamily(
        "triage_escalations",
        "Tickets sent to the escalation stage, by outcome (changed or confirmed the first stage's intent, "
        "or failed: the first answer stood) and the first stage's intent.",
        labels=["outcome", "intent"],
    )
    for (outcome, intent), count in sorted(dict(escalation.escalated).items()):
        escalated.add_metric([outcome, intent], count)
    yield escalated
    yield by_label(
        "triage_escalations_skipped",
        "Tickets under the escalation threshold that kept the first answer: deadline (too little time left) "
        "or overloaded (the stage at its bound, or the first stage under pressure).",
        "reason",
        SKIP_REASONS,
        escalation.skipped,
    )
    yield gauge(
        "triage_escalation_outstanding", "Tickets at the escalation stage now.", escalation.outstanding
    )
    yield histogram(
        "triage_escalation_latency_seconds",
        "Escalation stage turnaround per ticket: submit to answer, as the consumer loop sees it (the gate "
        "compares its p95 with a ticket's time left).",
        escalation.latency,
    )
    yield histogram(
        "triage_escalation_model_latency_seconds",
        "Escalation stage model time per ticket, as its engine reports it.",
        escalation.model_latency,
    )


def _shadow_families(shadow: ShadowMetrics) -> Iterator[Metric]:
    """The shadow model's families. Disagreement is exported per primary intent only (one series per intent
    of the primary's taxonomy, seen so far): by intent pair it could reach the product of the two
    taxonomies' sizes per pod. The pairs are in `triage-worker shadow report` and the metrics log event."""
    yield CounterMetricFamily(
        "triage_shadow_offered", "Classified tickets offered to the shadow model.", value=shadow.offered
    )
    yield by_label(
        "triage_shadow_dropped",
        "Tickets the shadow did not classify: full (at its bound) or shutdown (still at it on stop).",
        "reason",
        SHADOW_DROP_REASONS,
        shadow.dropped,
    )
    yield CounterMetricFamily(
        "triage_shadow_agreed", "Shadow classifications with the primary's intent.", value=shadow.agreed
    )
    by_primary: collections.Counter[str] = collections.Counter()
    for (primary, _), count in list(shadow.disagreed.items()):
        by_primary[primary] += count
    yield by_label(
        "triage_shadow_disagreed",
        "Shadow classifications with another intent than the primary's, by the primary's intent.",
        "primary_intent",
        (),
        by_primary,
    )
    yield by_label(
        "triage_shadow_fallbacks",
        "Shadow answers that were fallbacks (not compared).",
        "reason",
        FALLBACK_REASONS,
        shadow.fallback,
    )
    yield from _side_topic_deliveries("shadow", "Side records", shadow)
    yield gauge("triage_shadow_outstanding", "Tickets at the shadow model now.", shadow.outstanding)
    yield histogram(
        "triage_shadow_latency_seconds", "Shadow model time per ticket, as its engine reports it.",
        shadow.latency,
    )  # fmt: skip


def _review_families(review: ReviewMetrics) -> Iterator[Metric]:
    """Results sent to the review topic, by intent (the taxonomy bounds the labels) and reason."""
    sent = CounterMetricFamily(
        "triage_review_sent", "Results also sent to the review topic.", labels=["intent", "reason"]
    )
    for (intent, reason), count in sorted(dict(review.sent).items()):
        sent.add_metric([intent, reason], count)
    yield sent
    yield from _side_topic_deliveries("review", "Review records", review)


def _side_topic_deliveries(name: str, records: str, counts: DeliveryCounts) -> Iterator[Metric]:
    """The two delivery counters every side topic keeps (worker/pipeline/side_topics/side_topic.py)."""
    yield CounterMetricFamily(
        f"triage_{name}_produced", f"{records} the broker acknowledged.", value=counts.produced
    )
    yield CounterMetricFamily(
        f"triage_{name}_delivery_failed", f"{records} not sent or not acknowledged.",
        value=counts.delivery_failed,
    )  # fmt: skip


def by_label(
    name: str, doc: str, label: str, known: Iterable[str], counts: Mapping[str, int]
) -> CounterMetricFamily:
    """A counter family with every `known` label value (at 0 until it happens: a `rate()` alert sees a
    series from the start, not a jump from nothing) and any other value counted."""
    family = CounterMetricFamily(name, doc, labels=[label])
    values = dict(counts)  # a copy: the consumer thread may add a key meanwhile
    for value in sorted({*known, *values}):
        family.add_metric([value], values.get(value, 0))
    return family


def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def histogram(name: str, doc: str, histogram: LatencyHistogram) -> HistogramMetricFamily:
    """A histogram family; a bucket that a sampled ticket's observation fell in carries the latest such as
    its exemplar (its `trace_id` and `span_id`), which only the OpenMetrics format shows."""
    counts, total = histogram.snapshot()
    buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
    cumulative = 0
    bounds = [*histogram.bounds, float("inf")]
    for bound, count, traced in zip(bounds, counts, histogram.exemplars(), strict=True):
        cumulative += count
        le = "+Inf" if bound == float("inf") else repr(bound)
        if traced is None:
            buckets.append((le, cumulative))
        else:
            buckets.append((le, cumulative, Exemplar(dict(traced.trace_ids), traced.seconds, traced.at)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class ModelProcessCollector(Collector):
    """CPU seconds and resident memory of each model process, read from /proc at scrape time.

    The pool's worker processes do most of the worker's work, and `process_*` covers only the consumer
    process. One series per context (`pool` = primary, shadow or escalation, `context` = its index): a
    restarted model process keeps its context's series, whose CPU counter then starts again from 0 (a reset
    `rate()` handles).
    """

    def __init__(self) -> None:
        # Pool role → a function giving its worker processes' ids now (a reload swaps the pool behind it).
        self.pools: dict[str, Callable[[], list[int]]] = {}

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            "triage_model_process_cpu_seconds",
            "CPU time (user + system) of each model process.",
            labels=["pool", "context"],
        )
        rss = GaugeMetricFamily(
            "triage_model_process_resident_memory_bytes",
            "Resident memory of each model process.",
            labels=["pool", "context"],
        )
        for role, pids in sorted(self.pools.items()):
            for context, pid in enumerate(pids()):
                usage = process_usage(pid)
                if usage is not None:
                    cpu.add_metric([role, str(context)], usage[0])
                    rss.add_metric([role, str(context)], usage[1])
        yield cpu
        yield rss


def process_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of a process from /proc; None when it is gone or /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # The command name (field 2) may hold spaces and parentheses: count fields after its last ")".
            fields = stat.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
        ticks = int(fields[11]) + int(fields[12])  # utime and stime, fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK"), resident_pages * os.sysconf("SC_PAGE_SIZE")
