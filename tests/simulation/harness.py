"""One harness per door: the real door as the app assembles it, over the simulated world, run through one
schedule, then checked.

A run has two phases. **The schedule**: workers (engines) of the door run one after the other — one ends
with SIGTERM (`request_stop`) or kill -9 (`Killed` raised out of a wait) and its replacement starts after
the event's delay — while the schedule's inputs arrive and its faults happen, until the end of the
schedule, where the worker gets SIGTERM. **The healthy worker**: the faults heal (the registry answers,
the model answers every try, the broker takes every record) and one more worker of the same group runs
until every input is settled or a bounded time passed: what was left "available to the group" must be
settled by it. Then the door's checks look at what became of each input (`checks.py`, and each harness's
settlement checks); commits are checked the moment they land.

Single-threaded and deterministic: one virtual clock (`clock.py`), the committer on the loop's thread, the
line reader without its thread.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, cast

import confluent_kafka
import msgspec

from worker.app import replay as replay_door
from worker.app.doors import TriageParts, group_pipeline, queue_pipeline
from worker.app.offline import Offline, lines_pipeline
from worker.inference.pool import ClassifierPool
from worker.inference.switch import SwitchingClassifier
from worker.kafka import dead_letters
from worker.kafka.clients import ClientFactory
from worker.kafka.share_groups import ShareGroup
from worker.messages import TriageResult
from worker.pipeline.engine import Engine
from worker.pipeline.failure import Failure
from worker.pipeline.settlements import in_order
from worker.pipeline.sources.lines import Line, stream_lines
from worker.pipeline.work import Output, Work
from worker.replay.outcomes import SELECTED, PartitionPlan, RecordReport, ReplayOutcome, ReplaySummary
from worker.replay.selection import ReplayOptions
from worker.settings import Settings, load_settings

from .checks import Outcome, Violation, outcome_checks
from .clock import Hung, Killed, VirtualClock
from .fakes import (
    SimClients,
    SimConsumer,
    SimKafka,
    SimLineReader,
    SimReplayConsumer,
    SimShareGroup,
    loop_committer,
)
from .model import FALLBACK, SimModel, SimRegistry, headers_of, key_of, value_of
from .schedule import Event, Input, Schedule

INPUT, OUTPUT, DEAD = "tickets.raw", "tickets.triaged", "tickets.dlq"
GROUP = "sim"
_RESULTS = msgspec.json.Decoder(TriageResult)
_TICKET = re.compile(rb"T-(\d+)")
_ERRORS = {
    "too_large": confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE,
    "replicas": confluent_kafka.KafkaError.NOT_ENOUGH_REPLICAS,
    "timeout": confluent_kafka.KafkaError._MSG_TIMED_OUT,
}
# How long the healthy worker after the schedule may take to settle what was left (virtual seconds).
HEALTHY_RUN_S = 120.0
# How soon a worker that ended by itself is started again (a supervisor's restart).
RESTART_S = 1.0


@functools.lru_cache(maxsize=512)
def door_settings(door: str, schedule_knobs: Any) -> Settings:
    knobs = schedule_knobs
    overrides: dict[str, object] = {
        "kafka.bootstrap.servers": "memory:9092",
        "kafka.delivery.timeout.ms": str(knobs.delivery_timeout_ms),
        "topics.input": INPUT,
        "topics.output": OUTPUT,
        "topics.dead_letter": DEAD,
        "pipeline.group_id": GROUP,
        "pipeline.deadline_ms": knobs.deadline_ms,
        "pipeline.max_in_flight": knobs.max_in_flight,
        "pipeline.shutdown_timeout_ms": knobs.shutdown_timeout_ms,
        "pipeline.revoke_timeout_ms": knobs.revoke_timeout_ms,
        "pipeline.commit_interval_ms": knobs.commit_interval_ms,
        "pipeline.poll_timeout_ms": knobs.poll_timeout_ms,
        "pipeline.max_value_bytes": knobs.max_value_bytes,
        "pipeline.guarantee": "exactly_once" if door.endswith("eos") else "at_least_once",
    }
    if door == "queue":
        overrides["pipeline.consume"] = "queue"
    return load_settings(env={}, overrides=overrides)


class Harness:
    """What every door's harness shares: the clock, the model, the schedule's events, the workers one
    after the other, the healthy worker, the checks. A subclass says how its door is built and read."""

    # The door's input is a stream (Kafka): the schedule ends with a SIGTERM and a healthy worker follows.
    endless = True

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.knobs = schedule.knobs
        self.settings = door_settings(schedule.door, schedule.knobs)
        self.clock = VirtualClock()
        self.model = SimModel(self.clock, schedule.inputs)
        self.registry = SimRegistry(self.knobs.max_value_bytes) if self.knobs.registry else None
        self.violations: list[Violation] = []
        self.engine: Engine | None = None
        self.workers = 0
        self.restart_at: float | None = None
        self.over = False
        self.healed = False
        # What happened, for the duplicate rules: kill, lose, revoke, stop, refused.
        self.happened: set[str] = set()
        self._outputs_tried: defaultdict[int, int] = defaultdict(int)
        # Hot reloads: the model ids they switched to, and the running worker's switch and parts.
        self.happened_reloads: list[str] = []
        self.switch: SwitchingClassifier | None = None
        self.running_parts: TriageParts | None = None

    # -- the run ----------------------------------------------------------------------------------------

    def run(self) -> list[Violation]:
        clock = self.clock
        self.setup()
        for each in self.schedule.inputs:
            if each.at <= 0:
                self.arrive(each)
            else:
                clock.at(clock.start + each.at, functools.partial(self.arrive, each))
        for event in self.schedule.events:
            clock.at(clock.start + event.at, functools.partial(self.fire, event))
        if self.endless:
            clock.at(clock.start + self.end_s(), self.end_of_schedule)
        try:
            with self.patched():
                while True:
                    self.restart_at = None
                    self.run_worker(self.start_worker())
                    if self.over or not self.endless:
                        break
                    # A worker that ended by itself (a failure, a replay at its end) is started again.
                    clock.until(self.restart_at if self.restart_at is not None else clock.now + RESTART_S)
                    if self.over:
                        break
                if self.endless:
                    self.healthy_run()
        except Hung as hung:
            self.violate("the loop did not end", None, str(hung))
        for broken in self.model.broken:
            self.violate("a pool's contract broken across a reload", None, broken)
        self.check()
        return self.violations

    def end_s(self) -> float:
        """When the schedule ends: after its last event or arrival has had time to play out."""
        last = max(
            [event.at + event.for_s for event in self.schedule.events]
            + [each.at for each in self.schedule.inputs]
            + [0.0]
        )
        return last + 1.0 + self.knobs.deadline_ms / 1000.0

    def run_worker(self, engine: Engine, healthy: bool = False) -> None:
        self.engine = engine
        self.workers += 1
        try:
            code = engine.run()
        except Killed:
            self.happened.add("kill")
            return
        except Hung:
            raise
        except Exception as error:
            where = "".join(traceback.format_exception(error)[-3:]).strip()
            self.violate("the loop raised", None, f"{type(error).__name__}: {error} ({where})")
            return
        finally:
            self.engine = None
        if code != 0 and not self.may_fail():
            self.violate("the loop exited non-zero", None, f"exit code {code} (worker {self.workers})")

    def may_fail(self) -> bool:
        """Whether a run may end with exit code 1 (replay: a publish that failed for good)."""
        return False

    def end_of_schedule(self) -> None:
        self.over = True
        if self.engine is not None:
            self.engine.request_stop()

    def healthy_run(self) -> None:
        """The faults heal; one more worker runs until every input is settled (or `HEALTHY_RUN_S`)."""
        self.healed = self.model.healed = True
        if self.registry is not None:
            self.registry.answering = True
        engine = self.start_worker()
        give_up_at = self.clock.now + HEALTHY_RUN_S + self.knobs.lock_ms / 1000.0

        def watch() -> None:
            if self.engine is not engine:
                return
            if self.settled() or self.clock.now >= give_up_at:
                engine.request_stop()
            else:
                self.clock.after(0.25, watch)

        self.clock.after(0.25, watch)
        self.run_worker(engine, healthy=True)

    def fire(self, event: Event) -> None:
        """An event of the schedule, at its instant (events for a worker that is not running are moot)."""
        engine = self.engine
        if self.over:
            return
        if event.kind == "registry_away" and self.registry is not None:
            registry = self.registry
            registry.answering = False
            self.clock.after(event.for_s, lambda: setattr(registry, "answering", True))
            return
        if engine is None:
            return
        if event.kind == "reload":
            self.reload()
        elif event.kind == "stop":
            self.happened.add("stop")
            self.restart_at = self.clock.now + event.for_s
            engine.request_stop()
        elif event.kind == "kill":
            self.restart_at = self.clock.now + event.for_s
            self.killed()
            raise Killed()
        else:
            self.partition_event(event)

    def violate(self, prop: str, index: int | None, detail: str) -> None:
        if all((v.prop, v.index) != (prop, index) for v in self.violations):
            self.violations.append(Violation(prop, index, detail))

    def refusal(self, topic: str, value: bytes | None) -> confluent_kafka.KafkaError | None:
        """`MemoryKafka.hooks.delivery`: each output of an input meets the broker as its `refusals` say."""
        if self.healed or value is None:
            return None
        found = _TICKET.search(value)
        if found is None:
            return None
        index = int(found.group(1))
        inputs = self.schedule.inputs
        each = next((e for e in inputs if e.index == index), None)
        if each is None:
            return None
        attempt = self._outputs_tried[index]
        self._outputs_tried[index] += 1
        if attempt >= len(each.refusals):
            return None
        self.happened.add("refused")
        return confluent_kafka.KafkaError(_ERRORS[each.refusals[attempt]], "refused by the simulated broker")

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        yield

    # -- what a door says -------------------------------------------------------------------------------

    def setup(self) -> None:
        raise NotImplementedError

    def arrive(self, each: Input) -> None:
        raise NotImplementedError

    def start_worker(self) -> Engine:
        raise NotImplementedError

    def killed(self) -> None:
        """kill -9 of the running worker: what the broker sees of it."""

    def partition_event(self, event: Event) -> None:
        pass

    def settled(self) -> bool:
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def reload(self) -> None:
        """A hot reload as `worker.app.reload` does one: the new pool (loaded and checked off the loop) is
        staged on the running worker's switch, and the running parts get the settings applied live."""
        self.happened.add("reload")
        self.happened_reloads.append(f"sim@reload{len(self.happened_reloads) + 1}")
        self.model = self.model.successor(self.happened_reloads[-1])
        if self.switch is not None and self.running_parts is not None:
            self.switch.stage(cast(ClassifierPool, self.model))
            self.running_parts.reloaded(self.settings)

    def parts(self) -> TriageParts:
        """A worker's parts: its model a `SwitchingClassifier` over the pool configured now (a worker
        started after a reload loads the reloaded model) of its own (the answers its predecessor's pool
        owed died with that worker), retired pools closed at once on the loop."""
        self.model = self.model.successor(self.model.model_id)
        self.switch = SwitchingClassifier(cast(ClassifierPool, self.model), closer=lambda pool: pool.close())
        self.running_parts = TriageParts(
            self.switch, FALLBACK, self.knobs.dispatch_window, decoder=self.registry
        )
        return self.running_parts


