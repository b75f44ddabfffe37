"""Group mode's settlement, the delivery guarantee: how outputs reach Kafka and input offsets are committed.

The loop (`engine.py`) decides *what* to write for each record taken; a guarantee decides *how* it is written
and when the offsets past it are committed. Two implementations of `seams.Settlement`, chosen by
`pipeline.guarantee`:

- `AtLeastOnce`: outputs are produced at once; a partition's done prefix is committed to the group. A crash
  re-delivers at most the uncommitted records (duplicates, never loss).
- `ExactlyOnce`: a commit is a transaction holding the outputs of exactly the offsets it commits. Outputs of
  a partition are produced in input order (held until the records before them are produced, `deliveries.py`),
  nothing is produced while a commit is on its way, and a commit is sent only once every record in it is
  acknowledged. A transaction that cannot commit is aborted and its work *redone*: every owned partition is
  sought back to its first uncommitted offset.

What each step of the seam means here (every call on the loop's thread):

- `start()` once before the consumer subscribes (exactly-once: fences an earlier producer of the id);
- `taken(work)`, in consume order (in order, its output waits for its predecessors'); `write(work, output)`:
  its offset counts as done once the broker acknowledged the output (failed deliveries:
  `delivery.DeliveryRules`: an output refused for its content is replaced by its ticket's dead letter, or,
  with no dead-letter topic, left out, its offset done without it; anything else that fails for good stops
  the partition at the offset); `done(work)`, a record that needs no output (a replay's filters passed over
  it): its offset counts as done at once;
- `advance()`: apply commit outcomes (an abort or a stuck commit is handled here), start a commit when one is
  due (every `commit_interval_ms`, or early when done work fills half of the in-flight bound), on the
  committer thread (`committing` meanwhile);
- `settle(limit)`, `commit_now(keys, limit)`: on revoke, before and after the revoked partitions' work is
  drained: their progress is committed synchronously so the new owner starts where this worker stopped;
- `lost(keys)`: nothing of theirs may be committed any more; `give_up(keys)`: their outputs not
  acknowledged are not the worker's any more (held ones are dropped, produced ones become orphans);
- `stop(limit)`: flush and commit what is done; returns how many records were not flushed.

Why the run must end (a fatal client error, a fenced producer) is written to the shared `Failure`. The
caller passes an `Observer`: replay reports record by record with it, the triage stage drops the tickets of
partitions redone. What the guarantee does not own: the order tickets go to the model in
(`triage/dispatch_queue.py`) and the tickets at the model (`triage/requests.py`) are the stage's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import confluent_kafka
import structlog

from worker.errors import UserError
from worker.kafka import errors
from worker.kafka.clients import ProducerFactory
from worker.kafka.commits import (
    CommitOutcome,
    TopicPartitionKey,
    TransactionFailed,
    Transactions,
    consumer_commit,
)
from worker.pipeline.failure import Failure, names, positions_by_name
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.settlements.committer import Committer, CommitterFactory
from worker.pipeline.settlements.deliveries import Deliveries
from worker.pipeline.settlements.delivery import TOO_LARGE, DeliveryRules, send_tracked, smaller
from worker.pipeline.settlements.offsets import OffsetTracker, PartitionOffsets
from worker.pipeline.settlements.settling import AwaitingCommit
from worker.pipeline.work import Output, Work
from worker.settings import GuaranteeName

_log = structlog.get_logger("worker.pipeline")
_T = TypeVar("_T")

# Exactly-once: a commit still on its way after this long is stuck in librdkafka (every call in it has a 10 s
# timeout and retries stop after 20 s; see `ExactlyOnce._replace_producer`).
_STUCK_COMMIT_S = 30.0
# Exactly-once: one try of a new producer to take the transactional id over (see `_take_over`).
_TAKE_OVER_CALL_S = 2.0
# Exactly-once: how long a failed transaction waits for its other records' reports before it is aborted.
_REPORTS_BEFORE_ABORT_S = 1.0
# While waiting for a report or a commit at shutdown and on revoke.
_BUSY_WAIT_S = 0.01


class Observer:
    """Told what a guarantee did with each record: a delivery report (`error` None: acknowledged; the work
    may be an orphan of an aborted transaction), an output left out, confirmed commit positions, and a redo
    (records produced since the last commit will be read and written again). This default ignores
    everything; the pipeline drops the redone partitions' tickets still waiting or at the model."""

    def delivered(self, work: Work, error: confluent_kafka.KafkaError | None) -> None:
        pass

    def left_out(self, work: Work, error: confluent_kafka.KafkaError) -> None:
        """`work`'s output was refused for its content with no dead-letter topic to turn to
        (`DeliveryRules.left_out`): its offset counts as done without it, told instead of `delivered`.
        Exactly-once, the transaction that held it is redone, and the record read again is left out at once
        (told again); the work may be an orphan of an aborted transaction."""

    def committed(self, positions: dict[TopicPartitionKey, int]) -> None:
        pass

    def redone(self, keys: set[TopicPartitionKey]) -> None:
        """`keys`: the partitions sought back; their records not yet written must not be written."""


