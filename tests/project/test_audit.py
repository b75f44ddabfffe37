"""The audit judges a promise on what a downstream read_committed reader sees (issue #30).

A killed exactly-once worker leaves its transaction open; until the broker aborts it, the last stable offset
of every output partition it wrote to stays behind it, and a read_committed reader sees none of the later
records there, however committed they are. The audit of the full chaos run with seed 29 read the outputs 13 s
after the last kill -9, up to the last stable offsets of that moment, and reported the ~850 tickets the two
replacement workers had committed behind the open transaction as lost.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tools.harness import Worker, audit, make_topics, publish, visibility

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# A killed producer's transaction on partition 0 of a topic, as a crashed worker leaves one; 30 s before the
# broker aborts it, so that the worker's records after it are certainly still hidden when the audit starts.
_LEFT_OPEN = """
import sys, time, confluent_kafka
producer = confluent_kafka.Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[2],
                                     "transaction.timeout.ms": "30000"})
producer.init_transactions(30)
producer.begin_transaction()
producer.produce(sys.argv[3], b"never committed", partition=0)
producer.flush(30)
print("open", flush=True)
time.sleep(3600)
"""


def _leave_a_transaction_open(bootstrap: str, topic: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _LEFT_OPEN, bootstrap, f"crashed-{uuid.uuid4().hex[:8]}", topic],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
    finally:
        child.kill()  # kill -9: the transaction stays open until the broker times it out
        child.wait()


def test_the_audit_waits_until_a_crashed_producers_open_transaction_ends(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    group = f"triage-test-{uuid.uuid4().hex[:8]}"
    settings = {"pipeline.guarantee": "exactly_once", "pipeline.transactional_id": f"{group}-worker"}
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, "worker", settings)
    try:
        worker.wait_for("partitions_assigned", timeout=90)
        _leave_a_transaction_open(kafka_bootstrap, topics.output)
        left_open_at = time.monotonic()
        publish(kafka_bootstrap, topics, 40, malformed_ratio=0.0)
        worker.run_to_completion(timeout=60)
    finally:
        worker.kill()
    assert time.monotonic() - left_open_at < 25, "too slow to see the transaction open"

    # What the audit did before: read up to the last stable offsets of the moment. The worker's committed
    # records sit behind the open transaction, invisible.
    early = audit(kafka_bootstrap, topics, visible_within_s=0.0)
    assert early.hidden > 0
    assert len(early.lost) == 40
    assert "still hidden from read_committed" in early.visibility[1].describe()

    # Now: it waits until the broker has aborted the open transaction, then every ticket has its record.
    report = audit(kafka_bootstrap, topics)
    assert report.hidden == 0 and report.lost == [] and report.duplicates == 0
    assert len(report.inputs) == 40
    waited = {seen.topic: seen.waited_s for seen in report.visibility}
    assert waited[topics.output] > 1.0


def test_visibility_says_what_stayed_hidden_when_the_wait_runs_out(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("out", partitions=2)
    _leave_a_transaction_open(kafka_bootstrap, topic)
    seen = visibility(kafka_bootstrap, topic, within_s=1.0)
    assert seen.hidden == 1 and seen.stable == {0: 0, 1: 0} and seen.ends == {0: 1, 1: 0}
    assert 1.0 <= seen.waited_s < 10
    assert "1 offsets still hidden" in seen.describe() and "{0: 1}" in seen.describe()