def _outcomes_from(kafka: SimKafka, committed_only: bool) -> dict[tuple[int, int], list[Outcome]]:
    """The outputs in the output and dead-letter topics, by the input position they name."""
    found: dict[tuple[int, int], list[Outcome]] = defaultdict(list)

    def records(topic: str) -> list[Any]:
        if committed_only:
            return [record for _, record in kafka.read_committed(topic)]
        return [record for log in kafka.logs[topic] for record in log]

    for record in records(OUTPUT):
        result = _RESULTS.decode(record.value or b"")
        found[(result.source.partition, result.source.offset)].append(Outcome(False, result.fallback_reason))
    for record in records(DEAD):
        info = dead_letters.read_dead_letter(record.headers or [])
        found[(info.partition, info.offset)].append(Outcome(True, info.error_type, info.error_message))
    return found


class GroupHarness(Harness):
    """`run` in group mode (`doors.group_pipeline`), at least once or exactly once: settled = committed
    past."""

    def setup(self) -> None:
        knobs = self.knobs
        self.exactly_once = self.schedule.door.endswith("eos")
        self.kafka = kafka = SimKafka(self.clock, knobs.message_max_bytes)
        kafka.create_topic(INPUT, knobs.partitions)
        kafka.create_topic(OUTPUT, 1)
        kafka.create_topic(DEAD, 1)
        kafka.hooks.delivery = self.refusal
        kafka.on_commit = self.on_commit
        self.positions: dict[int, tuple[int, int]] = {}
        self.consumer: SimConsumer | None = None

    def arrive(self, each: Input) -> None:
        offset = self.kafka.append(INPUT, each.partition, value_of(each), key_of(each), headers_of(each))
        self.positions[each.index] = (each.partition, offset)

    def start_worker(self) -> Engine:
        clients = SimClients(self.kafka, GROUP, "sim-tid" if self.exactly_once else None)
        engine = group_pipeline(
            self.settings,
            self.parts(),
            clients=cast(ClientFactory, clients),
            metrics_interval_s=1e9,
            clock=self.clock,
            committer=loop_committer(self.knobs.commit_lag),
        )
        self.consumer = clients.consumers[-1]
        return engine

    def killed(self) -> None:
        consumer = self.consumer
        if consumer is not None and consumer in self.kafka.members:
            self.kafka.members.remove(consumer)  # the broker forgets it (its session ends)

    def partition_event(self, event: Event) -> None:
        consumer = self.consumer
        key = (INPUT, event.partition)
        if consumer is None or consumer.events or key not in consumer.assigned:
            return
        self.happened.add(event.kind)
        if event.kind == "revoke":
            self.kafka.revoke(consumer, [key])
        else:
            self.kafka.lose(consumer, [key])

        def back() -> None:
            alive = consumer is self.consumer and not consumer.closed and consumer in self.kafka.members
            if alive and not consumer.events and key not in consumer.assigned:
                self.kafka.assign(consumer, [key])

        self.clock.after(event.for_s, back)

    def committed_at(self, partition: int) -> int:
        return self.kafka.committed[GROUP].get((INPUT, partition), 0)

    def on_commit(self, group: str, positions: dict[tuple[str, int], int], transactional: bool) -> None:
        """At the instant a commit lands: no input below it may lack an output."""
        if group != GROUP:
            return
        outcomes = _outcomes_from(self.kafka, committed_only=self.exactly_once)
        for index, (partition, offset) in self.positions.items():
            if offset < positions.get((INPUT, partition), -1) and not outcomes.get((partition, offset)):
                self.violate(
                    "committed past a record without an outcome",
                    index,
                    f"p{partition} committed to {positions[(INPUT, partition)]}"
                    f" at t={self.clock.elapsed:.3f}s",
                )

    def settled(self) -> bool:
        ends = self.kafka.end_offsets(INPUT)
        return all(self.committed_at(p) >= end for p, end in ends.items())

    def check(self) -> None:
        outcomes = _outcomes_from(self.kafka, committed_only=self.exactly_once)
        excused = self.happened & {"kill", "lose", "revoke", "stop", "refused"}
        for each in self.schedule.inputs:
            position = self.positions.get(each.index)
            if position is None:
                continue
            outs = outcomes.get(position, [])
            committed = position[1] < self.committed_at(position[0])
            if not committed:
                self.violate(
                    "not settled by a healthy worker", each.index, f"p{position[0]} offset {position[1]}"
                )
            elif not outs:
                self.violate("committed past a record without an outcome", each.index, "at the end")
            if len(outs) > 1 and self.exactly_once:
                said = "; ".join(out.describe() for out in outs)
                self.violate("duplicate in exactly-once", each.index, said)
            elif len(outs) > 1 and not excused:
                said = "; ".join(out.describe() for out in outs)
                self.violate("duplicate without a crash, a loss, a stop or a refusal", each.index, said)
            for violation in outcome_checks(each, outs, self.model.died):
                self.violate(violation.prop, violation.index, violation.detail)


