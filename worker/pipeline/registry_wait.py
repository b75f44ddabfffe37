"""Records the Schema Registry gave no answer about: retried later, never dead-lettered, never skipped.

A record in a registry format (docs/schema-registry.md) whose writer's schema the decoder could not fetch
(`RegistryUnavailable`: the registry refused the connection, timed out, answered 5xx, 408 or 429 (cause
`outage`), refused our credentials with 401 or 403 (`credentials`), or gave any other answer that says
nothing about the record (`registry_error`)) is fine; only the registry, or our access to it, is not. So the
record is not taken at all: its partition is paused and sought back to it, and resumed after a backoff
(1 s, doubling per failed retry of that partition, up to 30 s); the record is then fetched and decoded again.
Nothing at or after it is tracked meanwhile, so the commit position of the partition never passes it, and a
crash or rebalance meanwhile re-reads it from the committed offset. The other partitions go on: a record
whose schema is already cached decodes without the registry.

While any partition waits, `state.outage` says why and `state.cause` names its kind: readiness reports not
ready (another worker of the group may reach the registry) until a record decodes through the registry
again, and the retries are counted by cause. The warning, which names the cause, is logged at most once per
`REPEAT_INTERVAL_S` and cause, with the count of the lines held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import confluent_kafka
import structlog

from worker.decoding import RegistryUnavailable
from worker.kafka import errors
from worker.kafka.commits import TopicPartitionKey
from worker.logs import Throttle
from worker.pipeline.metrics import RegistryState

_log = structlog.get_logger("worker.pipeline")

FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0


class RegistryWait:
    """The partitions held back for the registry (see the module docstring). The caller pauses them (and
    keeps them paused while they are in `held`); `hold` seeks, `due` releases."""

    def __init__(
        self,
        consumer: confluent_kafka.Consumer,
        pause: Callable[[Iterable[TopicPartitionKey]], None],
        state: RegistryState,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        self.state = state
        self._pause = pause
        self._clock = clock
        # Partition → when to fetch its record again.
        self.held: dict[TopicPartitionKey, float] = {}
        # Failed tries in a row, per partition, until one of its records decodes.
        self._tries: dict[TopicPartitionKey, int] = {}
        self._throttle = Throttle()

    def hold(self, key: TopicPartitionKey, offset: int, unavailable: RegistryUnavailable | str) -> bool:
        """Hold `key` back at `offset` (the record the registry gave no answer about; `unavailable`: what the
        decoder raised, or its `str()`). False when the seek back failed: going on would skip the record, so
        the caller must stop (a restart re-reads it)."""
        if isinstance(unavailable, str):
            unavailable = RegistryUnavailable.from_text(unavailable)
        self._pause([key])
        try:
            self._consumer.seek(confluent_kafka.TopicPartition(key[0], key[1], offset))
        except confluent_kafka.KafkaException as problem:
            _log.error(
                "schema_registry_seek_failed",
                partition=f"{key[0]}[{key[1]}]",
                offset=offset,
                reason=errors.describe(problem),
            )
            return False
        tries = self._tries.get(key, 0) + 1
        self._tries[key] = tries
        delay = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (tries - 1))
        self.held[key] = self._clock() + delay
        self.state.retries_by_cause[unavailable.cause] += 1
        self.state.outage = unavailable.message
        self.state.cause = unavailable.cause
        self.state.waiting = tuple(sorted(self.held))
        # Per cause: a registry that comes back refusing our credentials says so at once.
        suppressed = self._throttle.admit(("schema_registry_unavailable", unavailable.cause))
        if suppressed is not None:
            _log.warning(
                "schema_registry_unavailable",
                cause=unavailable.cause,
                partition=f"{key[0]}[{key[1]}]",
                offset=offset,
                retry_in_s=delay,
                reason=unavailable.message,
                effect="partition paused at this record and retried; nothing is dead-lettered or skipped",
                suppressed_since_last=suppressed,
            )
        return True

    def due(self) -> None:
        """Release the held partitions whose retry time came (the caller resumes what is no longer held)."""
        if self.held:
            now = self._clock()
            released = [key for key, at in self.held.items() if at <= now]
            for key in released:
                del self.held[key]
            if released:
                self.state.waiting = tuple(sorted(self.held))

    def answered(self, key: TopicPartitionKey) -> None:
        """A record of `key` decoded: its backoff starts over; once none is held, the outage is over."""
        if not self._tries and self.state.outage is None:
            return
        self._tries.pop(key, None)
        if self.state.outage is not None and not self.held:
            _log.info(
                "schema_registry_answering", partition=f"{key[0]}[{key[1]}]", retries=self.state.retries
            )
            self.state.outage = None
            self.state.cause = None

    def forget(self, keys: Iterable[TopicPartitionKey]) -> None:
        """Revoked, lost or assigned afresh: the next owner (or the new assignment) starts at the committed
        offset, which is at or before the held record."""
        for key in keys:
            self.held.pop(key, None)
            self._tries.pop(key, None)
        self.state.waiting = tuple(sorted(self.held))
        if not self.held and not self._tries:
            self.state.outage = None
            self.state.cause = None
