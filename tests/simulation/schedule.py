"""A schedule: everything one simulated run does, generated from a seed (`generate(door, seed)`).

A schedule is plain data, so that it prints (`describe`), shrinks (`smaller`: the same schedule with one
input or one event less, or one input made plain) and replays exactly: the run itself draws no random
number. It holds

- the door's numbers (`Knobs`): deadline, in-flight bound, dispatch window, shutdown and revoke timeouts,
  commit interval and the committer's lag, partitions, the share group's lock and delivery limit, size limits;
- the inputs (`Input`), each of a `shape` (a valid ticket, undecodable bytes, a ticket missing a field or
  failing validation, one over `pipeline.max_value_bytes`, a key over the key limit, big headers, a
  `deadline_at` past or future, spelt several ways), what the model does on each try of it (`fates`), how
  the broker answers each of its outputs (`refusals`), when it arrives, and (queue mode) how many of its
  deliveries were spent before the run;
- the events (`Event`), each at a virtual instant: SIGTERM (`stop`), kill -9 (`kill`), each followed by a
  replacement worker `restart_s` later; a partition revoked or lost and given back; the Schema Registry
  away and back; a hot reload (`reload`: `run`'s doors only), which switches new tickets to a new pool while
  the old one still owes answers, and hands the running parts the settings a reload applies live.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

DOORS = ("group-alo", "group-eos", "queue", "replay-alo", "replay-eos", "lines")
DOOR_NAMES = {
    "group-alo": "group mode, at least once",
    "group-eos": "group mode, exactly once",
    "queue": "queue mode (share group)",
    "replay-alo": "replay, at least once",
    "replay-eos": "replay, exactly once",
    "lines": "classify / model eval lines",
}

# What the model does on one try of a ticket: answer after `latency_s`; answer after `s` seconds ("slow:s",
# past the deadline the pool answers `deadline_exceeded` at the deadline); raise in the engine ("raise": the
# pool answers `model_error`); its process dies under it ("die": `model_error` as well, after a while).
ANSWER, RAISE, DIE = "answer", "raise", "die"
# How the broker answers one output of an input: "too_large" (MSG_SIZE_TOO_LARGE), "replicas"
# (NOT_ENOUGH_REPLICAS: a retriable error that outlasted the client's retries), "timeout" (_MSG_TIMED_OUT).
REFUSALS = ("too_large", "replicas", "timeout")

VALID_SHAPES = (
    "ticket",
    "ticket_subject_only",
    "deadline_future",
    "deadline_past",
    "deadline_past_lower",  # `2001-01-01t00:00:00z`: RFC 3339 allows the lower-case t and z
    "big_headers",
)
POISON_SHAPES = (
    "undecodable",
    "not_an_object",
    "missing_ticket_id",
    "empty_ticket",
    "wrong_type",
    "oversized",
    "big_key",
    "deadline_invalid",
    "null_value",
)


@dataclass(frozen=True)
class Input:
    index: int
    shape: str
    partition: int = 0
    at: float = 0.0
    fates: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()
    prior_deliveries: int = 0
    latency_s: float = 0.02

    @property
    def valid(self) -> bool:
        return self.shape in VALID_SHAPES

    @property
    def raises(self) -> bool:
        """The model raises on this ticket on every try (a context too short for it, say)."""
        return RAISE in self.fates

    def describe(self) -> str:
        parts = [f"#{self.index} {self.shape}"]
        if self.partition:
            parts.append(f"p{self.partition}")
        if self.at:
            parts.append(f"at {self.at:.3f}s")
        if self.fates:
            parts.append("model " + ",".join(self.fates))
        if self.refusals:
            parts.append("broker " + ",".join(self.refusals))
        if self.prior_deliveries:
            parts.append(f"{self.prior_deliveries} deliveries spent")
        return " ".join(parts)


@dataclass(frozen=True)
class Event:
    at: float
    kind: str  # stop | kill | revoke | lose | registry_away | reload
    partition: int = 0
    # revoke / lose: the partition comes back after `for_s`; registry_away: it answers again after it;
    # stop / kill: the replacement worker starts `for_s` later.
    for_s: float = 0.0

    def describe(self) -> str:
        what = {
            "stop": f"SIGTERM, replacement after {self.for_s:.2f}s",
            "kill": f"kill -9, replacement after {self.for_s:.2f}s",
            "revoke": f"partition {self.partition} revoked, assigned back after {self.for_s:.2f}s",
            "lose": f"partition {self.partition} lost, assigned back after {self.for_s:.2f}s",
            "registry_away": f"Schema Registry away for {self.for_s:.2f}s",
            "reload": "hot reload: a new pool for new tickets, the live settings applied",
        }[self.kind]
        return f"t={self.at:7.3f}s  {what}"


@dataclass(frozen=True)
class Knobs:
    deadline_ms: int = 2000
    max_in_flight: int = 16
    dispatch_window: int = 4
    shutdown_timeout_ms: int = 3000
    revoke_timeout_ms: int = 2000
    commit_interval_ms: int = 200
    poll_timeout_ms: int = 100
    # The committer answers this many loop turns after a commit is submitted (0: at once).
    commit_lag: int = 0
    partitions: int = 1
    registry: bool = False
    lock_ms: int = 8000
    delivery_count_limit: int = 3
    delivery_timeout_ms: int = 2000
    max_value_bytes: int = 4096
    message_max_bytes: int = 100_000
    # Queue mode: the inputs there at the start were written in one producer batch, which a share group
    # hands out whole (however many records the consumer asked for).
    producer_batch: bool = False

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


@dataclass(frozen=True)
class Schedule:
    door: str
    seed: int
    knobs: Knobs
    inputs: tuple[Input, ...]
    events: tuple[Event, ...] = field(default=())

    def describe(self) -> str:
        lines = [
            f"door {self.door} ({DOOR_NAMES[self.door]}), seed {self.seed}",
            f"  knobs: {self.knobs.describe()}",
        ]
        lines.append(f"  inputs ({len(self.inputs)}):")
        lines += [f"    {each.describe()}" for each in self.inputs]
        lines.append(f"  events ({len(self.events)}):")
        lines += [f"    {each.describe()}" for each in sorted(self.events, key=lambda e: e.at)]
        return "\n".join(lines)

    def to_json(self) -> str:
        """One line that `from_json` (and `PYTHONPATH=tests python -m simulation --schedule`) reads back."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        data = json.loads(text)
        return cls(
            door=data["door"],
            seed=data["seed"],
            knobs=Knobs(**data["knobs"]),
            inputs=tuple(
                Input(**{**each, "fates": tuple(each["fates"]), "refusals": tuple(each["refusals"])})
                for each in data["inputs"]
            ),
            events=tuple(Event(**each) for each in data["events"]),
        )

    def smaller(self) -> Iterator[Schedule]:
        """Schedules one step simpler: an event left out, an input left out, an input's faults left out."""
        for i in range(len(self.events)):
            yield dataclasses.replace(self, events=self.events[:i] + self.events[i + 1 :])
        for i in range(len(self.inputs)):
            yield dataclasses.replace(self, inputs=self.inputs[:i] + self.inputs[i + 1 :])
        for i, each in enumerate(self.inputs):
            plain = dataclasses.replace(each, fates=(), refusals=(), prior_deliveries=0, at=0.0)
            if plain != each:
                yield dataclasses.replace(self, inputs=(*self.inputs[:i], plain, *self.inputs[i + 1 :]))
        if self.knobs.commit_lag:
            yield dataclasses.replace(self, knobs=dataclasses.replace(self.knobs, commit_lag=0))