class QueueHarness(Harness):
    """`run --consume queue` (`doors.queue_pipeline`) over `MemoryShareGroup`: settled = acknowledged
    (ACCEPT, REJECT) or archived."""

    def setup(self) -> None:
        knobs = self.knobs
        self.kafka = kafka = SimKafka(self.clock, knobs.message_max_bytes)
        for topic in (INPUT, OUTPUT, DEAD):
            kafka.create_topic(topic, 1)
        kafka.hooks.delivery = self.refusal
        self.share = SimShareGroup(kafka, self.clock, knobs.lock_ms, knobs.delivery_count_limit)
        self.offsets: dict[int, int] = {}
        self._members_before = 0

    def arrive(self, each: Input) -> None:
        offset = self.kafka.append(INPUT, 0, value_of(each), key_of(each), headers_of(each))
        self.offsets[each.index] = offset
        if self.knobs.producer_batch and each.at <= 0:
            self.kafka.logs[INPUT][0][offset].batch = -1  # one producer batch, handed out whole
        if each.prior_deliveries:
            self.share.delivery(INPUT, 0, offset).count = each.prior_deliveries

    def start_worker(self) -> Engine:
        self._members_before = len(self.share.consumers)
        group = ShareGroup(lock_ms=self.knobs.lock_ms, delivery_count_limit=self.knobs.delivery_count_limit)
        return queue_pipeline(
            self.settings, self.parts(), group, clients=self.share.clients(), metrics_interval_s=1e9,
            clock=self.clock,
        )  # fmt: skip

    def killed(self) -> None:
        for member in self.share.consumers[self._members_before :]:
            if not member.closed:
                self.share.killed(member)

    def settled(self) -> bool:
        return all(
            self.share.delivery(INPUT, 0, offset).state in ("acknowledged", "archived")
            for offset in self.offsets.values()
        )

    def check(self) -> None:
        outcomes = _outcomes_from(self.kafka, committed_only=False)
        share = self.share
        for each in self.schedule.inputs:
            offset = self.offsets.get(each.index)
            if offset is None:
                continue
            outs = outcomes.get((0, offset), [])
            key = (INPUT, 0, offset)
            delivery = share.delivery(*key)
            said = "; ".join(out.describe() for out in outs) or "nothing written"
            if delivery.state == "archived" and not outs:
                if share.crashed.get(key) == delivery.count:
                    pass  # killed on its last delivery: the broker archives it (KIP-1191's topic keeps it)
                else:
                    path = share.release_paths.get(key, "its lock ending")
                    self.violate(
                        "archived without an outcome",
                        each.index,
                        f"delivery {delivery.count} of {share.delivery_count_limit} released by {path}",
                    )
            elif delivery.state == "acknowledged" and not any(not out.dead for out in outs):
                self.violate("accepted without a triage record", each.index, said)
            elif delivery.state in ("available", "acquired"):
                self.violate(
                    "not settled by a healthy worker",
                    each.index,
                    f"{delivery.state}, delivery {delivery.count}",
                )
            redelivered = delivery.count - each.prior_deliveries > 1
            if len(outs) > 1 and not redelivered:
                self.violate("duplicate without a redelivery", each.index, said)
            for violation in outcome_checks(each, outs, self.model.died):
                self.violate(violation.prop, violation.index, violation.detail)


