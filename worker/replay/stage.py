"""Replay's stage: what becomes of each dead letter taken from the dead-letter topic, all while it is taken.

- Its `triage.*` headers are read (a record without them is `unreadable`), then the filters and the
  max-replay bound (`selection.why_not_replayed`): a record passed over needs no output, and is settled as
  done (`Settlement.done`) and reported. Until the selection matched a record, the records it passed over
  are held instead (taken, not settled: no commit passes them), so that a run that matched nothing commits
  nothing; the first match settles them.
- `--limit`: a selected record past it is not settled and the source reads no more (`ReplaySource.end`),
  so the group's position stays before it for the next run.
- `--transform` repairs the value in its own process (`transforms.TransformProcess`): a failure or a skip
  is that record's outcome; a stop asked for during the call leaves the record unsettled.
- The output goes to the record's source topic (or `--to`) with its original key and headers and
  `triage.replay_count` + 1, through the settlement (a delivery guarantee; a dry run's hands it back at
  once), and spends a `--rate` token (`ReplaySource.republished`); its report waits for the broker
  (`reports.Reports`). A record whose publish failed earlier in this run (read again after an exactly-once
  redo) fails as it did.

Nothing waits here between two turns of the loop: the stage has no model, no queue and no side topic.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from dataclasses import dataclass

from worker.decoding import RegistryUnavailable
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.dead_letters import DeadLetterInfo, read_dead_letter, replay_headers
from worker.messages import FallbackReason
from worker.pipeline.seams import Record, Settlement
from worker.pipeline.work import Output, Work
from worker.replay.outcomes import UNMATCHED, RecordReport, ReplayOutcome
from worker.replay.reports import Reports
from worker.replay.selection import ReplayOptions, not_kept, why_not_replayed
from worker.replay.source import ReplaySource
from worker.replay.transforms import TransformFailed, TransformStopped


@dataclass(frozen=True, slots=True)
class DeadLetterAdmission:
    """A dead letter is read when it is taken; nothing about it waits for the Schema Registry."""

    unavailable: None = None


_ADMITTED = DeadLetterAdmission()


class ReplayStage:
    """Selects, repairs and republishes the dead letters `options` name (see the module docstring), through
    `settlement`."""

    def __init__(
        self,
        options: ReplayOptions,
        source: ReplaySource,
        settlement: Settlement,
        reports: Reports,
    ) -> None:
        self._options = options
        self._source = source
        self._settlement = settlement
        self._reports = reports
        # Whether the selection matched a record yet; until then the records passed over are held here.
        self.matched = False
        self._held: list[Work] = []

    # -- seams.Stage ----------------------------------------------------------------------------------------

    def admit(self, record: Record) -> DeadLetterAdmission:
        return _ADMITTED

    def take(self, work: Work, record: Record, admission: DeadLetterAdmission) -> None:
        try:
            info = read_dead_letter(record.headers)
        except ValueError as problem:
            self._pass_over(work, ReplayOutcome.UNREADABLE, None, detail=str(problem))
            return
        skipped = why_not_replayed(info, self._options)
        if skipped is not ReplayOutcome.SKIPPED_FILTER:
            self._match()
        if skipped is not None:
            detail = not_kept(info) if skipped is ReplayOutcome.SHRUNK else None
            self._pass_over(work, skipped, info, detail)
            return
        if self._options.limit is not None and self._reports.selected >= self._options.limit:
            self._source.done_with(work)  # left for the next run: the committed position stays before it
            self._source.end()
            return
        self._reports.selected += 1
        value = record.value
        if self._options.transform is not None and value is not None:
            try:
                value = self._options.transform.repair(value)
            except TransformStopped:
                self._source.done_with(work)  # left unsettled: the committed position stays before it
                return
            except TransformFailed as problem:
                self._pass_over(work, ReplayOutcome.TRANSFORM_FAILED, info, detail=problem.detail)
                return
            if value is None:
                self._pass_over(work, ReplayOutcome.TRANSFORM_SKIPPED, info)
                return
        self._publish(work, record, info, value)

    def cannot_hold(self, work: Work, unavailable: RegistryUnavailable) -> None:
        raise AssertionError("a dead letter is never held back: its headers need no Schema Registry")

    def answer_now(self, works: Collection[Work], reason: FallbackReason) -> None:
        pass  # nothing waits here for a model (and a replay's source asks for no answer)

    def serve(self, wait_s: float) -> None:
        pass  # nothing waits here: the settlement serves the delivery reports

    # Nothing waits here between two turns of the loop: no record at a model, none of a partition given up.
    busy = False
    orphans = 0

    def __len__(self) -> int:
        return 0

    def room(self) -> int:
        return sys.maxsize  # never paced by the stage: each record is settled or written as it is taken

    def pending(self, keys: set[TopicPartitionKey]) -> int:
        return 0

    def first(self, keys: set[TopicPartitionKey]) -> None:
        pass  # assigned partitions are never revoked, nor given up

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        pass

    def close(self, flush_s: float) -> None:
        """After the last commit: with nothing matched, no transaction held the pending reports."""
        if not self.matched:
            self._reports.nothing_committed()

    def described(self) -> dict[str, object]:
        return {}

    def where(self) -> list[int]:
        return [0, 0, 0]

    # -- outcomes -------------------------------------------------------------------------------------------

    def _publish(self, work: Work, record: Record, info: DeadLetterInfo, value: bytes | None) -> None:
        target = self._options.to_topic or info.topic
        failure = self._reports.failed_before((work.partition, work.offset))
        if failure is not None:  # read again after a redo: it fails as it did, without another try
            self._source.done_with(work)
            self._reports.fail(failure)
            return
        self._source.republished()
        report = RecordReport(
            work.partition,
            work.offset,
            ReplayOutcome.REPLAYED,
            info.error_type,
            info.replay_count,
            target,
            record.key,
        )
        self._reports.sending(work, report)
        self._settlement.write(work, Output(target, record.key, value, replay_headers(record.headers)))

    def _pass_over(
        self, work: Work, outcome: ReplayOutcome, info: DeadLetterInfo | None, detail: str | None = None
    ) -> None:
        """A record that needs no output: done at once, or held while the selection matched nothing."""
        self._source.done_with(work)
        if outcome in UNMATCHED and not self.matched:
            self._held.append(work)
        else:
            self._settlement.done(work)
        self._reports.passed_over(
            RecordReport(
                work.partition,
                work.offset,
                outcome,
                info.error_type if info else None,
                info.replay_count if info else None,
                None,
                work.key,
                detail,
                info.omitted_bytes if info else None,
            )
        )

    def _match(self) -> None:
        """The selection matched a record: the records held before it are done (passed over by the group)."""
        if self.matched:
            return
        self.matched = True
        for work in self._held:
            self._settlement.done(work)
        self._held.clear()