def generate(door: str, seed: int) -> Schedule:
    """The schedule of `seed` for `door` (the same on every machine and Python version). A new draw goes
    after the others: the seeds named in `runner.KNOWN` and in the docs keep their schedules."""
    rng = random.Random(f"{door}:{seed}")
    group = door.startswith("group")
    queue = door == "queue"
    replay = door.startswith("replay")
    lines = door == "lines"
    knobs = _knobs(rng, group, queue, replay)
    count = rng.choice((1, 2, 3, 5, 8, 12, 20))
    horizon = rng.choice((0.5, 2.0, 5.0, 12.0))
    inputs = tuple(_input(rng, i, knobs, horizon, door) for i in range(count))
    events: list[Event] = []
    for _ in range(rng.choice((0, 1, 1, 2, 3, 5))):
        at = round(rng.uniform(0.0, horizon), 3)
        kinds = ["stop", "stop"]
        if not lines:
            kinds += ["kill", "kill"]
        if group:
            kinds += ["revoke", "revoke", "lose"]
        if knobs.registry:
            kinds += ["registry_away", "registry_away"]
        kind = rng.choice(kinds)
        partition = rng.randrange(knobs.partitions)
        for_s = round(rng.choice((0.0, 0.05, 0.5, 2.0, 6.0)) * rng.random(), 3)
        if kind == "registry_away":
            for_s = round(rng.choice((0.5, 3.0, 12.0, 30.0)) * rng.random(), 3)
        events.append(Event(at, kind, partition, for_s))
    # Drawn last, so that adding a draw keeps every earlier seed's schedule as it was.
    knobs = dataclasses.replace(knobs, producer_batch=queue and rng.random() < 0.3)
    if (group or queue) and rng.random() < 0.3:
        events += [
            Event(round(rng.uniform(0.0, horizon), 3), "reload") for _ in range(rng.choice((1, 1, 2, 3)))
        ]
    return Schedule(door, seed, knobs, inputs, tuple(sorted(events, key=lambda e: e.at)))


