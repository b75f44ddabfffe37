"""A hot reload's privacy and redaction settings reach the running loop: the real loop (`group_pipeline`)
over the in-memory Kafka, the test model behind the reload's switch, and the reloader as the worker wires it
(`TriageParts.reloaded`). Every record taken and every copy written after the reload is redacted as the new
settings say; before, they were compared by nobody and applied to nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import pytest
from doubles import Running
from memory_kafka import MemoryKafka, as_client_factory

from tools.harness import TINY_MODEL
from worker.app.doors import TriageParts, group_pipeline
from worker.app.reload import Reloader
from worker.classification import Classification, ClassifyRequest
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import open_pool
from worker.inference.switch import SwitchingClassifier
from worker.kafka import dead_letters
from worker.messages import TriageResult
from worker.settings import Settings, load_settings

INPUT, OUTPUT, DEAD = "tickets", "triaged", "dead"
EMAIL = "ann.lee@example.com"


class _Recording:
    """The switch, keeping the text of each ticket the model was given."""

    def __init__(self, switch: SwitchingClassifier) -> None:
        self.switch = switch
        self.texts: list[str] = []

    @property
    def model_id(self) -> str:
        return self.switch.model_id

    def submit(self, request: ClassifyRequest) -> None:
        self.texts.append(request.text)
        self.switch.submit(request)

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        return self.switch.poll(timeout)


def _settings(**overrides: object) -> Settings:
    return load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "topics.input": INPUT,
            "topics.output": OUTPUT,
            "topics.dead_letter": DEAD,
            "pipeline.group_id": "reload-group",
            "inference.model": str(TINY_MODEL),
            "inference.pool": "thread",
            "inference.pool_size": 1,
            **overrides,
        },
    )


@pytest.fixture
def kafka() -> Iterator[MemoryKafka]:
    memory = MemoryKafka(prefetch=2)
    for topic in (INPUT, OUTPUT, DEAD):
        memory.create_topic(topic, 1)
    yield memory


def _send(kafka: MemoryKafka, ticket: str) -> None:
    """A ticket whose body, key and header hold an e-mail address, then a record that is no ticket with
    the address in its value."""
    value = msgspec.json.encode({"ticket_id": ticket, "body": f"Where is my card? Write to {EMAIL}"})
    kafka.append(INPUT, 0, value, EMAIL.encode(), [("x-customer", EMAIL.encode()), ("x-request-id", b"r1")])
    kafka.append(INPUT, 0, f"not a ticket, from {EMAIL}".encode(), None, [])


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_reload_narrows_the_redaction_of_the_model_input_results_and_dead_letters(
    kafka: MemoryKafka,
) -> None:
    """Started with e-mail addresses neither detected nor redacted anywhere; reloaded with the defaults
    (every kind detected, the model's input redacted), dead letters redacted and only `x-request-id`
    carried: the first ticket's copies hold the address, the second's none."""
    running = _settings(**{"privacy.detect": "iban", "inference.redact_input": False})
    configured = _settings(**{"dead_letter.redact": True, "privacy.carry_headers": "x-request-id"})
    pool = open_pool(running.inference, *resolve_taxonomy(running.inference))
    switch = SwitchingClassifier(pool, closer=lambda pool: pool.close())
    model = _Recording(switch)
    fallback = resolve_taxonomy(running.inference)[0].fallback_label
    parts = TriageParts(model, fallback, 2)
    clients = as_client_factory(kafka.clients("reload-group"))
    worker = group_pipeline(running, parts, clients=clients)
    reloader = Reloader(running, lambda: configured, fallback)
    reloader.start(switch, None, parts.reloaded)
    loop = Running(worker)
    try:
        _send(kafka, "T-before")
        _wait(lambda: worker.metrics.produced == 2, "the first ticket and dead letter")
        assert reloader.reload(switch)
        _send(kafka, "T-after")
        _wait(lambda: worker.metrics.produced == 4, "the second ticket and dead letter")
        assert loop.stop() == 0
    finally:
        reloader.close()
        switch.close()

    assert EMAIL in model.texts[0] and EMAIL not in model.texts[1]
    results = [record for _, record in kafka.read_committed(OUTPUT)]
    decoded = [msgspec.json.decode(record.value or b"", type=TriageResult) for record in results]
    assert [result.ticket_id for result in decoded] == ["T-before", "T-after"]
    assert decoded[0].pii == [] and decoded[1].pii == ["email"]
    before, after = results
    assert before.key == EMAIL.encode() and after.key == b"T-after"  # a personal key is replaced
    assert ("x-customer", EMAIL.encode()) in (before.headers or [])
    assert [name for name, _ in after.headers or [] if not name.startswith("triage.")] == ["x-request-id"]
    letters = [record for _, record in kafka.read_committed(DEAD)]
    assert len(letters) == 2
    assert EMAIL.encode() in (letters[0].value or b"") and EMAIL.encode() not in (letters[1].value or b"")
    assert [dict(letter.headers or []).get(dead_letters.REDACTED) for letter in letters] == [None, b"text"]
