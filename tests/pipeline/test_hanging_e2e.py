"""Against the real broker: a transaction left open under later records is named by the worker's watch
(partition and metric), listed by `triage-worker broker transactions describe-producers`, ended by its
`abort`, and then cleared by the watch."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Producer

from worker.cli.cli import main
from worker.kafka.admin import TopicSpec, create_topics
from worker.pipeline.hanging import TransactionWatch, suspect_after_s
from worker.pipeline.metrics import PipelineMetrics


class Clock:
    """The watch's clock, moved by the test: no 30 s waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.kafka
@pytest.mark.slow
def test_an_open_transaction_is_named_listed_aborted_and_cleared(
    kafka_bootstrap: str, capfd: pytest.CaptureFixture[str]
) -> None:
    topic = f"test.hanging.{uuid.uuid4().hex[:8]}"
    config = {"bootstrap.servers": kafka_bootstrap}
    create_topics(config, [TopicSpec(topic, 1, 1)])
    # A producer that begins a transaction, writes and never ends it (its timeout far away), then records
    # written after it: a read_committed reader stops at the open transaction's first offset.
    stuck = Producer(
        {**config, "transactional.id": f"stuck-{uuid.uuid4().hex}", "transaction.timeout.ms": 600000}
    )
    stuck.init_transactions(30)
    stuck.begin_transaction()
    stuck.produce(topic, value=b"never committed")
    assert stuck.flush(30) == 0
    later = Producer(config)
    for _ in range(5):
        later.produce(topic, value=b"written after it")
    assert later.flush(30) == 0

    metrics, clock = PipelineMetrics(), Clock()
    watch = TransactionWatch(config, "unused.input", [topic], metrics, 1000, clock)
    try:
        watch.round()
        assert not metrics.hanging
        clock.now = suspect_after_s(1000)
        watch.round()
        assert metrics.hanging == ((topic, 0),)

        capfd.readouterr()
        listed = main(["broker", "transactions", "--bootstrap-servers", kafka_bootstrap, "describe-producers",
                       "--topic", topic, "--partition", "0"])  # fmt: skip
        out = capfd.readouterr().out
        assert listed == 0
        header, *rows = [line.split() for line in out.splitlines() if line.strip() and "Fetching" not in line]
        start = header.index("CurrentTransactionStartOffset")
        assert [row[start] for row in rows] == ["0"], out

        aborted = main(["broker", "transactions", "--bootstrap-servers", kafka_bootstrap, "abort",
                        "--topic", topic, "--partition", "0", "--start-offset", "0"])  # fmt: skip
        assert aborted == 0
        for _ in range(20):  # the abort marker is written at once; the watch's next rounds see it
            clock.now += 5.0
            watch.round()
            if not metrics.hanging:
                break
        assert not metrics.hanging
    finally:
        watch.close()
