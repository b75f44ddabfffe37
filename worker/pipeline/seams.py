"""The engine's three seams: where records come from (`Source`), what happens to each (`Stage`), and how each
one is settled (`Settlement`). One loop (`engine.Engine`) drives every door through them, so a promise kept
by the loop is kept by every door:

| door | source (`sources/`) | stage | settlement (`settlements/`) |
|---|---|---|---|
| `run` | `group`: a consumer group | `triage/` | `guarantees`: offsets, at least once or in transactions |
| `run --consume queue` | `share`: a share group | `triage/` | `acknowledgements`: one per record |
| `classify`, `model eval` | `lines`: a file, stdin, a list | `triage/` | `in_order`: results in input order |
| `replay` | `replay.source`: dead letters | `replay.stage`: republish | `guarantees` (dry run: `in_order`) |

Every call is on the loop's thread. Each contract is one small step, explained in its docstring.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from worker.decoding import RegistryUnavailable
from worker.kafka.commits import TopicPartitionKey
from worker.messages import FallbackReason
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.work import Headers, Output, Work


@dataclass(slots=True)
class Record:
    """One record a source hands the loop: its position and bytes, and the source's own `handle` for it (a
    share consumer's message, say). `answer_now`: the source cannot wait for the model any more (queue mode:
    the record's last delivery, its lock about to end): the stage answers it with that fallback at once.
    `rejected`: the source could not read it whole (a line over the size limit): a dead letter's type and
    message."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers | None
    handle: Any = None
    answer_now: FallbackReason | None = None
    rejected: tuple[str, str] | None = None

    @property
    def partition_key(self) -> TopicPartitionKey:
        return (self.topic, self.partition)

    def taken(self, state: PartitionOffsets, now: float, deadline: float) -> Work:
        """The record as the loop carries it from now on (`state`: its partition's offsets)."""
        return Work(
            state=state,
            topic=self.topic,
            partition=self.partition,
            offset=self.offset,
            key=self.key,
            headers=self.headers,
            polled_at=now,
            deadline=deadline,
            value=self.value,
        )


class HandBack(enum.Enum):
    """What becomes of a record whose model process died under it (`Source.hand_back`); a model that raised
    or answered `model_error` itself is answered as any other answer, in every door."""

    # The stage answers it (`model_error`), as any other answer.
    ANSWER = "answer"
    # The source gave it to another try (queue mode: released): nothing is written for it here.
    RELEASED = "released"
    # It was its last try: dead-lettered, with why.
    DEAD_LETTER = "dead_letter"


class Loop(Protocol):
    """What a source may tell the loop, even from inside its own calls (a rebalance callback is in a poll)."""

    @property
    def holding_back(self) -> bool:
        """Whether the loop wants nothing new now (the in-flight bound paused it, or it is stopping)."""
        ...

    def assigned(self, keys: Sequence[TopicPartitionKey]) -> None:
        """Partitions came (a group's assignment)."""

    def revoking(self, keys: set[TopicPartitionKey], drain_s: float) -> int:
        """Partitions are leaving in order: their taken records get up to `drain_s` to finish, then their
        progress is settled. Returns how many did not finish (left to the next owner)."""
        ...

    def lost(self, keys: set[TopicPartitionKey]) -> None:
        """Partitions were taken away without a revoke: nothing of theirs may be settled any more."""

    def abandon(self, works: Collection[Work], why: str) -> None:
        """The source released these taken records itself (queue mode: their lock is ending): whatever the
        stage or the settlement still does for them is not written."""

    @property
    def stop_by(self) -> float | None:
        """While stopping: the instant (a clock value) the shutdown ends; None otherwise."""
        ...

    def take(self, record: Record) -> None:
        """Take `record` now, outside `read` and whatever the in-flight bound (queue mode: a record on its
        last delivery, `answer_now` set, that must be answered before its lock closes; it needs no model
        time)."""

    def answer_now(self, works: Collection[Work], reason: FallbackReason) -> None:
        """These taken records cannot wait for their answer any longer (queue mode: on their last delivery,
        with the lock's or the shutdown's time for an answer running out): those still without one are
        answered with the `reason` fallback now; a model answer coming later is discarded."""


