"""How progress is committed to Kafka: a group commit (at-least-once), or a transaction that holds the outputs
of a stretch of work together with the input offsets past it (exactly-once), so that both commit or neither.

Both are a `CommitCall`: positions (next offset to read, per partition) in, a `CommitOutcome` out. The
pipeline runs them on a committer thread; replay calls them in line. A group commit calls again for a
while on passing errors, which include the consumer-group protocol's (KIP-848) stale member epoch.

`Transactions` owns a transactional producer's life cycle and follows librdkafka's rules for each error
(`worker/kafka/errors.py`): retriable and passing errors call again, abortable ones abort (the caller redoes
the work), fatal ones are reported; only a fence or a refused authorization means no new producer can help.
Offsets go in with the consumer's group metadata (KIP-447), so a member that lost its partitions in a
rebalance (a zombie) cannot commit them any more: its transaction fails and is aborted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import confluent_kafka
import structlog

from worker.kafka import errors

# A partition as the worker keys it, in every room (one definition).
TopicPartitionKey = tuple[str, int]
_log = structlog.get_logger("worker.kafka")
_T = TypeVar("_T")
# Each call waits at most this long; retriable failures are retried until `retry_for_s`.
_CALL_TIMEOUT_S = 10.0
# A group commit refused with a passing error is sent again this often, for this long: a rebalance of the
# consumer-group protocol settles within a heartbeat or two (seconds); a longer outage is the next commit
# interval's to retry.
_GROUP_COMMIT_RETRY_WAIT_S = 0.1
_GROUP_COMMIT_RETRY_FOR_S = 5.0


@dataclass(frozen=True)
class CommitOutcome:
    """What the broker said about one commit: the positions it confirmed, and those it did not."""

    confirmed: dict[TopicPartitionKey, int]
    failed: dict[TopicPartitionKey, int]
    error: str | None = None
    # Transactions only: the transaction was aborted (its records will never be read); neither committed nor
    # aborted (a new producer with the same transactional id must settle it); or the producer can no longer
    # commit at all (fenced by another client with its transactional id, or not authorized).
    aborted: bool = False
    unsettled: bool = False
    fatal: bool = False
    # Group commits only: refused because the group no longer counts this member as the partitions' owner
    # (worker/kafka/errors.py, LEFT_GROUP); the rebalance that follows takes them away.
    left_group: bool = False


CommitCall = Callable[[dict[TopicPartitionKey, int]], CommitOutcome]


def topic_partitions(positions: dict[TopicPartitionKey, int]) -> list[confluent_kafka.TopicPartition]:
    return [confluent_kafka.TopicPartition(t, p, position) for (t, p), position in positions.items()]


def consumer_commit(
    consumer: confluent_kafka.Consumer,
    retry_for_s: float = _GROUP_COMMIT_RETRY_FOR_S,
    sleep: Callable[[float], None] = time.sleep,
) -> CommitCall:
    """A synchronous group commit of `positions` through `consumer`.

    The partitions refused with a passing error (a coordinator moving; under the consumer-group protocol a
    member epoch a rebalance just moved past) are committed again until `retry_for_s` has passed; what is
    still not confirmed then comes back as `failed`, with the last reason (`left_group` when the group no
    longer counts this member as their owner: no later commit of this member gets them through).
    """

    def commit(positions: dict[TopicPartitionKey, int]) -> CommitOutcome:
        give_up_at = time.monotonic() + retry_for_s
        confirmed: dict[TopicPartitionKey, int] = {}
        pending = dict(positions)
        while True:
            problem: confluent_kafka.KafkaException | confluent_kafka.KafkaError | None = None
            try:
                answered = consumer.commit(offsets=topic_partitions(pending), asynchronous=False) or []
            except confluent_kafka.KafkaException as refused:
                problem = refused
            else:
                for tp in answered:
                    if tp.error is None and tp.offset >= 0:
                        confirmed[(tp.topic, tp.partition)] = tp.offset
                    elif tp.error is not None:
                        problem = tp.error
                pending = {key: position for key, position in pending.items() if key not in confirmed}
            if not pending:
                return CommitOutcome(confirmed=confirmed, failed={})
            if problem is None or not errors.passing(problem) or time.monotonic() >= give_up_at:
                return CommitOutcome(
                    confirmed=confirmed,
                    failed=pending,
                    error=None if problem is None else errors.describe(problem),
                    left_group=problem is not None and errors.left_group(problem),
                )
            _log.info("commit_retried", reason=errors.describe(problem), partitions=len(pending))
            sleep(_GROUP_COMMIT_RETRY_WAIT_S)

    return commit


class TransactionFailed(Exception):
    """The producer cannot run transactions (yet), with librdkafka's reason; `fenced`: never will."""

    def __init__(self, reason: str, fenced: bool) -> None:
        super().__init__(reason)
        self.fenced = fenced


