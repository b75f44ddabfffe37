"""Kafka error classes: one table for every client the project runs (the pipeline, replay, admin calls).

librdkafka flags each error `retriable()`, `txn_requires_abort()` or `fatal()`. The sets below add what the
flags leave out, as seen here:

- *passing*: coordinator states that end by themselves (a coordinator loading or moving, another operation
  on the transaction still ending, a commit sent with a member epoch a rebalance of the consumer-group
  protocol just moved past: the client's next heartbeat brings the new one) though librdkafka does not
  always flag them retriable: call again;
- *left the group*: a commit refused because the group no longer counts the member as the owner (fenced or
  expired, or its classic generation ended): calling again cannot commit those partitions; the rebalance
  that follows revokes or loses them, and their new owner redoes the work from the last commit;
- *fenced*: fatal errors after which no new producer helps: another live client owns the transactional id,
  or the id is not allowed. Any other fatal producer error (seen here: INVALID_TXN_STATE from an abort after
  a broker restart) is survived by a new producer with the same id, as a restart would;
- *purged*: how records queued or in flight when their transaction was aborted fail;
- *refused record*: delivery errors that sending the same record again would meet again; of those, the
  *refused content* ones are about the record itself (its size or form): another record to the same topic
  goes through, so the pipeline dead-letters the ticket instead of stopping its partition.
"""

from __future__ import annotations

import confluent_kafka

KafkaError = confluent_kafka.KafkaError

PASSING = frozenset(
    {
        KafkaError.CONCURRENT_TRANSACTIONS,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.STALE_MEMBER_EPOCH,  # KIP-848: the member's epoch moved on during a rebalance
    }
)
LEFT_GROUP = frozenset(
    {
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.FENCED_MEMBER_EPOCH,  # KIP-848: the coordinator fenced the member (missed heartbeats)
        KafkaError.ILLEGAL_GENERATION,  # the classic protocol's: a rebalance ended the member's generation
    }
)
FENCED = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    }
)
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
REFUSED_CONTENT = frozenset(
    {
        KafkaError._INVALID_ARG,  # refused by the client itself (e.g. a header it cannot encode)
        KafkaError.MSG_SIZE_TOO_LARGE,  # over message.max.bytes (before queueing) or the topic's limit
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_RECORD,
    }
)
REFUSED_RECORD = REFUSED_CONTENT | {KafkaError.TOPIC_AUTHORIZATION_FAILED}


def kafka_error(problem: confluent_kafka.KafkaException | KafkaError) -> KafkaError | None:
    """The KafkaError a client call raised (or was given)."""
    if isinstance(problem, KafkaError):
        return problem
    first = problem.args[0] if problem.args else None
    return first if isinstance(first, KafkaError) else None


def describe(problem: confluent_kafka.KafkaException | KafkaError) -> str:
    """`NAME: reason` for logs and outcomes."""
    error = kafka_error(problem)
    return f"{error.name()}: {error.str()}" if error is not None else str(problem)


def passing(problem: confluent_kafka.KafkaException | KafkaError) -> bool:
    """Worth calling again: retriable, or a coordinator state that passes."""
    error = kafka_error(problem)
    return error is not None and (error.retriable() or error.code() in PASSING)


def left_group(problem: confluent_kafka.KafkaException | KafkaError) -> bool:
    """A commit the group refused because this member no longer owns the partitions (see LEFT_GROUP)."""
    error = kafka_error(problem)
    return error is not None and error.code() in LEFT_GROUP


def fenced(problem: confluent_kafka.KafkaException | KafkaError) -> bool:
    """The producer must stop for good (see FENCED): a new one with the same transactional id cannot help."""
    error = kafka_error(problem)
    return error is not None and error.code() in FENCED


def consumer_fatal(error: KafkaError) -> bool:
    """A consumer error that ends the run: flagged fatal, or `_FATAL` as `poll()` hands one over with the flag
    unset (seen when the broker does not serve `group.protocol=consumer`: "API version not supported:
    ConsumerGroupHeartbeat"; the consumer never joins and would idle for ever)."""
    return error.fatal() or error.code() == KafkaError._FATAL


def consumer_fatal_reason(error: KafkaError) -> str:
    """`describe(error)` with what to do when the broker does not serve the consumer-group protocol."""
    reason = describe(error)
    if "ConsumerGroupHeartbeat" in error.str():
        reason += "; the broker does not serve kafka.group.protocol = consumer (Kafka 4.0+ does): use classic"
    return reason


def fatal(problem: confluent_kafka.KafkaException | KafkaError) -> bool:
    error = kafka_error(problem)
    return error is not None and (error.fatal() or error.code() in FENCED)
