"""What a replay reports: each dead letter's outcome (`RecordReport`), the run's summary (`ReplaySummary`,
also as `--json`) and the progress a command draws while it runs (`ReplayObserver`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from worker.settings import mask_secrets


class ReplayOutcome(StrEnum):
    """What happened to one dead letter; the values are the summary's and the JSON's count names."""

    REPLAYED = "replayed"
    SKIPPED_FILTER = "skipped_filter"
    SKIPPED_MAX_REPLAYS = "skipped_max_replays"
    # Written without its key, value and headers (too large for the dead-letter topic): nothing to republish.
    SHRUNK = "shrunk"
    TRANSFORM_SKIPPED = "transform_skipped"
    TRANSFORM_FAILED = "transform_failed"
    # Refused by its target topic for its content (too large, an invalid record): resending cannot help, so it
    # is not republished and stays in the dead-letter topic; the run commits past it.
    REFUSED = "refused"
    PUBLISH_FAILED = "publish_failed"
    UNREADABLE = "unreadable"


# Outcomes of records the selection took (they count for --limit).
SELECTED = frozenset(
    {
        ReplayOutcome.REPLAYED,
        ReplayOutcome.TRANSFORM_SKIPPED,
        ReplayOutcome.TRANSFORM_FAILED,
        ReplayOutcome.REFUSED,
        ReplayOutcome.PUBLISH_FAILED,
    }
)
# Outcomes of records the selection did not match. Until a record matches, the run commits past none of them:
# a run that matched nothing commits nothing, so a filter that was wrong costs a rerun, not the records.
UNMATCHED = frozenset({ReplayOutcome.SKIPPED_FILTER, ReplayOutcome.UNREADABLE})
# Outcomes listed record by record in the report: each one needs a person to look at it.
ATTENTION = frozenset(
    {
        ReplayOutcome.SKIPPED_MAX_REPLAYS,
        ReplayOutcome.SHRUNK,
        ReplayOutcome.TRANSFORM_FAILED,
        ReplayOutcome.REFUSED,
        ReplayOutcome.PUBLISH_FAILED,
        ReplayOutcome.UNREADABLE,
    }
)


@dataclass(frozen=True)
class PartitionPlan:
    """Where one dead-letter partition's replay starts (after the group's committed position) and ends."""

    partition: int
    start: int
    end: int
    committed: int | None


@dataclass(frozen=True)
class RecordReport:
    """One dead letter's outcome, as shown in the dry-run listing and the attention list."""

    partition: int
    offset: int
    outcome: ReplayOutcome
    error_type: str | None
    replay_count: int | None
    target: str | None
    key: bytes | None
    detail: str | None = None
    # A shrunk dead letter's `triage.omitted.bytes`: how large the original was that it no longer carries.
    omitted_bytes: int | None = None


@dataclass
class ReplaySummary:
    """Counts by outcome and by error type, plus the records that need attention."""

    dlq_topic: str
    group: str
    dry_run: bool
    plan: list[PartitionPlan] = field(default_factory=list)
    counts: Counter[ReplayOutcome] = field(default_factory=Counter)
    by_error_type: dict[str, Counter[ReplayOutcome]] = field(default_factory=dict)
    attention: list[RecordReport] = field(default_factory=list)
    # Dry runs list every record they would replay, so ops can see exactly what a real run would send.
    would_replay: list[RecordReport] = field(default_factory=list)
    committed: dict[int, int] = field(default_factory=dict)
    interrupted: bool = False
    elapsed_s: float = 0.0
    guarantee: str = "at_least_once"
    # exactly_once: why the transactional producer could go no further (e.g. fenced by another replay).
    fatal: str | None = None

    def add(self, report: RecordReport) -> None:
        self.counts[report.outcome] += 1
        self.by_error_type.setdefault(report.error_type or "(unreadable)", Counter())[report.outcome] += 1
        if report.outcome in ATTENTION:
            self.attention.append(report)
        elif report.outcome is ReplayOutcome.REPLAYED and self.dry_run:
            self.would_replay.append(report)

    @property
    def failed(self) -> bool:
        return self.counts[ReplayOutcome.PUBLISH_FAILED] > 0

    @property
    def matched_nothing(self) -> bool:
        """Records were read and the selection matched none of them: nothing was committed."""
        return bool(self.counts) and all(outcome in UNMATCHED for outcome in +self.counts)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json``: stable keys, every outcome present (0 when none)."""

        def record(report: RecordReport) -> dict[str, Any]:
            return {
                "partition": report.partition,
                "offset": report.offset,
                "outcome": report.outcome.value,
                "error_type": report.error_type,
                "replay_count": report.replay_count,
                "target": report.target,
                "key": printable(report.key),
                "detail": report.detail,
                "omitted_bytes": report.omitted_bytes,
            }

        return {
            "dlq_topic": self.dlq_topic,
            "group": self.group,
            "dry_run": self.dry_run,
            "guarantee": self.guarantee,
            "interrupted": self.interrupted,
            "fatal": self.fatal,
            "elapsed_s": round(self.elapsed_s, 3),
            "partitions": [
                {"partition": p.partition, "start": p.start, "end": p.end, "committed_before": p.committed}
                for p in self.plan
            ],
            "committed": {str(partition): offset for partition, offset in sorted(self.committed.items())},
            "counts": {outcome.value: self.counts[outcome] for outcome in ReplayOutcome},
            "by_error_type": {
                error_type: {outcome.value: counts[outcome] for outcome in ReplayOutcome}
                for error_type, counts in sorted(self.by_error_type.items())
            },
            "attention": [record(report) for report in self.attention],
            "would_replay": [record(report) for report in self.would_replay],
        }


class ReplayObserver(Protocol):
    """Told about the plan and each settled record, so the CLI can draw progress while the replay runs."""

    def planned(self, plan: list[PartitionPlan]) -> None: ...

    def settled(self, report: RecordReport) -> None: ...


def printable(raw: bytes | None, limit: int = 60) -> str | None:
    if raw is None:
        return None
    text = raw.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fatal_reason(reason: str, fenced: bool, group: str, kafka_config: Mapping[str, str]) -> str:
    """One line for a producer that can go no further, fencing named as what it means for a replay; no
    secret values."""
    reason = mask_secrets(reason, kafka_config)
    if fenced:
        return f"fenced: another replay of group {group} took over its transactional id ({reason})"
    return f"Kafka: the replay's producer failed: {reason}"
