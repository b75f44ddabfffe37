"""Sample tickets for demos and tests: real customer questions, plus malformed records of every kind.

The texts are 154 queries (two per intent) from the BANKING77 test set (Casanueva et al., 2020; CC-BY-4.0,
PolyAI-LDN/task-specific-datasets), shipped in `sample_tickets.csv` beside this module so that a fresh clone
can run the demo. Each record carries a `sample.kind` header (`ticket` or `malformed:<decode error type>`)
that the worker passes through to its output, so a test can check where every record went.
"""

from __future__ import annotations

import csv
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import confluent_kafka
import msgspec

from worker.kafka.clients import DeliveryCallback, create_producer, produce
from worker.messages import utc_timestamp
from worker.settings import Settings

SAMPLES_FILE = Path(__file__).with_name("sample_tickets.csv")
KIND_HEADER = "sample.kind"
TRACE_HEADER = "trace_id"
_CHANNELS = ("email", "chat", "phone", "web")


def load_sample_texts(path: Path = SAMPLES_FILE) -> list[str]:
    with path.open(newline="", encoding="utf-8") as handle:
        return [row["text"] for row in csv.DictReader(handle) if row["text"].strip()]


@dataclass(frozen=True)
class Sample:
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    # The decode error type the worker should report, or None for a valid ticket.
    malformed: str | None


class SampleFactory:
    """Deterministic (per seed) tickets; `malformed_ratio` of them broken in one of several ways."""

    MALFORMED_KINDS: tuple[str, ...] = (
        "invalid_json",
        "not_an_object",
        "missing_field",
        "empty_field",
        "wrong_type",
        "invalid_timestamp",
        "invalid_utf8",
        "null_value",
    )

    def __init__(self, seed: int | None = None, malformed_ratio: float = 0.0, prefix: str | None = None):
        if not 0.0 <= malformed_ratio <= 1.0:
            raise ValueError(f"malformed_ratio must be in [0, 1], got {malformed_ratio}")
        self._rng = random.Random(seed)
        self._ratio = malformed_ratio
        self._texts = load_sample_texts()
        self.prefix = prefix or f"S{uuid.uuid4().hex[:6]}"

    def make(self, index: int) -> Sample:
        rng = self._rng
        ticket_id = f"{self.prefix}-{index:07d}"
        customer = f"C{rng.randint(1, 500):04d}"
        trace = uuid.UUID(int=rng.getrandbits(128)).hex
        ticket: dict[str, object] = {
            "ticket_id": ticket_id,
            "body": rng.choice(self._texts),
            "customer_id": customer,
            "channel": rng.choice(_CHANNELS),
            "created_at": utc_timestamp(),
            "metadata": {"source": "produce-samples"},
        }
        malformed = rng.choice(self.MALFORMED_KINDS) if rng.random() < self._ratio else None
        value = self._broken(ticket, malformed) if malformed else msgspec.json.encode(ticket)
        kind = f"malformed:{malformed}" if malformed else "ticket"
        headers = [(TRACE_HEADER, trace.encode()), (KIND_HEADER, kind.encode())]
        return Sample(key=customer.encode(), value=value, headers=headers, malformed=malformed)

    @staticmethod
    def _broken(ticket: dict[str, object], kind: str) -> bytes | None:
        if kind == "invalid_json":
            return msgspec.json.encode(ticket)[:-7]
        if kind == "not_an_object":
            return msgspec.json.encode([ticket["ticket_id"], ticket["body"]])
        if kind == "missing_field":
            return msgspec.json.encode({k: v for k, v in ticket.items() if k != "body"})
        if kind == "empty_field":
            return msgspec.json.encode({**ticket, "ticket_id": ""})
        if kind == "wrong_type":
            return msgspec.json.encode({**ticket, "body": 42})
        if kind == "invalid_timestamp":
            return msgspec.json.encode({**ticket, "created_at": "yesterday at noon"})
        if kind == "invalid_utf8":
            return msgspec.json.encode({**ticket, "body": "@@"}).replace(b"@@", b"\xff\xfe")
        if kind == "null_value":
            return None
        raise ValueError(f"unknown malformed kind {kind!r}")


@dataclass
class ProduceStats:
    sent: int = 0
    malformed: int = 0
    failed: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


def produce_samples(
    settings: Settings,
    topic: str,
    count: int,
    rate: float,
    factory: SampleFactory,
    stop: threading.Event | None = None,
    on_sent: Callable[[Sample, int], None] | None = None,
    flush_timeout_s: float = 120.0,
) -> ProduceStats:
    """Publish `count` samples (0 = until `stop` is set) at `rate` per second (0 = as fast as possible).

    Returns once every record is acknowledged or failed, or `flush_timeout_s` passed (records still
    unacknowledged then count as failed); `on_sent(sample, n)` is called after each record is queued.
    """
    producer = create_producer(settings.kafka)
    stats = ProduceStats()

    def delivered(error: object, _message: object) -> None:
        if error is not None:
            stats.failed += 1

    started = time.monotonic()
    index = 0
    while (count == 0 or index < count) and not (stop is not None and stop.is_set()):
        if rate > 0:
            pause = started + index / rate - time.monotonic()
            if pause > 0:
                if stop is not None:
                    if stop.wait(pause):
                        break
                else:
                    time.sleep(pause)
        sample = factory.make(index)
        _produce(producer, topic, sample, delivered)
        index += 1
        stats.sent += 1
        if sample.malformed:
            stats.malformed += 1
            stats.by_kind[sample.malformed] = stats.by_kind.get(sample.malformed, 0) + 1
        if on_sent is not None:
            on_sent(sample, stats.sent)
    stats.failed += producer.flush(flush_timeout_s)
    return stats


def _produce(
    producer: confluent_kafka.Producer,
    topic: str,
    sample: Sample,
    delivered: DeliveryCallback,
) -> None:
    produce(producer, topic, sample.value, sample.key, sample.headers, delivered, wait_s=0.05)
    producer.poll(0)
