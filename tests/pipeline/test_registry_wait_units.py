"""The backoff of records held back for the Schema Registry (worker/pipeline/registry_wait.py), on a fake
clock: when a held partition's registry probe is due, and what readiness, the metrics and the log are told
meanwhile."""

from __future__ import annotations

from structlog.testing import capture_logs

from worker.decoding import RegistryUnavailable
from worker.pipeline.metrics import RegistryState
from worker.pipeline.registry_wait import MAX_RETRY_S, RegistryWait
from worker.pipeline.seams import Record

HELD = Record("tickets.raw", 0, 42, None, b"\x00\x00\x00\x00\x07{}", None)
OTHER = Record("tickets.raw", 1, 7, None, b"\x00\x00\x00\x00\x07{}", None)
REFUSED = RegistryUnavailable("outage", "schema registry unreachable: ConnectError: connection refused")
UNAUTHORIZED = RegistryUnavailable(
    "credentials", "schema registry refuses our credentials (401): check schema_registry.basic_auth_user_info"
)


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _wait() -> tuple[RegistryWait, _Clock]:
    clock = _Clock()
    return RegistryWait(RegistryState(), clock), clock


def _probe_in(wait: RegistryWait, clock: _Clock) -> float:
    """Seconds until the held partition's registry probe is due."""
    at = clock.now
    while not wait.due(at):
        at += 0.001
    return round(at - clock.now, 2)


def test_a_held_record_is_probed_after_1_s_then_doubling_up_to_30_s() -> None:
    wait, clock = _wait()
    delays = []
    for _ in range(7):
        wait.hold(HELD, REFUSED)
        delays.append(_probe_in(wait, clock))
        clock.now += delays[-1] - 0.01
        assert wait.due(clock.now) == []  # not a moment early
        clock.now += 0.01
        assert wait.due(clock.now) == [HELD]  # the very record it is held at
        assert HELD.partition_key in wait.held  # held until a probe decodes
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_RETRY_S, MAX_RETRY_S]
    assert wait.state.retries == 7


def test_readiness_hears_of_the_outage_until_a_probe_decodes_and_backoff_starts_over() -> None:
    wait, clock = _wait()
    wait.hold(HELD, REFUSED)
    wait.hold(OTHER, REFUSED)
    assert (wait.state.outage, wait.state.cause) == (REFUSED.message, "outage")
    assert wait.state.waiting == (HELD.partition_key, OTHER.partition_key)
    clock.now += 1.0
    wait.answered(HELD.partition_key)
    assert wait.state.cause == "outage"  # the other partition still waits
    wait.answered(OTHER.partition_key)
    assert not wait.state.waiting and wait.state.outage is None and wait.state.cause is None
    wait.hold(HELD, REFUSED)
    assert _probe_in(wait, clock) == 1.0


def test_a_refusal_of_our_credentials_is_held_counted_and_logged_under_its_cause_at_once() -> None:
    """The registry comes back from an outage refusing our credentials (rotated meanwhile): the warning for
    the new cause is not held back by the outage's throttle, and each hold is counted under its cause."""
    wait, clock = _wait()
    with capture_logs() as logged:
        wait.hold(HELD, REFUSED)
        clock.now += 1.0
        wait.hold(HELD, UNAUTHORIZED)
        clock.now += 2.0
        wait.hold(HELD, UNAUTHORIZED)  # within the interval: counted, not logged
    warnings = [line for line in logged if line["event"] == "schema_registry_unavailable"]
    assert [(line["cause"], line["reason"]) for line in warnings] == [
        ("outage", REFUSED.message),
        ("credentials", UNAUTHORIZED.message),
    ]
    assert (wait.state.cause, wait.state.outage) == ("credentials", UNAUTHORIZED.message)
    assert wait.state.retries_by_cause == {"outage": 1, "credentials": 2, "registry_error": 0}
    assert wait.state.snapshot()["cause"] == "credentials" and wait.state.retries == 3


def test_a_revoked_partition_is_no_longer_held() -> None:
    wait, _ = _wait()
    wait.hold(HELD, UNAUTHORIZED)
    wait.forget([HELD.partition_key])
    assert wait.held == set() and wait.state.waiting == ()
    assert wait.state.outage is None and wait.state.cause is None