@dataclass(frozen=True)
class AbortFailed:
    """Why an abort failed; `fatal`: the producer must stop for good, else the transaction is unsettled."""

    reason: str
    fatal: bool


class Transactions:
    """`init` once, then `begin` → (produce) → `commit` or `abort`, again and again.

    `commit` may run on another thread (the pipeline's committer); the others run on the caller's thread.
    """

    def __init__(
        self,
        producer: confluent_kafka.Producer,
        consumer: confluent_kafka.Consumer,
        retry_for_s: float = 20.0,
    ) -> None:
        self._producer = producer
        self._consumer = consumer
        self._retry_for_s = retry_for_s

    def init(self, call_timeout_s: float = _CALL_TIMEOUT_S, retry_for_s: float | None = None) -> None:
        """Register the transactional id with the broker: fences an older producer with the same id and
        aborts the transaction it left open (a crashed instance's). Raises TransactionFailed."""
        # The coordinator may still be ending the fenced producer's transaction: by default allow it longer.
        retry_for_s = 3 * self._retry_for_s if retry_for_s is None else retry_for_s
        try:
            self._retrying(lambda: self._producer.init_transactions(call_timeout_s), retry_for_s)
        except confluent_kafka.KafkaException as problem:
            raise TransactionFailed(errors.describe(problem), errors.fenced(problem)) from None

    def begin(self) -> None:
        """Open the next transaction (a local call; the broker hears of it with the first record)."""
        self._producer.begin_transaction()

    def commit(self, positions: dict[TopicPartitionKey, int]) -> CommitOutcome:
        """Add `positions` (next offset to read, per partition) and commit everything produced since `begin`.

        The outcome says whether the positions are committed, or the transaction was aborted (its records
        are never read and the caller redoes its work), or the producer is fenced or broken for good.
        """
        try:
            if positions:
                offsets = topic_partitions(positions)
                metadata = self._consumer.consumer_group_metadata()
                self._retrying(
                    lambda: self._producer.send_offsets_to_transaction(offsets, metadata, _CALL_TIMEOUT_S)
                )
            self._retrying(lambda: self._producer.commit_transaction(_CALL_TIMEOUT_S))
        except confluent_kafka.KafkaException as problem:
            return self._failed(positions, problem)
        return CommitOutcome(confirmed=dict(positions), failed={})

    def abort(self) -> AbortFailed | None:
        """Abort the open transaction; its records are never read. Says why when that failed."""
        try:
            self._retrying(lambda: self._producer.abort_transaction(_CALL_TIMEOUT_S))
        except confluent_kafka.KafkaException as problem:
            return AbortFailed(errors.describe(problem), errors.fenced(problem))
        return None

    def _failed(
        self, positions: dict[TopicPartitionKey, int], problem: confluent_kafka.KafkaException
    ) -> CommitOutcome:
        reason = errors.describe(problem)
        fatal = errors.fenced(problem)
        if not errors.fatal(problem):
            # Abortable, or retriable for longer than we wait: either way the outcome is unknown unless we
            # abort. An abort that fails too leaves the transaction unsettled: a new producer with the same
            # transactional id settles it.
            failed = self.abort()
            if failed is None:
                return CommitOutcome(confirmed={}, failed=dict(positions), error=reason, aborted=True)
            reason, fatal = f"{reason}; abort failed: {failed.reason}", failed.fatal
        return CommitOutcome(
            confirmed={}, failed=dict(positions), error=reason, fatal=fatal, unsettled=not fatal
        )

    def _retrying(self, call: Callable[[], _T], retry_for_s: float | None = None) -> _T:
        """`call`, again while it fails with a passing error, for up to `retry_for_s`."""
        give_up_at = time.monotonic() + (self._retry_for_s if retry_for_s is None else retry_for_s)
        while True:
            try:
                return call()
            except confluent_kafka.KafkaException as problem:
                if not errors.passing(problem) or time.monotonic() >= give_up_at:
                    raise
                _log.info("transaction_call_retried", reason=errors.describe(problem))
                time.sleep(0.1)
