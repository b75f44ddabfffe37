"""Each dead letter's outcome, reported once it is final: replay's `Observer` toward its delivery guarantee.

- A record that needs no output (passed over by a filter or the loop bound, or its transform failed or
  skipped it) is reported as the stage settles it.
- A republished record is reported once the broker acknowledged it (at-least-once), or once the transaction
  holding it commits (exactly-once: its report is pending until then; an aborted transaction published
  nothing, and its records are read and reported again).
- A record its target refuses for its content (too large for the topic, an invalid record: the delivery
  rules leave its output out, `DeliveryRules.left_out`) is reported `refused` with why, and the run commits
  past it: sending it again cannot help, and the dead letter stays in the dead-letter topic. Exactly-once,
  the transaction that held it is redone without it.
- A publish that failed otherwise is reported with why, and its partition is read no more in this run: the
  committed position stays before it, so the next run tries it again. Exactly-once, a failed record dooms its
  transaction; it is reported once its partition is stopped for good, or when the redo reads it again (it
  then fails as it did, without another try, or it could loop).

Everything is counted in the run's `ReplaySummary` and passed on to the command's `ReplayObserver` (the
progress bar, the metrics port).
"""

from __future__ import annotations

from collections.abc import Sequence

from confluent_kafka import KafkaError

from worker.kafka.commits import TopicPartitionKey
from worker.kafka.errors import PURGED, describe
from worker.pipeline.settlements.guarantees import Observer
from worker.pipeline.work import Work
from worker.replay.outcomes import SELECTED, RecordReport, ReplayObserver, ReplayOutcome, ReplaySummary
from worker.replay.source import ReplaySource

# A dead letter's position: partition, offset.
Position = tuple[int, int]


class Reports(Observer):
    """The outcomes of one run, into `summary` and on to `observer` (see the module docstring); `source` hears
    which records the run is done with and which partitions are read no more."""

    def __init__(
        self,
        summary: ReplaySummary,
        observer: ReplayObserver | None,
        source: ReplaySource,
        exactly_once: bool,
    ) -> None:
        self.summary = summary
        self._observer = observer
        self._source = source
        self._exactly_once = exactly_once
        # Records the selection took in this run (they count for --limit); after a redo, those that committed
        # transactions hold.
        self.selected = 0
        self._selected_committed = 0
        # Records republished, until their delivery report.
        self._sent: dict[Work, RecordReport] = {}
        # Records whose publish failed (the report says why): not tried again in this run, even after a redo;
        # those reported; and those not reported yet, which the run waits for.
        self._failures: dict[Position, RecordReport] = {}
        self._reported_failures: set[Position] = set()
        self._refused: dict[Position, Work] = {}
        # Exactly-once: outcomes waiting for the transaction that holds them.
        self._pending: list[RecordReport] = []

    # -- what the stage tells -------------------------------------------------------------------------------

    def sending(self, work: Work, report: RecordReport) -> None:
        """`work` is republished now; `report` is its outcome once the broker acknowledged it."""
        self._sent[work] = report

    def passed_over(self, report: RecordReport) -> None:
        """A record that needs no output was settled."""
        self._report(report)

    def failed_before(self, position: Position) -> RecordReport | None:
        """How the publish of the record at `position` failed earlier in this run, if it did."""
        return self._failures.get(position)

    def fail(self, failed: RecordReport) -> None:
        """Report a failed publish; its partition is read no more in this run (a rerun tries it again, and the
        rest of the partition would be sent again by that rerun anyway)."""
        position = (failed.partition, failed.offset)
        self._source.stop_reading(failed.partition)
        self._failures[position] = failed
        self._reported_failures.add(position)
        if (work := self._refused.pop(position, None)) is not None:
            self._source.done_with(work)
        self._record(failed)

    def stopped(self, keys: Sequence[TopicPartitionKey]) -> None:
        """The guarantee stopped these partitions (a record of theirs is refused for good): read no more of
        them, and report their refused records."""
        self._source.pause(keys)
        for _, partition in keys:
            for position, failed in sorted(self._failures.items()):
                if position[0] == partition and position not in self._reported_failures:
                    self.fail(failed)

    def nothing_committed(self) -> None:
        """The selection matched no record, so no transaction ever held the pending reports: they are final as
        they are."""
        for report in self._pending:
            self._record(report)
        self._pending.clear()

    # -- what the guarantee tells (guarantees.Observer) -----------------------------------------------------

    def delivered(self, work: Work, error: KafkaError | None) -> None:
        report = self._sent.pop(work)
        if error is None:
            self._source.done_with(work)
            if not work.orphan:
                self._report(report)
            return
        if error.code() in PURGED:
            return  # its transaction was aborted; the redo reads it again
        # Refused: not sent again in this run, or it could loop.
        failed = _failed(report, error.str())
        position = (report.partition, report.offset)
        self._failures[position] = failed
        if work.orphan:
            return  # of a transaction aborted already: the redo reads it again, and it fails as it did
        self._refused[position] = work
        if not self._exactly_once:
            self.fail(failed)

    def left_out(self, work: Work, error: KafkaError) -> None:
        report = self._sent.pop(work)
        if work.orphan:
            return  # of a transaction aborted already: the redo reads it again, and leaves it out
        self._source.done_with(work)
        self._report(_refused(report, error))

    def committed(self, positions: dict[TopicPartitionKey, int]) -> None:
        by_partition = {partition: position for (_, partition), position in positions.items()}
        self.summary.committed.update(by_partition)
        if self._exactly_once:
            confirmed = [r for r in self._pending if r.offset < by_partition.get(r.partition, 0)]
            self._pending = [r for r in self._pending if r not in confirmed]
            for report in confirmed:
                self._record(report)

    def redone(self, keys: set[TopicPartitionKey]) -> None:
        """The aborted transaction published nothing: its records are read (every partition from its last
        commit, even one read to its end already) and reported again."""
        self._pending.clear()
        self._refused.clear()
        self.selected = self._selected_committed
        self._source.read_again(self.summary.committed)

    # -- outcomes -------------------------------------------------------------------------------------------

    def _report(self, report: RecordReport) -> None:
        """Exactly-once: counted once the transaction holding it commits; else at once."""
        if self._exactly_once:
            self._pending.append(report)
        else:
            self._record(report)

    def _record(self, report: RecordReport) -> None:
        if self._exactly_once and report.outcome in SELECTED:
            self._selected_committed += 1
        self.summary.add(report)
        if self._observer is not None:
            self._observer.settled(report)


def _failed(
    report: RecordReport, detail: str, outcome: ReplayOutcome = ReplayOutcome.PUBLISH_FAILED
) -> RecordReport:
    """`report` (a record sent) as failed (`outcome`), with why."""
    return RecordReport(
        report.partition,
        report.offset,
        outcome,
        report.error_type,
        report.replay_count,
        report.target,
        report.key,
        detail,
    )


def _refused(report: RecordReport, error: KafkaError) -> RecordReport:
    """`report` (a record sent) as refused by its target for its content, with why: `too large for <topic>`
    (the commonest), else `refused by <topic>`, then Kafka's error."""
    why = "too large for" if error.code() == KafkaError.MSG_SIZE_TOO_LARGE else "refused by"
    detail = f"{why} {report.target} ({describe(error)})"
    return _failed(report, detail, ReplayOutcome.REFUSED)
