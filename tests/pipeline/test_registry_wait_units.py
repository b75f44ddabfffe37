"""The backoff of records held back for the Schema Registry (worker/pipeline/registry_wait.py), on a fake
clock: when a held partition is fetched again, and what readiness, the metrics and the log are told
meanwhile."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from worker.decoding import RegistryUnavailable
from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.metrics import RegistryState
from worker.pipeline.registry_wait import MAX_RETRY_S, RegistryWait

KEY = ("tickets.raw", 0)
OTHER = ("tickets.raw", 1)
REFUSED = RegistryUnavailable("outage", "schema registry unreachable: ConnectError: connection refused")
UNAUTHORIZED = RegistryUnavailable(
    "credentials", "schema registry refuses our credentials (401): check schema_registry.basic_auth_user_info"
)


class _Consumer:
    def __init__(self) -> None:
        self.seeks: list[tuple[str, int, int]] = []

    def seek(self, tp: Any) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _wait() -> tuple[RegistryWait, _Consumer, _Clock, list[TopicPartitionKey]]:
    consumer, clock = _Consumer(), _Clock()
    paused: list[TopicPartitionKey] = []
    wait = RegistryWait(consumer, paused.extend, RegistryState(), clock)  # type: ignore[arg-type]
    return wait, consumer, clock, paused


def _retry_after(wait: RegistryWait, clock: _Clock) -> float:
    """Seconds until the held partition is released (fetched again)."""
    return wait.held[KEY] - clock.now


def test_a_held_record_is_sought_back_to_and_retried_after_1_s_doubling_to_30_s() -> None:
    wait, consumer, clock, paused = _wait()
    delays = []
    for _ in range(7):
        assert wait.hold(KEY, 42, REFUSED)
        delays.append(_retry_after(wait, clock))
        clock.now += delays[-1] - 0.001
        wait.due()
        assert KEY in wait.held  # not a moment early
        clock.now += 0.001
        wait.due()
        assert KEY not in wait.held
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_RETRY_S, MAX_RETRY_S]
    assert consumer.seeks == [("tickets.raw", 0, 42)] * 7 and paused == [KEY] * 7
    assert wait.state.retries == 7


def test_readiness_hears_of_the_outage_until_a_record_decodes_again_and_backoff_starts_over() -> None:
    wait, _, clock, _ = _wait()
    wait.hold(KEY, 1, REFUSED)
    wait.hold(OTHER, 7, REFUSED)
    assert (wait.state.outage, wait.state.cause) == (REFUSED.message, "outage")
    assert wait.state.waiting == (KEY, OTHER)
    clock.now += 1.0
    wait.due()
    wait.answered(KEY)
    assert not wait.state.waiting and wait.state.outage is None and wait.state.cause is None
    assert wait.hold(KEY, 2, REFUSED) and _retry_after(wait, clock) == 1.0


def test_a_refusal_of_our_credentials_is_held_counted_and_logged_under_its_cause_at_once() -> None:
    """The registry comes back from an outage refusing our credentials (rotated meanwhile): the warning for
    the new cause is not held back by the outage's throttle, and each hold is counted under its cause."""
    wait, _, clock, _ = _wait()
    with capture_logs() as logged:
        wait.hold(KEY, 1, REFUSED)
        clock.now += 1.0
        wait.hold(KEY, 1, UNAUTHORIZED)
        clock.now += 2.0
        wait.hold(KEY, 1, UNAUTHORIZED)  # within the interval: counted, not logged
    warnings = [line for line in logged if line["event"] == "schema_registry_unavailable"]
    assert [(line["cause"], line["reason"]) for line in warnings] == [
        ("outage", REFUSED.message),
        ("credentials", UNAUTHORIZED.message),
    ]
    assert (wait.state.cause, wait.state.outage) == ("credentials", UNAUTHORIZED.message)
    assert wait.state.retries_by_cause == {"outage": 1, "credentials": 2, "registry_error": 0}
    assert wait.state.snapshot()["cause"] == "credentials" and wait.state.retries == 3


def test_the_group_loop_passing_the_decoders_text_keeps_its_cause() -> None:
    wait, _, _, _ = _wait()
    assert wait.hold(KEY, 3, str(UNAUTHORIZED))
    assert (wait.state.cause, wait.state.outage) == ("credentials", UNAUTHORIZED.message)


def test_a_revoked_partition_is_no_longer_held() -> None:
    wait, _, _, _ = _wait()
    wait.hold(KEY, 5, UNAUTHORIZED)
    wait.forget([KEY])
    assert wait.held == {} and wait.state.waiting == ()
    assert wait.state.outage is None and wait.state.cause is None