class _Reports:
    """A replay's observer: every record report, by dead-letter offset, in the order they came."""

    def __init__(self) -> None:
        self.by_offset: defaultdict[int, list[RecordReport]] = defaultdict(list)

    def planned(self, plan: list[PartitionPlan]) -> None:
        pass

    def settled(self, report: RecordReport) -> None:
        self.by_offset[report.offset].append(report)


class ReplayHarness(Harness):
    """`replay` (`replay.replay_pipeline`) of the dead-letter topic, at least once or exactly once: each
    input is a dead letter; settled = committed past by the replay's group, with a report."""

    def setup(self) -> None:
        self.exactly_once = self.schedule.door.endswith("eos")
        self.kafka = kafka = SimKafka(self.clock, self.knobs.message_max_bytes)
        kafka.create_topic(INPUT, 1)
        kafka.create_topic(DEAD, 1)
        kafka.hooks.delivery = self.refusal
        kafka.on_commit = self.on_commit
        self.reports = _Reports()
        self.offsets: dict[int, int] = {}
        self.values: dict[int, bytes | None] = {}

    def arrive(self, each: Input) -> None:
        value = value_of(each)
        headers = (
            None
            if each.shape == "no_headers"
            else dead_letters.dead_letter_headers(None, "missing_field", "m", INPUT, 0, each.index)
        )
        self.offsets[each.index] = self.kafka.append(DEAD, 0, value, key_of(each), headers)
        self.values[each.index] = value

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        kafka, exactly_once = self.kafka, self.exactly_once
        saved = replay_door._ReplayClients

        def clients(settings: Settings, group: str) -> SimClients:
            return SimClients(kafka, group, "sim-replay-tid" if exactly_once else None)

        replay_door._ReplayClients = clients  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            replay_door._ReplayClients = saved  # type: ignore[misc]

    def start_worker(self) -> Engine:
        consumer = SimReplayConsumer(self.kafka, "replay")
        options = ReplayOptions(dlq_topic=DEAD, group="replay")
        summary = ReplaySummary(DEAD, "replay", False)
        return replay_door.replay_pipeline(
            self.settings, options, cast(confluent_kafka.Consumer, consumer), summary, self.reports,
            Failure(), clock=self.clock, committer=loop_committer(self.knobs.commit_lag),
        )  # fmt: skip

    def may_fail(self) -> bool:
        return "refused" in self.happened  # a publish that failed for good ends the run with exit 1

    def committed(self) -> int:
        return self.kafka.committed["replay"].get((DEAD, 0), 0)

    def on_commit(self, group: str, positions: dict[tuple[str, int], int], transactional: bool) -> None:
        if group != "replay" or self.exactly_once:
            return  # exactly once, a record is reported once its transaction committed: checked at the end
        for index, offset in self.offsets.items():
            if offset >= positions.get((DEAD, 0), -1):
                continue
            reports = self.reports.by_offset.get(offset)
            if reports and reports[-1].outcome is ReplayOutcome.PUBLISH_FAILED:
                self.violate("committed past a failed publish", index, f"at t={self.clock.elapsed:.3f}s")
            if not reports:
                self.violate(
                    "committed past a record without an outcome", index, f"at t={self.clock.elapsed:.3f}s"
                )

    def settled(self) -> bool:
        return self.committed() >= len(self.kafka.logs[DEAD][0])

    def check(self) -> None:
        if self.exactly_once:
            written = [record.value for _, record in self.kafka.read_committed(INPUT)]
        else:
            written = [record.value for record in self.kafka.logs[INPUT][0]]
        excused = self.happened & {"kill", "stop", "refused"}
        # A run that selected no record commits nothing (docs/guarantees.md, "Replaying dead letters").
        selected = any(
            reports[-1].outcome in SELECTED for reports in self.reports.by_offset.values() if reports
        )
        for each in self.schedule.inputs:
            offset = self.offsets.get(each.index)
            if offset is None:
                continue
            reports = self.reports.by_offset.get(offset, [])
            last = reports[-1].outcome if reports else None
            copies = written.count(self.values[each.index]) if self.values[each.index] is not None else 0
            if offset >= self.committed() and selected:
                self.violate(
                    "not settled by a healthy worker", each.index, f"offset {offset}, reports {reports}"
                )
            elif last is None and "kill" not in self.happened:  # a killed run's reports die with it
                self.violate("committed past a record without an outcome", each.index, "at the end")
            if last is ReplayOutcome.REPLAYED and copies == 0:
                self.violate("reported replayed, not republished", each.index, f"offset {offset}")
            if copies > 1 and (self.exactly_once or not excused):
                self.violate(
                    "republished twice",
                    each.index,
                    f"{copies} copies, reports {[r.outcome for r in reports]}",
                )
            if each.shape == "no_headers" and copies:
                self.violate("replayed a record that is not a dead letter", each.index, f"{copies} copies")


