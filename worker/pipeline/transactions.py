"""Exactly-once: the results, dead letters and input offsets of a stretch of work commit in one Kafka
transaction, or none of them do.

The loop owns the transaction's contents; this module owns its life cycle, following librdkafka's rules for
each error (`KafkaError.retriable()`: call again; `txn_requires_abort()`: abort, then redo the work;
`fatal()`: this producer is done). Of the fatal errors only a fence (a newer live worker with the same
`transactional.id`) or a refused authorization stops the worker (`stops_worker`); after any other one
(seen here: INVALID_TXN_STATE from an abort after a broker restart) a new producer with the same id takes
over, as a restart would.

Offsets go in with the consumer's group metadata (KIP-447), so a member that lost its partitions in a
rebalance (a zombie) cannot commit them any more: its transaction fails and is aborted, and the partitions'
new owner redoes the work from the last committed offsets.

A transaction only ever holds records whose input offsets it also commits: the loop produces a partition's
outputs in input order and stops producing while a commit is on its way (see `runner.py`), so the records
in a transaction are exactly those of the offsets between the previous commit and this one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import confluent_kafka
import structlog

from worker.pipeline.committer import CommitOutcome, describe, topic_partitions
from worker.pipeline.offsets import TopicPartitionKey

_log = structlog.get_logger("worker.pipeline")
_T = TypeVar("_T")
# Coordinator states that pass (librdkafka does not always flag them retriable): another operation on the
# transaction still ending (a fenced producer's), a coordinator loading or moving.
_PASSING = frozenset(
    {
        confluent_kafka.KafkaError.CONCURRENT_TRANSACTIONS,
        confluent_kafka.KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        confluent_kafka.KafkaError.COORDINATOR_NOT_AVAILABLE,
        confluent_kafka.KafkaError.NOT_COORDINATOR,
    }
)
# Each call waits at most this long; retriable failures are retried until `retry_for_s`.
_CALL_TIMEOUT_S = 10.0


# Fatal errors after which no new producer helps: another live worker owns the id, or the id is not allowed.
_STOPPING = frozenset(
    {
        confluent_kafka.KafkaError._FENCED,
        confluent_kafka.KafkaError.PRODUCER_FENCED,
        confluent_kafka.KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        confluent_kafka.KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    }
)


def stops_worker(problem: confluent_kafka.KafkaException | confluent_kafka.KafkaError) -> bool:
    """Whether a producer error means this worker must stop (fenced, not authorized)."""
    error = (
        problem.args[0] if isinstance(problem, confluent_kafka.KafkaException) and problem.args else problem
    )
    return isinstance(error, confluent_kafka.KafkaError) and error.code() in _STOPPING


class TransactionFailed(Exception):
    """The producer cannot run transactions any more (fatal), with librdkafka's reason."""


@dataclass(frozen=True)
class AbortFailed:
    """Why an abort failed; `fatal`: the worker must stop (fenced), else the transaction is unsettled."""

    reason: str
    fatal: bool


class Transactions:
    """`init` once, then `begin` → (produce) → `commit` or `abort`, again and again.

    `commit` may run on another thread (the committer's); the others run on the loop's thread. Nothing
    here touches the loop's state.
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

    def init(self) -> None:
        """Register the transactional id with the broker: fences an older producer with the same id and
        aborts the transaction it left open (a crashed worker's). Raises TransactionFailed."""
        try:
            # The coordinator may still be ending the fenced producer's transaction: allow it longer.
            self._retrying(lambda: self._producer.init_transactions(_CALL_TIMEOUT_S), 3 * self._retry_for_s)
        except confluent_kafka.KafkaException as problem:
            raise TransactionFailed(describe(problem)) from None

    def begin(self) -> None:
        """Open the next transaction (a local call; the broker hears of it with the first record)."""
        self._producer.begin_transaction()

    def commit(self, positions: dict[TopicPartitionKey, int]) -> CommitOutcome:
        """Add `positions` (next offset to read, per partition) and commit everything produced since `begin`.

        The outcome says whether the positions are committed, or the transaction was aborted (its records
        are never read and the loop redoes its work), or the producer is fenced or broken for good.
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
            return AbortFailed(describe(problem), stops_worker(problem))
        return None

    def _failed(
        self, positions: dict[TopicPartitionKey, int], problem: confluent_kafka.KafkaException
    ) -> CommitOutcome:
        reason = describe(problem)
        fatal = stops_worker(problem)
        error = problem.args[0] if problem.args else None
        if not fatal and not (isinstance(error, confluent_kafka.KafkaError) and error.fatal()):
            # Abortable, or retriable for longer than we wait: either way the outcome is unknown unless we
            # abort. An abort that fails too leaves the transaction unsettled: a new producer with the same
            # transactional id settles it (see the pipeline's `_replace_stuck_producer`).
            failed = self.abort()
            if failed is None:
                return CommitOutcome(confirmed={}, failed=dict(positions), error=reason, aborted=True)
            reason, fatal = f"{reason}; abort failed: {failed.reason}", failed.fatal
        return CommitOutcome(
            confirmed={}, failed=dict(positions), error=reason, fatal=fatal, unsettled=not fatal
        )

    def _retrying(self, call: Callable[[], _T], retry_for_s: float | None = None) -> _T:
        """`call`, again while it fails with a retriable error, for up to `retry_for_s`."""
        give_up_at = time.monotonic() + (retry_for_s or self._retry_for_s)
        while True:
            try:
                return call()
            except confluent_kafka.KafkaException as problem:
                error = problem.args[0] if problem.args else None
                retriable = isinstance(error, confluent_kafka.KafkaError) and (
                    error.retriable() or error.code() in _PASSING
                )
                if not retriable or time.monotonic() >= give_up_at:
                    raise
                _log.info("transaction_call_retried", reason=describe(problem))
                time.sleep(0.1)
