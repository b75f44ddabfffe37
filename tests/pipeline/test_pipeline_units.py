"""Pure parts of the pipeline: the in-flight gate, deadlines, result records and client options."""

from __future__ import annotations

import datetime
import subprocess
import sys

import msgspec
import pytest

from worker.classification import Classification, FallbackLabel, fallback_answer
from worker.errors import UserError
from worker.kafka.clients import consumer_config, producer_config
from worker.messages import DEADLINE_METADATA_KEY, SourcePosition, TicketEvent, TriageResult
from worker.pipeline.flow import Flow, InFlightGate
from worker.pipeline.triage.deadlines import ticket_deadline
from worker.pipeline.triage.records import encode_result, result_key, triage_result
from worker.privacy.values import CarriedMetadata
from worker.settings import PrivacySettings, load_settings

# -- in-flight gate -------------------------------------------------------------------------------------


def test_gate_pauses_at_the_bound_and_resumes_at_the_low_water_mark() -> None:
    gate = InFlightGate(max_in_flight=8, resume_below=4)
    assert gate.capacity() == 8
    assert gate.update(5) is Flow.KEEP
    assert gate.capacity() == 3
    assert gate.update(8) is Flow.PAUSE
    assert gate.capacity() == 0
    # Between the two levels it stays paused: no flapping at the bound.
    assert gate.update(7) is Flow.KEEP
    assert gate.update(5) is Flow.KEEP
    assert gate.capacity() == 0
    assert gate.update(4) is Flow.RESUME
    assert gate.capacity() == 4
    assert gate.max_seen == 8


def test_gate_capacity_never_lets_the_count_pass_the_bound() -> None:
    gate = InFlightGate(max_in_flight=5, resume_below=2)
    count = 0
    for step in range(100):
        taken = gate.capacity()
        count += taken
        gate.update(count)
        count -= step % 3  # some work finishes
        count = max(count, 0)
        gate.update(count)
    assert gate.max_seen <= 5


def test_gate_pauses_only_when_the_bound_holds_for_pause_after_s() -> None:
    gate = InFlightGate(max_in_flight=8, resume_below=4, pause_after_s=0.5)
    assert gate.update(8, now=10.0) is Flow.KEEP  # full: no records taken, but not paused yet ...
    assert gate.capacity() == 0
    assert not gate.may_poll()  # ... so the loop must not poll (a poll could hand over records)
    assert gate.update(7, now=10.2) is Flow.KEEP  # a slot came back: the clock starts again
    assert gate.may_poll() and gate.capacity() == 1
    assert gate.update(8, now=10.3) is Flow.KEEP
    assert gate.update(8, now=10.7) is Flow.KEEP
    assert gate.update(8, now=10.8) is Flow.PAUSE  # full for 0.5 s: a slow model, pause and keep polling
    assert gate.may_poll() and gate.capacity() == 0
    assert gate.update(4, now=11.0) is Flow.RESUME


def test_gate_rejects_nonsense_levels() -> None:
    with pytest.raises(ValueError):
        InFlightGate(max_in_flight=4, resume_below=4)
    with pytest.raises(ValueError):
        InFlightGate(max_in_flight=0, resume_below=0)


# -- deadlines ------------------------------------------------------------------------------------------