class Source(Protocol):
    """Where records come from, and how a record that cannot be taken yet is held back."""

    def open(self, loop: Loop) -> None:
        """Start reading (subscribe, assign); `loop` hears of partitions coming and going."""

    def may_take(self) -> bool:
        """Whether reading now is allowed (queue mode: never while a polled batch has unsettled records)."""
        ...

    def read(self, room: int, wait_s: float, take: Callable[[Record], None]) -> None:
        """Hand up to `room` records to `take`, waiting up to `wait_s` for the first (0: not at all); each
        one is handed over before the next is read, since reading may run a rebalance callback that changes
        what the next record means (a group's partition sought back, or assigned afresh)."""

    def work(self, record: Record, now: float, deadline: float) -> Work | None:
        """Start carrying `record` (its offset tracked from now on); None when it must be skipped (a record
        fetched again after a seek, which its partition already took)."""
        ...

    def hold_back(self, record: Record) -> bool:
        """The stage cannot read `record` now (the Schema Registry does not answer): keep it and offer it
        again once `resume(key)` is called. False when it cannot be held (its last delivery, or a seek that
        failed): the caller settles it otherwise."""
        ...

    def resume(self, key: TopicPartitionKey) -> None:
        """A partition held back for the registry may be read again."""

    def hand_back(self, work: Work) -> HandBack:
        """The model process died under `work`: the source may give it to another try itself (queue mode
        releases it while it has deliveries left)."""
        ...

    def maintain(self, now: float) -> None:
        """Once a turn: start positions, pauses, locks; metrics gauges."""

    def pause_all(self) -> None:
        """The in-flight bound held for a while, or shutdown: read no more records (keep the member alive)."""

    def resume_all(self) -> None:
        """Below the bound again."""

    def in_flight(self) -> int:
        """Records taken and not settled for good yet (group: not covered by a confirmed commit)."""
        ...

    @property
    def exhausted(self) -> bool:
        """A finite source (a file, a replay's range) was read to its end."""
        ...

    @property
    def rebalances(self) -> bool:
        """Whether a read may run a rebalance callback (a consumer group's partitions are revoked inside a
        poll): the loop then reads nothing while a background commit is on its way (`engine.Engine`). Added
        for replay, whose assigned partitions never move: holding its reads back for each commit made it a
        third slower (5,000 dead letters at least once: 1.3-1.5 s against 0.8 s)."""
        ...

    def stop_taking(self) -> None:
        """Shutdown began: nothing more is taken; what was read and not taken may go back now."""

    def poll_while_stopping(self) -> None:
        """During shutdown: keep the member alive without taking records."""

    def stop(self, limit: float) -> None:
        """Shutdown: release whatever is not finished (queue mode), then close."""

    def described(self) -> dict[str, object]:
        """The source's settings, for the start line in the log."""
        ...

    def logged(self) -> dict[str, object]:
        """The source's state for the metrics line (group mode: the partitions a failed delivery stopped)."""
        ...


class Admission(Protocol):
    """What a stage made of a record before it is taken: readable, or not now (`unavailable`: the Schema
    Registry gave no answer about it)."""

    @property
    def unavailable(self) -> RegistryUnavailable | None: ...


AdmissionT = TypeVar("AdmissionT", bound=Admission)


