"""Records the Schema Registry gave no answer about: retried later, never dead-lettered, never skipped — by
every door the same way.

A record in a registry format (docs/schema-registry.md) whose writer's schema the decoder could not fetch
(`RegistryUnavailable`: the registry refused the connection, timed out, answered 5xx, 408 or 429 (cause
`outage`), refused our credentials with 401 or 403 (`credentials`), or gave any other answer that says
nothing about the record (`registry_error`)) is fine; only the registry, or our access to it, is not. So the
record is not taken at all: its source holds it back (group mode pauses its partition and seeks back to it;
queue mode keeps it in the batch at hand and polls no new one), and the loop *probes* the registry with that
very record on a backoff (1 s, doubling per failed probe of that partition, up to 30 s): nothing is read
again and no delivery is spent while the registry stays away. Once a probe decodes, the source reads the
partition again. Records whose schema is already cached decode without the registry meanwhile.

While any partition waits, `state.outage` says why and `state.cause` names its kind: readiness reports not
ready (another worker may reach the registry) until a probe decodes, and the holds are counted by cause. The
warning, which names the cause, is logged at most once per `REPEAT_INTERVAL_S` and cause, with the count of
the lines held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import structlog

from worker.decoding import RegistryUnavailable
from worker.kafka.commits import TopicPartitionKey
from worker.logs import Throttle
from worker.pipeline.metrics import RegistryState
from worker.pipeline.seams import Record

_log = structlog.get_logger("worker.pipeline")

FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0


class RegistryWait:
    """The partitions held back for the registry, each with the record to probe it with and when (see the
    module docstring). It holds nothing itself: the source keeps the records, the loop probes."""

    def __init__(self, state: RegistryState, clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self._clock = clock
        # Partition → (when to probe again, the record it is held at).
        self._held: dict[TopicPartitionKey, tuple[float, Record]] = {}
        # Failed probes in a row, per partition, until one decodes.
        self._tries: dict[TopicPartitionKey, int] = {}
        self._throttle = Throttle()

    @property
    def held(self) -> set[TopicPartitionKey]:
        return set(self._held)

    def hold(self, record: Record, unavailable: RegistryUnavailable) -> None:
        """`record`'s partition waits for the registry (held at `record`), or waits longer after a probe."""
        key = record.partition_key
        tries = self._tries.get(key, 0) + 1
        self._tries[key] = tries
        delay = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (tries - 1))
        self._held[key] = (self._clock() + delay, record)
        self.state.retries_by_cause[unavailable.cause] += 1
        self.state.outage = unavailable.message
        self.state.cause = unavailable.cause
        self.state.waiting = tuple(sorted(self._held))
        # Per cause: a registry that comes back refusing our credentials says so at once.
        suppressed = self._throttle.admit(("schema_registry_unavailable", unavailable.cause))
        if suppressed is not None:
            _log.warning(
                "schema_registry_unavailable",
                cause=unavailable.cause,
                partition=f"{key[0]}[{key[1]}]",
                offset=record.offset,
                retry_in_s=delay,
                reason=unavailable.message,
                effect="the record is held back and the registry probed with it; nothing is dead-lettered or "
                "skipped",
                suppressed_since_last=suppressed,
            )

    def due(self, now: float) -> list[Record]:
        """The records to probe the registry with now (their partitions stay held until `answered`)."""
        return [record for at, record in self._held.values() if at <= now]

    def answered(self, key: TopicPartitionKey) -> None:
        """A probe of `key` decoded: the partition is read again; once none is held, the outage is over."""
        self._held.pop(key, None)
        self._tries.pop(key, None)
        self.state.waiting = tuple(sorted(self._held))
        if self.state.outage is not None and not self._held:
            _log.info(
                "schema_registry_answering", partition=f"{key[0]}[{key[1]}]", retries=self.state.retries
            )
            self.state.outage = None
            self.state.cause = None

    def forget(self, keys: Iterable[TopicPartitionKey]) -> None:
        """Revoked, lost or assigned afresh: the next owner (or the new assignment) starts at the committed
        offset, which is at or before the held record."""
        for key in keys:
            self._held.pop(key, None)
            self._tries.pop(key, None)
        self.state.waiting = tuple(sorted(self._held))
        if not self._held:
            self.state.outage = None
            self.state.cause = None