@dataclass(frozen=True)
class GuaranteeWiring:
    """What a guarantee works with, given by its caller (the pipeline or a replay).

    `consumer` is the caller's: a guarantee commits through it and seeks it back on a redo; `tracker` holds
    the taken offsets; `pause` stops a partition a guarantee cannot go on with; `give_up_at()` is the
    caller's instant (a `clock()` value, None: none) after which a produce stops waiting for room in the
    client's queue: set while revoking or stopping. `guarantee`: which one (`pipeline.guarantee`);
    `rules`: the delivery-error rules, with the dead-letter topic (None for a replay, whose outputs go back
    where they came from: none is written smaller, and one refused for its content is left out,
    `DeliveryRules.left_out`). `max_in_flight` and `commit_interval_s` are the door's, from its loop's
    `Limits` (`worker.app.doors.limits`, the one owner of those numbers and of their units: a replay's are
    its own, not `pipeline`'s): the longest time between commits, and the in-flight bound whose half, filled
    with done work, brings a commit forward.
    `committer` makes the committer of each producer (the threaded `Committer`; the fault simulator,
    tests/simulation, gives one that commits on the loop's thread, so that a schedule replays
    deterministically).
    """

    guarantee: GuaranteeName
    rules: DeliveryRules
    clients: ProducerFactory
    consumer: confluent_kafka.Consumer
    tracker: OffsetTracker
    metrics: PipelineMetrics
    clock: Callable[[], float]
    pause: Callable[[Sequence[TopicPartitionKey]], None]
    failure: Failure
    observer: Observer = field(default_factory=Observer)
    give_up_at: Callable[[], float | None] = lambda: None
    committer: CommitterFactory = Committer
    max_in_flight: int = field(kw_only=True)
    commit_interval_s: float = field(kw_only=True)


def guarantee_for(wiring: GuaranteeWiring) -> AtLeastOnce | ExactlyOnce:
    """The guarantee `wiring.guarantee` names."""
    kind = ExactlyOnce if wiring.guarantee == "exactly_once" else AtLeastOnce
    return kind(wiring)


