"""Why a run must end, shared by the loop, its source and its settlement; how partitions are named in logs.

`Failure.set(reason)`: the first reason given wins; the loop stops at its next turn and exits 1. A client
error passes through `client_error`: the client retries transient ones by itself (logged, throttled); fatal
ones end the run.
"""

from __future__ import annotations

from collections.abc import Sequence

import confluent_kafka
import structlog

from worker.kafka import errors
from worker.kafka.clients import ClientErrorLog
from worker.kafka.commits import TopicPartitionKey

_log = structlog.get_logger("worker.pipeline")


class Failure:
    """Why the run must stop; the first reason given wins. Shared by the loop and its guarantee. `fenced`:
    another client took the transactional id over (or it is not allowed)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.fenced = False
        self._error_log = ClientErrorLog("worker")

    def set(self, reason: str, fenced: bool = False) -> None:
        if self.reason is None:
            self.reason, self.fenced = reason, fenced

    def client_error(self, error: confluent_kafka.KafkaError) -> None:
        """error_cb of the consumer: transient errors are the client's to retry; fatal ones end the run."""
        if errors.consumer_fatal(error):
            self.set(errors.consumer_fatal_reason(error))
            _log.error("kafka_fatal_error", code=error.name(), reason=error.str())
        else:
            self._error_log(error)


def positions_by_name(positions: dict[TopicPartitionKey, int]) -> dict[str, int]:
    return {f"{topic}[{partition}]": position for (topic, partition), position in sorted(positions.items())}


def names(keys: Sequence[TopicPartitionKey] | set[TopicPartitionKey]) -> list[str]:
    return [f"{topic}[{partition}]" for topic, partition in sorted(keys)]