class LinesHarness(Harness):
    """`classify --input` / `model eval` (`offline.lines_pipeline`): each line's outcome in input order."""

    endless = False  # a file ends: the run ends once every line is settled

    def setup(self) -> None:
        self.delivered: list[tuple[int, Outcome]] = []
        self.stopped = False

    def arrive(self, each: Input) -> None:
        pass  # every line is in the file from the start

    def _lines(self) -> list[Line]:
        lines: list[Line] = []
        limit = self.knobs.max_value_bytes
        for position, each in enumerate(self.schedule.inputs):
            value = value_of(each) or b""
            ((_, line, unread),) = list(stream_lines(io.BytesIO(value + b"\n"), limit))
            lines.append((position, line, unread))
        return lines

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        module = vars(in_order)  # `InOrder.wait` sleeps outright: on the virtual clock here
        saved = module["time"]
        module["time"] = _VirtualTime(self.clock)
        try:
            yield
        finally:
            module["time"] = saved

    def start_worker(self) -> Engine:
        reader = SimLineReader(self._lines(), "sim.jsonl")

        def deliver(work: Work, output: Output) -> None:
            if output.topic == DEAD:
                info = dead_letters.read_dead_letter(output.headers or [])
                outcome = Outcome(True, info.error_type, info.error_message)
            else:
                outcome = Outcome(False, _RESULTS.decode(output.value or b"").fallback_reason)
            self.delivered.append((work.offset, outcome))

        offline = Offline(cast(ClassifierPool, self.model), None, FALLBACK)
        return lines_pipeline(self.settings, offline, reader, deliver, clock=self.clock)

    def fire(self, event: Event) -> None:
        if event.kind == "stop" and self.engine is not None:
            self.stopped = True
            self.engine.request_stop()

    def settled(self) -> bool:
        return True

    def check(self) -> None:
        order = [position for position, _ in self.delivered]
        if order != sorted(set(order)):
            self.violate("lines out of input order or repeated", None, f"delivered {order}")
        if not self.stopped and order != list(range(len(self.schedule.inputs))):
            self.violate("line without an outcome", None, f"delivered {order} of {len(self.schedule.inputs)}")
        if self.stopped and order != list(range(len(order))):
            self.violate("lines after a gap", None, f"delivered {order}")
        by_position: defaultdict[int, list[Outcome]] = defaultdict(list)
        for position, outcome in self.delivered:
            by_position[position].append(outcome)
        for position, each in enumerate(self.schedule.inputs):
            for violation in outcome_checks(each, by_position.get(position, []), self.model.died):
                self.violate(violation.prop, violation.index, violation.detail)


class _VirtualTime:
    """What `settlements/in_order.py` uses of the `time` module, on the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.sleep = clock.sleep
        self.monotonic = clock


HARNESSES: dict[str, Callable[[Schedule], Harness]] = {
    "group-alo": GroupHarness,
    "group-eos": GroupHarness,
    "queue": QueueHarness,
    "replay-alo": ReplayHarness,
    "replay-eos": ReplayHarness,
    "lines": LinesHarness,
}


def simulate(schedule: Schedule) -> list[Violation]:
    """Run `schedule` on its door; the promises it broke."""
    return HARNESSES[schedule.door](schedule).run()