class _Base:
    """What both guarantees share: the producer, delivery reports and the committer thread."""

    in_order: ClassVar[bool] = False

    def __init__(self, wiring: GuaranteeWiring) -> None:
        self._max_in_flight = wiring.max_in_flight
        self._commit_interval_s = wiring.commit_interval_s
        self._rules = wiring.rules
        self._dead_letter_topic = wiring.rules.dead_letter_topic
        self._clients = wiring.clients
        self._consumer = wiring.consumer
        self._tracker = wiring.tracker
        self.deliveries = Deliveries(in_order=self.in_order)
        self._awaiting_commit = AwaitingCommit("transaction" if self.in_order else "commit")
        self._metrics = wiring.metrics
        self._clock = clock = wiring.clock
        self._pause = wiring.pause
        self._failure = wiring.failure
        self._observer = wiring.observer
        self._give_up_at = wiring.give_up_at
        self._producer = wiring.clients.producer(self._on_producer_error)
        self._make_committer = wiring.committer
        self._committer = self._make_committer(self._commit_call())
        now = clock()
        self._last_commit = now
        # A failed commit is retried after a commit interval, not at once (a broker outage fails them all).
        self._retry_commit_at = now

    # -- the contract ---------------------------------------------------------------------------------------

    def start(self) -> None:
        pass

    def taken(self, work: Work) -> None:
        """A record was taken, in consume order (in order, its output waits for its predecessors')."""
        self.deliveries.taken(work)

    def done(self, work: Work) -> None:
        """A record that needs no output: its offset counts as done at once."""
        self.deliveries.without_output(work)
        work.state.done(work.offset)
        self._awaiting_commit.acknowledged(work)

    @property
    def outstanding(self) -> int:
        """Outputs written and not yet acknowledged (held ones included)."""
        return len(self.deliveries)

    def serve(self, wait_s: float) -> None:
        """Serve delivery reports. A fatal producer error is raised here too (confluent-kafka raises it from
        poll)."""
        try:
            self._producer.poll(wait_s)
        except confluent_kafka.KafkaException as problem:
            self._producer_failed(errors.describe(problem), errors.fenced(problem))

    def advance(self) -> None:
        self._apply_commit_outcomes()
        self._maybe_commit()

    @property
    def committing(self) -> bool:
        return self._committer.busy

    def wait(self, wait_s: float) -> None:
        """Nothing at the model: slots come back with the commit on its way or with delivery reports."""
        if self._committer.busy:
            self._committer.wait_idle(wait_s)
        else:
            self.serve(wait_s)

    @property
    def producing(self) -> bool:
        return True

    def settle(self, limit: float) -> None:
        pass

    def assigned(self, keys: Sequence[TopicPartitionKey]) -> None:
        pass

    def lost(self, keys: set[TopicPartitionKey]) -> None:
        self._awaiting_commit.forget(keys, "its partition was lost before a commit passed it")

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        self.deliveries.give_up(keys)

    def abandon(self, works: Collection[Work]) -> None:
        keys = {work.partition_key for work in works}
        self.deliveries.give_up(keys)
        self._awaiting_commit.forget(keys, "released before a commit passed it")

    @property
    def orphans(self) -> int:
        return self.deliveries.orphans

    def pending(self, keys: set[TopicPartitionKey]) -> int:
        return self.deliveries.pending(keys)

    def where(self) -> list[int]:
        return [self.deliveries.at_producer, self.deliveries.held]

    def commit_now(self, keys: set[TopicPartitionKey], limit: float) -> None:
        """Revoking: the progress of `keys` committed on this thread before they go (see each guarantee)."""
        self._commit_states([state for key in keys if (state := self._tracker.get(key)) is not None], limit)
        self._awaiting_commit.forget(keys, "its partition left this worker before a commit passed it")

    def _commit_states(self, states: Sequence[PartitionOffsets], limit: float) -> None:
        raise NotImplementedError

    # -- producing and delivery -----------------------------------------------------------------------------

    def _send(self, work: Work, output: Output) -> None:
        send_tracked(self._producer, self.deliveries, work, output, self._on_delivery, self._give_up_at())

    def _on_delivery(
        self,
        delivery_id: int,
        output: Output,
        error: confluent_kafka.KafkaError | None,
        _msg: Any,
        queued: bool = True,
    ) -> None:
        work = self.deliveries.delivered(delivery_id)
        if work is None:
            return
        if error is not None and self._rules.left_out(output, error):
            self._observer.left_out(work, error)
        else:
            self._observer.delivered(work, error)
        if error is None:
            self._rules.delivered(work)
            work.state.done(work.offset)
            self._awaiting_commit.acknowledged(work)
            return
        self._delivery_error(work, output, error, queued)

    def _delivery_error(
        self, work: Work, output: Output, error: confluent_kafka.KafkaError, queued: bool
    ) -> None:
        """The delivery-error rules (`delivery.DeliveryRules`): an output left out counts as done; a delivery
        that still fails stops its partition: the commit position never passes the offset, the partition is
        paused; a restart or rebalance re-reads it."""
        if self._rules.left_out(output, error):
            self._rules.leaving_out(work, output, error)
            work.state.done(work.offset)
            return
        instead = self._rules.instead(work, output, error)
        if instead is not None:
            self._send(work, instead)
            return
        work.state.fail(work.offset)
        self._delivery_failed(work, error, "never committed past this offset until a restart or rebalance")
        if not work.orphan:
            self._pause([work.partition_key])

    def _delivery_failed(self, work: Work, error: confluent_kafka.KafkaError, stopped: str) -> None:
        self._rules.failed(work, error, f"partition stopped: {stopped}")

    def _on_producer_error(self, error: confluent_kafka.KafkaError) -> None:
        """error_cb of the producer: transient errors are the client's to retry; fatal ones are handled by
        `_producer_failed`."""
        if error.fatal():
            self._producer_failed(errors.describe(error), errors.fenced(error))
        else:
            self._failure.client_error(error)

    def _producer_failed(self, reason: str, fenced: bool) -> None:
        if self._failure.reason is None:
            _log.error("kafka_fatal_error", reason=reason)
        self._failure.set(reason, fenced)

    # -- commits --------------------------------------------------------------------------------------------

    def _commit_call(self) -> Callable[[dict[TopicPartitionKey, int]], CommitOutcome]:
        raise NotImplementedError

    def _may_commit(self, due: bool) -> bool:
        """Whether a commit due (or not) may be sent now."""
        return due

    def _maybe_commit(self) -> None:
        now = self._clock()
        if self._committer.busy or now < self._retry_commit_at:
            return  # one commit at a time: that also caps the rate at one per broker round trip
        due = now - self._last_commit >= self._commit_interval_s
        # Done but uncommitted work holds in-flight slots: commit early when it fills half of them.
        crowded = self._tracker.uncommitted_done() * 2 >= self._max_in_flight
        if not self._may_commit(due or crowded):
            return
        positions = self._tracker.commit_positions()
        self._last_commit = now
        if not positions:
            self._nothing_to_commit()
            return
        for key, position in positions.items():
            if (state := self._tracker.get(key)) is not None:
                state.commit_requested(position)
        self._committer.submit(positions)

    def _nothing_to_commit(self) -> None:
        pass

    def _apply_commit_outcomes(self) -> None:
        """Confirmed positions release their offsets (and in-flight slots); failed ones may be sent again."""
        for outcome in self._committer.results():
            self._apply_commit_outcome(outcome)

    def _apply_commit_outcome(self, outcome: CommitOutcome) -> None:
        for key, position in outcome.confirmed.items():
            if (state := self._tracker.get(key)) is not None:
                self._metrics.committed += state.committed(position)
        if outcome.confirmed:
            self._observer.committed(outcome.confirmed)
            self._awaiting_commit.committed(outcome.confirmed)
            _log.debug("commit_confirmed", positions=positions_by_name(outcome.confirmed))
        for key, position in outcome.failed.items():
            if (state := self._tracker.get(key)) is not None:
                state.commit_failed(position)
        if outcome.failed:
            self._retry_commit_at = self._clock() + self._commit_interval_s
            self._log_commit_failed(outcome)

    def _log_commit_failed(self, outcome: CommitOutcome) -> None:
        self._metrics.commit_failed += 1
        _log.warning(
            "commit_failed",
            reason=outcome.error,
            partitions=names(set(outcome.failed)),
            # The group moved on: these partitions' new owner redoes their work from the last commit.
            left_group=outcome.left_group,
        )