class Stage(Protocol[AdmissionT]):
    """What happens to a taken record between the source and the settlement (the triage stage: decode,
    dispatch, classify, encode; replay's: select, repair, republish)."""

    def admit(self, record: Record) -> AdmissionT:
        """Read `record` before it is taken: one the stage cannot read *now* is not taken at all."""
        ...

    def take(self, work: Work, record: Record, admission: AdmissionT) -> None:
        """`work` (of `record`) was taken: write its output through the settlement now or later."""

    def cannot_hold(self, work: Work, unavailable: RegistryUnavailable) -> None:
        """`work` was taken although the stage could not read it (the source could not hold it back): its
        outcome must still be written (a dead letter saying why)."""

    def answer_now(self, works: Collection[Work], reason: FallbackReason) -> None:
        """Of `works`, those still waiting for the model or at it are answered with the `reason` fallback
        now (their model answers, when they come, are discarded); the others are left as they are. Added for
        queue mode's last deliveries (`Loop.answer_now`)."""

    def serve(self, wait_s: float) -> None:
        """Answers, expiry, dispatch and side topics; waits up to `wait_s` for an answer when one is due."""

    @property
    def busy(self) -> bool:
        """Work is at a model (the loop then waits on answers rather than on the source)."""
        ...

    def room(self) -> int:
        """How many more records the stage would start on at once (a source paced by the model reads no
        more than that)."""
        ...

    def __len__(self) -> int:
        """Taken records without an outcome yet."""
        ...

    @property
    def orphans(self) -> int:
        """Records of partitions given up, still at a model (counted in flight until their answer)."""
        ...

    def first(self, keys: set[TopicPartitionKey]) -> None:
        """Revoking: the records of `keys` go before all others."""

    def pending(self, keys: set[TopicPartitionKey]) -> int: ...

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        """`keys` left this worker: their waiting records are dropped, those at a model become orphans."""

    def close(self, flush_s: float) -> None:
        """After the last settlement: side topics flushed within `flush_s`."""

    def described(self) -> dict[str, object]: ...

    def where(self) -> list[int]:
        """Where the in-flight records are, for the metrics line: [waiting, at the model, escalated]."""
        ...


class Settlement(Protocol):
    """How outputs reach their destination and each record is settled (see each implementation)."""

    def start(self) -> None:
        """Once before the source opens; raises UserError when it cannot work at all."""

    def taken(self, work: Work) -> None:
        """A record was taken, in the source's order."""

    def write(self, work: Work, output: Output) -> None:
        """The output for one record; it is settled once the destination acknowledged it."""

    def done(self, work: Work) -> None:
        """A taken record that needs no output (replay: one its filters or its loop bound pass over) is
        settled as if its output had been acknowledged: its position may be committed past, and, in order, it
        holds its partition's later outputs back no longer. Added for replay (the triage stage writes an
        output for every record: a triage record or a dead letter)."""

    def serve(self, wait_s: float) -> None:
        """Delivery reports, waiting up to `wait_s` for one."""

    def advance(self) -> None:
        """Apply commit outcomes, commit when due."""

    @property
    def committing(self) -> bool:
        """A background commit is on its way (the loop then does not read: a rebalance callback runs inside
        a read)."""
        ...

    def wait(self, wait_s: float) -> None:
        """Nothing else to do: wait for a commit or a report."""

    @property
    def producing(self) -> bool:
        """Outputs still go out (False while an exactly-once transaction is doomed to abort)."""
        ...

    @property
    def outstanding(self) -> int:
        """Outputs written and not acknowledged yet."""
        ...

    @property
    def orphans(self) -> int:
        """Outputs of partitions given up, still awaiting their report."""
        ...

    def pending(self, keys: set[TopicPartitionKey]) -> int:
        """Outputs of `keys` written and not acknowledged yet (held ones included)."""
        ...

    def settle(self, limit: float) -> None:
        """Revoking, before the partitions drain: a commit on its way lands first."""

    def commit_now(self, keys: set[TopicPartitionKey], limit: float) -> None:
        """Revoking, after the drain: the progress of `keys` committed before they go."""

    def assigned(self, keys: Sequence[TopicPartitionKey]) -> None: ...

    def lost(self, keys: set[TopicPartitionKey]) -> None: ...

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        """`keys` left this worker: their outputs not acknowledged are not its own any more."""

    def abandon(self, works: Collection[Work]) -> None:
        """The source released these records: their reports, when they come, change nothing."""

    def stop(self, limit: float) -> int:
        """Shutdown: flush and settle what is done; returns how many outputs were not flushed."""
        ...

    def where(self) -> list[int]:
        """For the metrics line: [at the producer, held for order]."""
        ...