def _knobs(rng: random.Random, group: bool, queue: bool, replay: bool) -> Knobs:
    deadline_ms = rng.choice((300, 1000, 2000))
    delivery_timeout_ms = rng.choice((500, 1000, 2000))
    needed_ms = deadline_ms + delivery_timeout_ms + 1000  # what LockBudget.check asks for
    return Knobs(
        deadline_ms=deadline_ms,
        max_in_flight=rng.choice((1, 2, 4, 8, 64)),
        dispatch_window=rng.choice((1, 2, 4, 16)),
        shutdown_timeout_ms=rng.choice((50, 500, 3000)),
        revoke_timeout_ms=rng.choice((100, 1000, 5000)),
        commit_interval_ms=rng.choice((20, 200, 1000)),
        poll_timeout_ms=rng.choice((100, 250, 500)),
        commit_lag=rng.choice((0, 0, 1, 3)),
        partitions=rng.choice((1, 2, 3)) if group else 1,
        registry=(group or queue) and rng.random() < 0.25,
        lock_ms=needed_ms + rng.choice((100, 500, 2000, 8000)),
        delivery_count_limit=rng.choice((2, 2, 3, 5)),
        delivery_timeout_ms=delivery_timeout_ms,
        max_value_bytes=4096,
        message_max_bytes=rng.choice((100_000, 100_000, 3000)),
    )


def _input(rng: random.Random, index: int, knobs: Knobs, horizon: float, door: str) -> Input:
    if door.startswith("replay"):
        shape = rng.choice(("ticket",) * 6 + ("undecodable", "no_headers", "oversized"))
    elif rng.random() < 0.7:
        shape = rng.choice(("ticket",) * 6 + VALID_SHAPES)
    else:
        shape = rng.choice(POISON_SHAPES)
    if door == "lines" and shape in ("big_key", "big_headers", "null_value"):
        shape = "ticket"  # a line has no key, headers or null value
    fates: tuple[str, ...] = ()
    if rng.random() < 0.35:
        tries = rng.randint(1, 4)
        fates = tuple(
            rng.choice((ANSWER, DIE, DIE, f"slow:{rng.choice((0.2, 0.8, 1.5, 4.0))}")) for _ in range(tries)
        )
        if rng.random() < 0.2:
            fates = (RAISE,)
    refusals: tuple[str, ...] = ()
    if door != "lines" and rng.random() < 0.15:
        refusals = tuple(rng.choice(REFUSALS) for _ in range(rng.randint(1, 2)))
    prior = 0
    if door == "queue" and rng.random() < 0.4:
        prior = rng.randint(1, knobs.delivery_count_limit - 1)
    at = (
        0.0
        if rng.random() < 0.6 or door.startswith("replay") or door == "lines"
        else round(rng.uniform(0, horizon), 3)
    )
    return Input(
        index,
        shape,
        partition=rng.randrange(knobs.partitions),
        at=at,
        fates=fates,
        refusals=refusals,
        prior_deliveries=prior,
        latency_s=rng.choice((0.001, 0.01, 0.05, 0.2)),
    )