class AtLeastOnce(_Base):
    """Outputs at once; a partition's done prefix committed to the group (see the module docstring)."""

    def write(self, work: Work, output: Output) -> None:
        self._send(work, output)

    def _commit_states(self, states: Sequence[PartitionOffsets], limit: float) -> None:
        """Synchronous commit of the done prefix of `states` on this thread (on revoke and at shutdown),
        calling again on passing errors (a stale member epoch mid-rebalance) until `limit`.

        Not through the committer: inside a rebalance callback only this thread's commit goes through.
        """
        self._apply_commit_outcomes()
        positions = {state.key: pos for state in states if (pos := state.position) is not None}
        if not positions:
            return
        outcome = consumer_commit(self._consumer, retry_for_s=max(0.0, limit - self._clock()))(positions)
        by_key = {state.key: state for state in states}
        for key, position in outcome.confirmed.items():
            self._metrics.committed += by_key[key].committed(position)
        self._observer.committed(outcome.confirmed)
        self._awaiting_commit.committed(outcome.confirmed)
        if outcome.confirmed:
            _log.info("committed", positions=positions_by_name(outcome.confirmed))
        if outcome.failed:
            self._log_commit_failed(outcome)

    def stop(self, limit: float) -> int:
        failed = self._failure.reason is not None
        not_flushed = len(self._producer) if failed else self._producer.flush(max(0.0, limit - self._clock()))
        # The last background commit must land before the final one, never after it.
        self._committer.wait_idle(max(0.0, limit - self._clock()))
        self._commit_states(list(self._tracker), limit)
        self._committer.close()
        return int(not_flushed)

    def _commit_call(self) -> Callable[[dict[TopicPartitionKey, int]], CommitOutcome]:
        return consumer_commit(self._consumer)


