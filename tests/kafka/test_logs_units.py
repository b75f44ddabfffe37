"""librdkafka's lines and errors, rate-limited per cause and interval (what a broker outage looks like in the
log end to end is tests/kafka/test_outage_logs.py)."""

from __future__ import annotations

import logging

import confluent_kafka
from structlog.testing import capture_logs

from worker.kafka.clients import ClientErrorLog
from worker.logs import LibrdkafkaHandler, Throttle, librdkafka_cause, librdkafka_logger

# As confluent-kafka's `logger` gets them during an outage, from a consumer and a producer.
REFUSED = (
    "FAIL [rdkafka#consumer-3] [thrd:127.0.0.1:9092/bootstrap]: 127.0.0.1:9092/bootstrap: Connect to "
    "ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT)"
)
REFUSED_AGAIN = (
    "FAIL [rdkafka#producer-4] [thrd:GroupCoordinator]: GroupCoordinator: 127.0.0.1:9092: Connect to "
    "ipv4#127.0.0.1:9092 failed: Connection refused (after 2ms in state CONNECT, 3 identical error(s) "
    "suppressed)"
)
DISCONNECTED = (
    "FAIL [rdkafka#consumer-3] [thrd:127.0.0.1:9092/1]: 127.0.0.1:9092/1: Disconnected: connection closed by "
    "peer: receive 0 after POLLIN (after 4919ms in state UP)"
)


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cause_is_admitted_once_per_interval_with_the_count_it_held_back() -> None:
    clock = _Clock()
    throttle = Throttle(10.0, clock)
    assert throttle.admit("refused") == 0
    assert [throttle.admit("refused") for _ in range(5)] == [None] * 5
    assert throttle.admit("other") == 0  # another cause has its own interval
    clock.now += 9.9
    assert throttle.admit("refused") is None
    assert throttle.admit("refused", force=True) == 6  # a fatal error shows at once
    clock.now += 10.0
    assert throttle.admit("refused") == 0


def test_the_causes_remembered_stay_bounded() -> None:
    clock = _Clock()
    throttle = Throttle(10.0, clock)
    for index in range(300):
        throttle.admit(f"cause {index}")
    clock.now += 11.0
    for index in range(300):
        throttle.admit(f"later {index}")
    assert len(throttle._causes) <= 300


def test_reports_of_one_cause_from_other_clients_threads_and_timings_are_one_cause() -> None:
    assert librdkafka_cause(REFUSED) == librdkafka_cause(REFUSED_AGAIN)
    facility, cause = librdkafka_cause(REFUSED)
    assert facility == "FAIL" and cause.startswith("Connect to ") and "Connection refused" in cause
    assert librdkafka_cause(DISCONNECTED) != librdkafka_cause(REFUSED)
    secure = "FAIL [rdkafka#producer-1] [thrd:sasl_ssl://kafka-0:9093/0]: sasl_ssl://kafka-0:9093/0: SASL"
    assert librdkafka_cause(secure + " authentication error (after 3ms in state AUTH_REQ)") == (
        "FAIL",
        "SASL authentication error",
    )
    assert librdkafka_cause("not librdkafka's 42") == ("", "not librdkafka's #")


def _record(level: int, message: str) -> logging.LogRecord:
    """As confluent-kafka logs it: `logger.log(level, "%s [%s] %s", facility, client, text)`."""
    facility, rest = message.split(" ", 1)
    client, text = rest[1:].split("] ", 1)
    return logging.LogRecord("librdkafka", level, __file__, 0, "%s [%s] %s", (facility, client, text), None)


def test_an_outage_is_one_line_per_cause_and_level_saying_how_many_it_stands_for() -> None:
    clock = _Clock()
    handler = LibrdkafkaHandler(Throttle(10.0, clock))
    with capture_logs() as logs:
        for _ in range(50):  # every ~50 ms for 2.5 s, from two clients
            handler.handle(_record(logging.ERROR, REFUSED))
            handler.handle(_record(logging.ERROR, REFUSED_AGAIN))
            clock.now += 0.05
        handler.handle(_record(logging.INFO, DISCONNECTED))
        # The same cause at another level has its own line: an info line the log level drops must not
        # hold back an error.
        handler.handle(_record(logging.WARNING, DISCONNECTED))
        clock.now += 10.0
        handler.handle(_record(logging.ERROR, REFUSED_AGAIN))
    lines = [log for log in logs if log["event"] == "librdkafka"]
    assert [(line["log_level"], line["message"], line["suppressed_since_last"]) for line in lines] == [
        ("error", REFUSED, 0),
        ("info", DISCONNECTED, 0),
        ("warning", DISCONNECTED, 0),
        ("error", REFUSED_AGAIN, 99),
    ]
    assert all(line["facility"] == "FAIL" for line in lines)


def test_every_client_of_a_process_shares_one_logger() -> None:
    """So the consumer's, the producers' and the probe's reports of one outage are one cause."""
    assert librdkafka_logger() is librdkafka_logger()
    assert len([h for h in librdkafka_logger().handlers if isinstance(h, LibrdkafkaHandler)]) == 1


class _Error:
    """A KafkaError as error_cb gets it."""

    def __init__(self, code: int, fatal: bool = False) -> None:
        self._code, self._fatal = code, fatal

    def code(self) -> int:
        return self._code

    def name(self) -> str:
        return "_TRANSPORT"

    def str(self) -> str:
        return "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused"

    def fatal(self) -> bool:
        return self._fatal


def test_client_errors_are_one_line_per_code_and_interval_and_fatal_ones_always_show() -> None:
    on_error = ClientErrorLog("lag-exporter")
    with capture_logs() as logs:
        for _ in range(100):
            on_error(_Error(confluent_kafka.KafkaError._TRANSPORT))  # type: ignore[arg-type]
        on_error(_Error(confluent_kafka.KafkaError._TRANSPORT, fatal=True))  # type: ignore[arg-type]
    assert [(log["client"], log["fatal"], log["suppressed_since_last"]) for log in logs] == [
        ("lag-exporter", False, 0),
        ("lag-exporter", True, 99),
    ]
