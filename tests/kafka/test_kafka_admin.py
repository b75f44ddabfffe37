"""The start-up connection check of every command, against addresses where no broker answers."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from worker.errors import UserError
from worker.kafka.admin import check_cluster, existing_topics, record_size_limits


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A port that accepts TCP connections (the kernel's backlog) but never says a word: a hung broker."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("check", [check_cluster, existing_topics])
def test_a_broker_that_does_not_answer_is_announced_within_a_second_then_one_error_line(
    silent_address: str, check: Callable[..., object]
) -> None:
    notices: list[tuple[float, str]] = []
    started = time.monotonic()
    with pytest.raises(UserError) as caught:
        check(
            {"bootstrap.servers": silent_address}, 3.0, lambda line: notices.append((time.monotonic(), line))
        )
    ended = time.monotonic()
    assert [line for _, line in notices] == [
        f"waiting for Kafka at {silent_address} (gives up after 3 s) ..."
    ]
    assert notices[0][0] - started < 1.0
    assert 2.5 < ended - started < 6.0
    message = str(caught.value)
    assert message.startswith(f"cannot reach Kafka at {silent_address}: ") and "\n" not in message


def test_a_refused_connection_is_announced_too(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, not listening: connections are refused
        with pytest.raises(UserError, match="Connection refused"):
            check_cluster({"bootstrap.servers": address}, 2.0)
    assert capsys.readouterr().err == f"waiting for Kafka at {address} (gives up after 2 s) ...\n"


def test_record_size_limits_left_out_when_the_broker_gives_no_answer(silent_address: str) -> None:
    """A worker starting while a cluster node is down (chaos --brokers 3) asks a broker that does not answer:
    the limits it cannot learn are left out, as for a refused DescribeConfigs, not a TimeoutError traceback
    that ends the start (seen in the first cluster chaos run)."""
    assert record_size_limits({"bootstrap.servers": silent_address}, ["triage.out"], timeout_s=1.0) == {}