class ExactlyOnce(_Base):
    """Transactions holding the outputs of exactly the offsets they commit (see the module docstring).

    A lost partition aborts the open transaction (its outputs would duplicate the new owner's). A record the
    broker refuses every time cannot be redone forever: a dead letter is redone smaller, a result refused for
    its content as its ticket's dead letter (left out where there is no dead-letter topic), anything else
    stops its partition at its last commit. A fenced producer (another worker with the same transactional
    id) ends the run; any other fatal producer error, or a commit stuck in librdkafka, is settled by a new
    producer.
    """

    in_order = True

    def __init__(self, wiring: GuaranteeWiring) -> None:
        # Declared before the base constructor runs: it calls `_commit_call`, which makes the transactions.
        self._transactions: Transactions | None = None
        super().__init__(wiring)
        # No records go into the transaction (a commit is due or on its way); why it must be aborted, and by
        # when at the latest; when the commit on its way was sent.
        self._closing = False
        self._abort_reason: str | None = None
        self._abort_by = 0.0
        self._commit_sent_at = 0.0
        # Why the producer must be replaced at the next turn (a fatal error it cannot survive); why a new
        # producer still has to take the transactional id over (its coordinator did not answer yet).
        self._replace_reason: str | None = None
        self._taking_over: str | None = None
        self._taken_over = False
        # Producers and committers left behind by `_replace_producer`: a thread may still be inside them.
        self._abandoned: list[object] = []
        # Dead letters to write smaller when redone (source position → tries), and records whose output was
        # refused for its content, to dead-letter (or, without a dead-letter topic, to leave out) when redone
        # (source position → Kafka's error); kept until committed, as librdkafka can fail the next
        # transaction too (measured: after a refused record and an abort, the next commit fails with
        # OUT_OF_ORDER_SEQUENCE_NUMBER), so a redo may repeat.
        self._redo_smaller: dict[tuple[str, int, int], int] = {}
        self._redo_refused: dict[tuple[str, int, int], confluent_kafka.KafkaError] = {}
        # Partitions stopped at their last commit because a record of theirs is refused every time.
        self._poisoned: set[TopicPartitionKey] = set()

    # -- the contract ---------------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._txn.init()
        except TransactionFailed as problem:
            self._committer.close()
            raise UserError(f"Kafka: cannot start transactions (exactly_once): {problem}") from None
        self._txn.begin()

    def write(self, work: Work, output: Output) -> None:
        """In order: held until every earlier record of its partition has been produced. Redone, an output
        the broker refused for its content is replaced as the rules say, or left out: done at once."""
        position = (work.topic, work.partition, work.offset)
        refused = self._redo_refused.get(position)
        if refused is not None and self._rules.left_out(output, refused):
            self._observer.left_out(work, refused)
            self._rules.leaving_out(work, output, refused)
            self.done(work)
            return
        if refused is not None and output.topic != self._dead_letter_topic:
            output = self._rules.refused_result(work, refused)
        tries = self._redo_smaller.get(position, 0)
        if tries and output.topic == self._dead_letter_topic:
            output = smaller(work, output, tries)
        self.deliveries.hold(work, output)
        self._release(work.state)

    def done(self, work: Work) -> None:
        """As at-least-once; the outputs of its partition held behind it may go now."""
        super().done(work)
        self._release(work.state)

    def advance(self) -> None:
        if self._taking_over is not None:
            self._take_over(self._taking_over)
            return
        # All reports of a doomed transaction come first (bounded): they name the records the broker refuses.
        aborting = self._abort_reason is not None and not self._committer.busy
        if aborting and (not self.deliveries.at_producer or self._clock() >= self._abort_by):
            self._abort_and_redo()
        if self._committer.busy and self._clock() - self._commit_sent_at >= _STUCK_COMMIT_S:
            self._replace_reason = f"commit on its way for {_STUCK_COMMIT_S:.0f} s"
        if self._replace_reason is not None and self._failure.reason is None:
            self._replace_producer(self._replace_reason)
        super().advance()

    @property
    def producing(self) -> bool:
        return self._abort_reason is None

    def settle(self, limit: float) -> None:
        """A transaction commit on its way blocks new records; draining needs them."""
        self._committer.wait_idle(max(0.0, limit - self._clock()))
        self._apply_commit_outcomes()

    def _commit_states(self, states: Sequence[PartitionOffsets], limit: float) -> None:
        """Commit the open transaction on this thread, once every record in it is acknowledged; abort it
        (and redo its work) when that does not happen by `limit`. The transaction holds records of every
        owned partition: it commits (or aborts) as a whole."""
        self.settle(limit)
        if self._failure.reason is not None or self._committer.busy or self._taking_over is not None:
            return  # the commit on its way holds the transaction (its outcome is applied later), or none runs
        self._closing = True
        while self.deliveries.at_producer and self._abort_reason is None and self._clock() < limit:
            self.serve(_BUSY_WAIT_S)
        if self.deliveries.at_producer or self._abort_reason is not None:
            self._abort_reason = self._abort_reason or "records not acknowledged in time"
            self._abort_and_redo()
            return
        self._last_commit = self._clock()
        outcome = self._txn.commit(self._tracker.commit_positions())
        self._apply_commit_outcome(outcome)
        if outcome.confirmed:
            _log.info("committed", positions=positions_by_name(outcome.confirmed))

    def assigned(self, keys: Sequence[TopicPartitionKey]) -> None:
        self._poisoned.difference_update(keys)  # a new assignment tries its records again

    def lost(self, keys: set[TopicPartitionKey]) -> None:
        """The open transaction holds outputs of these partitions, which their new owner writes again."""
        if keys and self._abort_reason is None:
            self._abort_reason, self._abort_by = "partitions lost", self._clock()

    def stop(self, limit: float) -> int:
        if self._failure.reason is None:
            self._commit_states(list(self._tracker), limit)
        self._committer.close()
        return len(self._producer)

    # -- transactions ---------------------------------------------------------------------------------------

    @property
    def _txn(self) -> Transactions:
        assert self._transactions is not None  # made with the producer, in `_commit_call`
        return self._transactions

    def _commit_call(self) -> Callable[[dict[TopicPartitionKey, int]], CommitOutcome]:
        self._transactions = Transactions(self._producer, self._consumer)
        return self._transactions.commit

    def _release(self, state: PartitionOffsets | None = None) -> None:
        """Produce the held outputs that may go (of `state`'s partition, or of all), unless the transaction
        takes no records."""
        if not self._closing and self._abort_reason is None:
            for work in self.deliveries.release(state):
                assert work.output is not None
                self._send(work, work.output)

    def _may_commit(self, due: bool) -> bool:
        if not (due or self._closing) or self._taking_over is not None:
            return False
        # The transaction takes no more records; its offsets are known once all of them are acknowledged.
        self._closing = True
        if self.deliveries.at_producer or self._abort_reason is not None:
            return False
        self._commit_sent_at = self._clock()
        return True

    def _nothing_to_commit(self) -> None:
        """Nothing was written (every output goes with its offset): the open transaction goes on."""
        self._closing = False
        self._release()

    def _apply_commit_outcome(self, outcome: CommitOutcome) -> None:
        if outcome.fatal:
            self._producer_failed(f"transaction failed: {outcome.error}", fenced=True)
            return
        if outcome.aborted:
            self._redo(outcome.error or "commit failed")
            return
        if outcome.unsettled:
            self._replace_producer(outcome.error or "commit failed")
            return
        super()._apply_commit_outcome(outcome)
        if outcome.confirmed:
            self._redo_smaller = _not_committed(self._redo_smaller, outcome.confirmed)
            self._redo_refused = _not_committed(self._redo_refused, outcome.confirmed)
        self._metrics.transactions += 1
        self._reopen()

    def _reopen(self) -> None:
        """Begin the next transaction and produce what was held meanwhile."""
        if self._closing:
            try:
                self._txn.begin()
            except confluent_kafka.KafkaException as problem:  # fenced or fatal meanwhile
                self._producer_failed(errors.describe(problem), errors.fenced(problem))
                return
            self._closing = False
            self._release()

    # -- failures -------------------------------------------------------------------------------------------

    def _delivery_error(
        self, work: Work, output: Output, error: confluent_kafka.KafkaError, queued: bool
    ) -> None:
        """One failed record fails its transaction, which is aborted and redone. A record the broker refuses
        every time must not be redone forever: a dead letter is redone smaller (a few times), a result
        refused for its content is redone as its ticket's dead letter, or left out (no dead-letter topic);
        anything else stops its partition at its last commit.
        The refusal may be reported after the abort (its record is an orphan by then): it still counts for
        the redo. Refused before queueing for its content, the transaction never saw it: as at-least-once.
        (Refused before queueing for another reason, e.g. the transaction already failed, it is part of the
        doomed transaction: redone.)"""
        if not queued and error.code() in errors.REFUSED_CONTENT:
            super()._delivery_error(work, output, error, queued)
            return
        _log.debug(
            "delivery_failed_in_transaction", offset=work.offset, code=error.name(), orphan=work.orphan
        )
        if error.code() in errors.REFUSED_RECORD:
            position = (work.topic, work.partition, work.offset)
            if error.code() == TOO_LARGE and self._rules.shrinkable(output):
                self._redo_smaller[position] = output.shrunk + 1
            elif self._rules.refused_for_content(output, error):
                self._redo_refused[position] = error
            else:
                self._poisoned.add(work.partition_key)
                self._delivery_failed(work, error, "at its last commit until a restart or rebalance")
        if self._abort_reason is None and not work.orphan:
            self._abort_reason = f"delivery of offset {work.offset} failed: {error.name()}"
            self._abort_by = self._clock() + _REPORTS_BEFORE_ABORT_S
        # This try is over (the redo traces the ticket anew); a record that stopped its partition has already
        # ended its trace, failed.
        work.trace.outcome(
            "given_up", f"its delivery failed ({error.name()}): its transaction is aborted, it is redone"
        )
        work.trace.finish()

    def _producer_failed(self, reason: str, fenced: bool) -> None:
        """The producer is unusable. Fenced (another live worker has our transactional id) or not authorized:
        stop. Anything else: a new producer takes over at the next turn."""
        if not fenced:
            self._replace_reason = self._replace_reason or reason
        elif self._failure.reason is None:
            self._failure.set(reason, fenced=True)
            _log.error(
                "transactions_failed",
                reason=reason,
                effect="stopping: another worker may use the same pipeline.transactional_id",
            )

    def _abort_and_redo(self) -> None:
        reason = self._abort_reason or "aborted"
        failed = self._txn.abort()
        if failed is None:
            self._redo(reason)
        elif failed.fatal:
            self._producer_failed(f"transaction abort failed: {failed.reason}", fenced=True)
        else:
            self._replace_producer(f"{reason}; abort failed: {failed.reason}")

    def _replace_producer(self, reason: str) -> None:
        """A transaction neither committed nor aborted. Seen here: a commit call that never returns, because
        librdkafka ignores the call's timeout when its cached group coordinator went away
        (confluentinc/librdkafka#5456 and #5511), after a broker restart; and an abort that times out after
        the broker refused records. A new producer with the same transactional id fences the old one and
        ends its transaction; the work is redone from the group's committed offsets, which say whether that
        transaction committed after all. The old producer is left alone: a thread may still be in it."""
        _log.error(
            "transaction_stuck",
            reason=reason,
            effect="a new transactional producer takes over; the work is redone from the committed offsets",
        )
        self._replace_reason = None
        self._abandoned.append((self._producer, self._committer))
        self._producer = self._clients.producer(self._on_producer_error)
        self._committer = self._make_committer(self._commit_call())
        self.deliveries.forget_produced()
        self._closing = True  # nothing is produced until the new producer owns the transactional id
        self._taken_over = False
        self._take_over(reason)

    def _take_over(self, reason: str) -> None:
        """The new producer registers the transactional id (fencing the old one), then the work is redone from
        the committed offsets. While the coordinator does not answer (seen for a minute after a broker
        restart on a loaded machine) this is tried again at the next turns, one short call each, so the loop
        keeps polling and the worker stays in its group; a restart would recover the same way."""
        states = list(self._tracker)
        try:
            if self._taking_over is None or not self._taken_over:
                self._txn.init(call_timeout_s=_TAKE_OVER_CALL_S, retry_for_s=0.0)
            self._taken_over = True
            wanted = [confluent_kafka.TopicPartition(*state.key) for state in states]
            committed = self._consumer.committed(wanted, timeout=_TAKE_OVER_CALL_S) if wanted else []
        except (TransactionFailed, confluent_kafka.KafkaException) as problem:
            if isinstance(problem, TransactionFailed) and problem.fenced:
                self._producer_failed(f"cannot take the transactional id over: {problem}", fenced=True)
            elif self._taking_over is None:
                _log.warning("transaction_take_over_retried", reason=str(problem), effect="tried again")
            self._taking_over = reason
            return
        self._taking_over = None
        self._redo(reason, {(tp.topic, tp.partition): tp.offset for tp in committed})

    def _redo(self, reason: str, committed: dict[TopicPartitionKey, int] | None = None) -> None:
        """After an abort: every owned partition starts again at its first uncommitted offset (the aborted
        transaction's records are never read, so nothing is lost and nothing is written twice), or at the
        group's `committed` offset where the outcome of the last commit is not known here."""
        self._abort_reason = None
        self._metrics.transactions_aborted += 1
        states = list(self._tracker)
        keys = {state.key for state in states}
        self._observer.redone(keys)
        self.deliveries.give_up(keys)
        self._awaiting_commit.forget(keys, f"its transaction was aborted ({reason}): it is redone")
        redo_from: dict[str, int] = {}
        for state in states:
            start = state.first_uncommitted
            if start is None:
                continue
            if committed is not None and committed.get(state.key, -1) >= 0:
                start = committed[state.key]
            blocked = state.key in self._poisoned
            self._tracker.restart(state.key, start, blocked)
            redo_from[f"{state.key[0]}[{state.key[1]}]"] = start
            try:
                self._consumer.seek(confluent_kafka.TopicPartition(*state.key, start))
            except confluent_kafka.KafkaException as problem:
                # Going on would skip the records between `start` and the fetch position: a restart
                # re-reads them from the committed offset instead.
                self._failure.set(f"cannot seek {state.key[0]}[{state.key[1]}] back to {start}: {problem}")
                _log.error("redo_failed", reason=self._failure.reason)
                return
            if blocked:
                self._pause([state.key])
        _log.warning("transaction_aborted", reason=reason, redo_from=redo_from)
        self._closing = True
        self._last_commit = self._clock()
        self._reopen()


def _not_committed(
    redo: dict[tuple[str, int, int], _T], confirmed: dict[TopicPartitionKey, int]
) -> dict[tuple[str, int, int], _T]:
    """The entries of a redo map whose source offset a confirmed commit has not passed yet."""
    return {(t, p, offset): v for (t, p, offset), v in redo.items() if offset >= confirmed.get((t, p), -1)}