def _iso(seconds_from_now: float, now_wall: float) -> str:
    moment = datetime.datetime.fromtimestamp(now_wall + seconds_from_now, datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


def test_deadline_is_the_loops_without_a_requested_one() -> None:
    assert ticket_deadline(100.0, 5000.0, 102.0, None) == pytest.approx(102.0)


def test_an_earlier_requested_deadline_wins_a_later_one_is_ignored() -> None:
    wall = 1_700_000_000.0
    sooner = {DEADLINE_METADATA_KEY: _iso(0.5, wall)}
    later = {DEADLINE_METADATA_KEY: _iso(60.0, wall)}
    assert ticket_deadline(100.0, wall, 102.0, sooner) == pytest.approx(100.5)
    assert ticket_deadline(100.0, wall, 102.0, later) == pytest.approx(102.0)


@pytest.mark.parametrize("text", ["soon", "2024-05-01T12:30:00", ""])
def test_unusable_requested_deadlines_are_ignored(text: str) -> None:
    assert ticket_deadline(100.0, 0.0, 102.0, {DEADLINE_METADATA_KEY: text}) == pytest.approx(102.0)


# -- records --------------------------------------------------------------------------------------------


EVENT = TicketEvent(ticket_id="T-1", body="Where is my card?")
SOURCE = SourcePosition(topic="tickets.raw", partition=2, offset=41)


def test_result_record_round_trips_as_a_valid_triage_result() -> None:
    answer = Classification(
        intent="card_arrival",
        priority="Low",
        confidence=0.75,
        scores={"card_arrival": 0.75},
        model="tiny@1",
        latency_ms=12.5,
        truncated=True,
    )
    result = triage_result(EVENT, answer, SOURCE)
    decoded = msgspec.json.decode(encode_result(result), type=TriageResult)
    assert decoded.ticket_id == "T-1"
    assert decoded.intent == "card_arrival"
    assert decoded.source == SOURCE
    assert decoded.truncated is True
    assert decoded.classified_at.endswith("Z")


def test_overloaded_fallback_does_not_claim_confidence() -> None:
    answer = fallback_answer("overloaded", FallbackLabel("unclassified", "Medium"), "tiny@1", 2500.0)
    result = triage_result(EVENT, answer, SOURCE)
    decoded = msgspec.json.decode(encode_result(result), type=TriageResult)
    assert decoded.fallback is True
    assert decoded.fallback_reason == "overloaded"
    assert decoded.confidence == 0.0
    assert decoded.scores == {}


def test_result_key_is_the_input_key_else_the_ticket_id() -> None:
    carried = CarriedMetadata(PrivacySettings().copy_redactor(), ["*"])
    assert result_key(b"customer-9", EVENT, carried) == b"customer-9"
    assert result_key(None, EVENT, carried) == b"T-1"
    # A key that holds personal data would put it in clear on every copy (issue #43, item 7).
    assert result_key(b"jane.doe@example.com", EVENT, carried) == b"T-1"


# -- client options -------------------------------------------------------------------------------------


def test_consumer_never_auto_commits_and_defaults_to_cooperative_sticky() -> None:
    settings = load_settings(env={"KAFKA_SESSION_TIMEOUT_MS": "6000", "KAFKA_LINGER_MS": "50"})
    config = consumer_config(settings.kafka, settings.pipeline)
    assert config["enable.auto.commit"] == "false"
    assert config["enable.auto.offset.store"] == "false"
    assert config["partition.assignment.strategy"] == "cooperative-sticky"
    assert config["group.id"] == "triage-worker"
    assert config["session.timeout.ms"] == "6000"
    assert "linger.ms" not in config  # a producer option stays with the producer


def test_producer_is_idempotent_with_acks_all() -> None:
    settings = load_settings(env={"KAFKA_SESSION_TIMEOUT_MS": "6000", "KAFKA_LINGER_MS": "50"})
    config = producer_config(settings.kafka)
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"
    assert config["linger.ms"] == "50"
    assert "session.timeout.ms" not in config


@pytest.mark.parametrize(
    ("variable", "value"),
    [("KAFKA_ENABLE_AUTO_COMMIT", "true"), ("KAFKA_ACKS", "1"), ("KAFKA_ENABLE_IDEMPOTENCE", "false")],
)
def test_options_the_pipeline_relies_on_cannot_be_weakened(variable: str, value: str) -> None:
    settings = load_settings(env={variable: value})
    with pytest.raises(UserError, match="must be"):
        consumer_config(settings.kafka, settings.pipeline)
        producer_config(settings.kafka)


# -- rooms ----------------------------------------------------------------------------------------------


def test_the_pipeline_imports_without_onnxruntime_genai() -> None:
    """The pipeline talks to the inference room through `worker.classification` only."""
    code = (
        "import sys; sys.modules['onnxruntime_genai'] = None\n"  # any import of it now fails
        "import worker.pipeline.engine, worker.pipeline.settlements.committer, worker.kafka.clients\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr
