"""`triage-worker replay` on the real broker: selection, repair, loop bound, resume after SIGKILL, rate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # re-exported untyped by confluent_kafka.admin

from tools import REPO
from worker.cli.cli import main
from worker.kafka.clients import record_headers
from worker.kafka.dead_letters import REPLAY_COUNT, dead_letter_headers
from worker.pipeline.settlements.delivery import smaller
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.work import Output, Work

pytestmark = pytest.mark.kafka


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp_ms: int


@dataclass(frozen=True)
class DeadLetter:
    value: bytes
    error_type: str = "invalid_json"
    source_partition: int = 0
    replay_count: int = 0
    source_topic: str | None = None  # None: the test's source topic
    timestamp_ms: int = 0  # when it was dead-lettered; 0: now
    # Too large for the dead-letter topic: written as the pipeline then writes it, `triage.*` headers only.
    shrunk: bool = False


def _seed(
    bootstrap: str, dlq: str, source: str, letters: Sequence[DeadLetter]
) -> dict[bytes, tuple[int, int]]:
    """Write dead letters as the worker does (DLQ partition = source partition); value → DLQ position."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    positions: dict[bytes, tuple[int, int]] = {}

    def delivered(error: KafkaError | None, message: Message) -> None:
        assert error is None, error
        positions[message.value() or b""] = (message.partition() or 0, message.offset() or 0)

    for index, letter in enumerate(letters):
        original: list[tuple[str, bytes | None]] = [
            ("trace-id", f"trace-{index}".encode()),
            ("producer", b"shop"),
        ]
        output = Output(
            dlq,
            f"key-{index}".encode(),
            letter.value,
            dead_letter_headers(
                original,
                letter.error_type,
                f"{letter.error_type}: at $.ticket_id",
                letter.source_topic or source,
                letter.source_partition,
                100 + index,
                replay_count=letter.replay_count,
            ),
        )
        if letter.shrunk:
            where = PartitionOffsets((source, letter.source_partition))
            work = Work(where, source, letter.source_partition, 100 + index, output.key, original, 0.0, 0.0)
            output = smaller(work, output, shrunk=1)
        # The client's header type takes str values too (and list is invariant).
        headers: list[tuple[str, str | bytes | None]] | None = (
            None if output.headers is None else [*output.headers]
        )
        producer.produce(
            dlq,
            key=output.key,
            value=output.value,
            partition=letter.source_partition,
            headers=headers,
            timestamp=letter.timestamp_ms,
            on_delivery=delivered,
        )
    assert producer.flush(30) == 0
    return positions


def _read_values(bootstrap: str, topic: str) -> list[bytes]:
    """The value of every record in `topic` (read_committed): the replay writes none without one."""
    records = _read_all(bootstrap, topic)
    values = [record.value for record in records if record.value is not None]
    assert len(values) == len(records), f"a record of {topic} has no value"
    return values


def _read_all(bootstrap: str, topic: str, isolation: str = "read_committed") -> list[Record]:
    """Every record now in `topic` a reader with `isolation` sees (read_committed: what committed
    transactions and plain producers wrote), read with no consumer group."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "test-reader",
            "enable.auto.commit": False,
            "isolation.level": isolation,
            # The end: the last stable offset for read_committed (transaction markers take offsets too).
            "enable.partition.eof": True,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        pending = set(partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
        records: list[Record] = []
        deadline = time.monotonic() + 20
        while pending and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=500, timeout=0.5):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.discard(message.partition() or 0)
                    continue
                partition, offset = message.partition(), message.offset()
                assert partition is not None and offset is not None  # a consumed record has both
                records.append(
                    Record(
                        partition,
                        offset,
                        message.key(),
                        message.value(),
                        record_headers(message) or [],
                        message.timestamp()[1],
                    )
                )
        assert not pending, f"could not read {topic} to its end"
        return records
    finally:
        consumer.close()


def _committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offsets; read_uncommitted, so a transaction a kill left open (whose offsets are
    not committed) does not make the broker hold the answer back until it times out."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in found if tp.offset >= 0}
    finally:
        consumer.close()


def _replay_args(bootstrap: str, dlq: str, *extra: str) -> list[str]:
    return ["replay", "--dlq", dlq, "--set", f"kafka.bootstrap.servers={bootstrap}", *extra]


def _replay_json(capsys: pytest.CaptureFixture[str], args: list[str], expect_code: int = 0) -> Any:
    """Run the CLI in-process with --json among `args`; the parsed summary."""
    code = main(args)
    out, err = capsys.readouterr()
    assert code == expect_code, out + err
    return json.loads(out)


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_filtered_replay_with_transform_repairs_exactly_the_selected_records(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    guarantee: str,
) -> None:
    dlq, source, other = unique_topic("dlq"), unique_topic("source"), unique_topic("other")
    selected = [
        DeadLetter(f'{{"ticket_id": "t{i}", "body": "b"'.encode(), source_partition=i % 3) for i in range(6)
    ]
    letters = [
        *selected,
        *(DeadLetter(b'{"body": "no id"}', "missing_field", source_partition=p) for p in range(3)),
        DeadLetter(b'{"ticket_id": "elsewhere", "body": "b"', source_partition=1, source_topic=other),
        DeadLetter(b'{"ticket_id": "looping", "body": "b"', source_partition=2, replay_count=3),
        DeadLetter(b"DROP", source_partition=0),
        DeadLetter(b"BOOM", source_partition=1),
    ]
    positions = _seed(kafka_bootstrap, dlq, source, letters)
    fixes = tmp_path / "fixes.py"
    fixes.write_text(
        "def close_json(value):\n"
        "    if value == b'DROP':\n        return None\n"
        "    if value == b'BOOM':\n        raise ValueError('cannot repair this one')\n"
        "    return value + b'}'\n"
    )
    args = _replay_args(
        kafka_bootstrap,
        dlq,
        "--from-beginning",
        "--error-type",
        "invalid_json",
        "--source-topic",
        source,
        "--transform",
        f"{fixes}:close_json",
        "--guarantee",
        guarantee,
        "--json",
    )

    summary = _replay_json(capsys, args)

    assert summary["guarantee"] == guarantee

    assert summary["counts"] == {
        "replayed": 6,
        "skipped_filter": 4,
        "skipped_max_replays": 1,
        "shrunk": 0,
        "transform_skipped": 1,
        "transform_failed": 1,
        "refused": 0,
        "publish_failed": 0,
        "unreadable": 0,
    }
    attention = {(item["outcome"], item["offset"], item["partition"]) for item in summary["attention"]}
    assert attention == {
        ("skipped_max_replays", *reversed(positions[b'{"ticket_id": "looping", "body": "b"'])),
        ("transform_failed", *reversed(positions[b"BOOM"])),
    }
    failure = next(item for item in summary["attention"] if item["outcome"] == "transform_failed")
    assert "cannot repair this one" in failure["detail"]

    arrived = _read_all(kafka_bootstrap, source)
    by_value = {record.value: record for record in arrived}
    assert len(arrived) == 6
    assert set(by_value) == {letter.value + b"}" for letter in selected}
    for index, letter in enumerate(selected):
        record = by_value[letter.value + b"}"]
        assert record.key == f"key-{index}".encode()
        # Original headers in order, dead-letter headers gone, replay count carried as 1.
        assert record.headers == [
            ("trace-id", f"trace-{index}".encode()),
            ("producer", b"shop"),
            (REPLAY_COUNT, b"1"),
        ]
    assert _read_all(kafka_bootstrap, other) == []
    assert len(_read_all(kafka_bootstrap, dlq)) == len(letters)  # the dead letters themselves stay

    again = _replay_json(capsys, args)
    assert again["counts"]["replayed"] == 0
    assert len(_read_all(kafka_bootstrap, source)) == 6


def test_dry_run_publishes_and_commits_nothing(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    letters = [DeadLetter(f"v{i}".encode(), "invalid_json" if i % 2 else "bad_utf8", i % 3) for i in range(5)]
    _seed(kafka_bootstrap, dlq, source, letters)

    code = main(_replay_args(kafka_bootstrap, dlq, "--from-beginning", "--dry-run"))

    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Would replay (5)" in out
    assert "invalid_json" in out and "bad_utf8" in out
    assert _read_all(kafka_bootstrap, source) == []
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 3) == {}
    # The real run under the same group still sees everything the dry run listed.
    summary = _replay_json(capsys, _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--json"))
    assert summary["counts"]["replayed"] == 5


def test_a_failed_publish_exits_non_zero_and_is_not_committed(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq", partitions=1), unique_topic("source")
    _seed(kafka_bootstrap, dlq, source, [DeadLetter(b"v0"), DeadLetter(b"v1")])
    args = _replay_args(
        kafka_bootstrap, dlq, "--from-beginning", "--to", "not a valid topic!", "--json"
    )  # the broker rejects the name

    summary = _replay_json(capsys, [*args, "--set", "kafka.message.timeout.ms=5000"], expect_code=1)

    assert summary["counts"]["publish_failed"] >= 1
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 1) == {}


def test_offsets_and_limit_replay_in_resumable_slices(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq", partitions=1), unique_topic("source")
    _seed(kafka_bootstrap, dlq, source, [DeadLetter(f"v{i}".encode()) for i in range(10)])
    args = _replay_args(kafka_bootstrap, dlq, "--offsets", "0:2-5", "--limit", "2", "--json")

    slices = [_replay_json(capsys, args)["counts"]["replayed"] for _ in range(3)]

    assert slices == [2, 2, 0]
    assert sorted(_read_values(kafka_bootstrap, source)) == [b"v2", b"v3", b"v4", b"v5"]
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 1) == {0: 6}


def test_time_window_selects_by_when_records_were_dead_lettered(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq", partitions=1), unique_topic("source")
    now_ms = int(time.time() * 1000)
    hours_ago = (4, 3, 2, 1)
    _seed(
        kafka_bootstrap,
        dlq,
        source,
        [DeadLetter(f"{h}h".encode(), timestamp_ms=now_ms - h * 3_600_000) for h in hours_ago],
    )

    summary = _replay_json(
        capsys, _replay_args(kafka_bootstrap, dlq, "--since", "210m", "--until", "90m", "--json")
    )

    assert summary["counts"]["replayed"] == 2
    assert sorted(_read_values(kafka_bootstrap, source)) == [b"2h", b"3h"]
    # The record after --until is left for a later run, not committed past.
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 1) == {0: 3}


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_sigterm_stops_cleanly_and_a_rerun_sends_no_duplicates(
    kafka_bootstrap: str, unique_topic: Callable[..., str], guarantee: str
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    total = 30
    positions = _seed(
        kafka_bootstrap,
        dlq,
        source,
        [DeadLetter(f"v{i}".encode(), source_partition=i % 3) for i in range(total)],
    )
    command = [
        sys.executable,
        "-m",
        "worker",
        *_replay_args(kafka_bootstrap, dlq, "--from-beginning", "--guarantee", guarantee, "--json"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    replay = subprocess.Popen([*command, "--rate", "10/s"], cwd=REPO, env=env, stdout=subprocess.PIPE)
    _wait_for(kafka_bootstrap, source, 5, replay)
    replay.send_signal(signal.SIGTERM)
    out, _ = replay.communicate(timeout=30)

    assert replay.returncode == 130
    assert json.loads(out)["interrupted"] is True
    # In-flight records finished and their progress was committed: readers see exactly what it passed.
    committed = _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 3)
    visible = _read_values(kafka_bootstrap, source)
    assert sorted(visible) == sorted(
        v for v, (p, offset) in positions.items() if offset < committed.get(p, 0)
    )
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, timeout=60, check=False)
    assert rerun.returncode == 0, rerun.stderr
    copies = Counter(record.value for record in _read_all(kafka_bootstrap, source))
    assert len(copies) == total
    assert set(copies.values()) == {1}


def _wait_for(bootstrap: str, topic: str, count: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while len(_read_all(bootstrap, topic)) < count:
        assert process.poll() is None, "replay ended before it was stopped"
        assert time.monotonic() < deadline, "replay made no progress"
        time.sleep(0.2)


def test_sigkill_then_rerun_republishes_everything_with_duplicates_only_from_in_flight(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    total = 60
    positions = _seed(
        kafka_bootstrap,
        dlq,
        source,
        [DeadLetter(f"v{i}".encode(), "invalid_json", i % 3) for i in range(total)],
    )
    command = [
        sys.executable,
        "-m",
        "worker",
        *_replay_args(kafka_bootstrap, dlq, "--from-beginning", "--json"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    replay = subprocess.Popen(
        [*command, "--rate", "20/s"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while len(_read_all(kafka_bootstrap, source)) < 20:
            assert replay.poll() is None, replay.stderr.read() if replay.stderr else ""
            assert time.monotonic() < deadline, "replay made no progress"
            time.sleep(0.2)
        replay.send_signal(signal.SIGKILL)
        replay.wait(10)
    finally:
        if replay.poll() is None:
            replay.kill()
    time.sleep(0.5)  # let produce requests already on the wire land

    sent = _read_values(kafka_bootstrap, source)
    committed = _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 3)
    in_flight = sum(1 for value in sent if positions[value][1] >= committed.get(positions[value][0], 0))
    assert 0 < len(sent) < total  # killed mid-way
    assert in_flight < len(sent)  # confirmed progress was committed before the kill

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, timeout=60, check=False)
    assert rerun.returncode == 0, rerun.stderr

    copies = Counter(record.value for record in _read_all(kafka_bootstrap, source))
    assert set(copies) == set(positions)  # every selected record at least once
    duplicates = sum(copies.values()) - total
    assert duplicates <= in_flight


def test_rate_holds_within_ten_percent_over_ten_seconds(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    rate, seconds = 30, 10
    _seed(
        kafka_bootstrap,
        dlq,
        source,
        [DeadLetter(f"v{i}".encode(), source_partition=i % 3) for i in range(rate * seconds + 1)],
    )

    summary = _replay_json(
        capsys, _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--rate", f"{rate}/s", "--json")
    )

    assert summary["counts"]["replayed"] == rate * seconds + 1
    stamps = sorted(record.timestamp_ms for record in _read_all(kafka_bootstrap, source))
    observed = (len(stamps) - 1) / ((stamps[-1] - stamps[0]) / 1000)
    assert abs(observed - rate) <= 0.1 * rate, f"observed {observed:.1f}/s for --rate {rate}/s"


def _replay_process(bootstrap: str, dlq: str, *extra: str) -> subprocess.Popen[bytes]:
    """`python -m worker replay` in exactly_once mode, at 5 records/s: still running when the test acts."""
    command = [
        sys.executable,
        "-m",
        "worker",
        *_replay_args(bootstrap, dlq, "--from-beginning", "--guarantee", "exactly_once", *extra),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [*command, "--rate", "5/s"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_exactly_once_sigkill_then_rerun_publishes_every_record_exactly_once(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    total = 60
    positions = _seed(
        kafka_bootstrap,
        dlq,
        source,
        [DeadLetter(f"v{i}".encode(), "invalid_json", i % 3) for i in range(total)],
    )

    replay = _replay_process(kafka_bootstrap, dlq)
    try:
        _wait_for(kafka_bootstrap, source, 10, replay)
        replay.send_signal(signal.SIGKILL)
        replay.wait(10)
    finally:
        if replay.poll() is None:
            replay.kill()
        replay.communicate()

    visible = Counter(record.value for record in _read_all(kafka_bootstrap, source))
    committed = _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 3)
    # Readers see exactly the records the committed progress has passed: none in flight, none ahead.
    behind_progress = {
        value for value, (partition, offset) in positions.items() if offset < committed.get(partition, 0)
    }
    assert 0 < len(visible) < total
    assert visible == Counter(behind_progress)

    rerun = _replay_json(
        capsys,
        _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--guarantee", "exactly_once", "--json"),
    )

    assert rerun["counts"]["replayed"] == total - len(visible)
    copies = Counter(record.value for record in _read_all(kafka_bootstrap, source))
    assert copies == Counter(list(positions))  # every record once: 0 lost, 0 duplicates


def test_exactly_once_replay_of_the_same_group_fences_the_running_one(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    total = 60
    positions = _seed(
        kafka_bootstrap,
        dlq,
        source,
        [DeadLetter(f"v{i}".encode(), "invalid_json", i % 3) for i in range(total)],
    )
    first = _replay_process(kafka_bootstrap, dlq, "--json")
    try:
        _wait_for(kafka_bootstrap, source, 5, first)

        second = _replay_json(
            capsys,
            _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--guarantee", "exactly_once", "--json"),
        )
        out, err = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()

    assert first.returncode == 1 and out, err.decode()
    stopped = json.loads(out)
    assert stopped["fatal"] and "fenced" in stopped["fatal"].lower()
    # One line of ours, after librdkafka's own log lines; no traceback.
    assert "Traceback" not in err.decode()
    (line,) = [line for line in err.decode().splitlines() if line.startswith("triage-worker:")]
    assert "fenced" in line.lower()
    assert stopped["counts"]["replayed"] + second["counts"]["replayed"] == total
    copies = Counter(record.value for record in _read_all(kafka_bootstrap, source))
    assert copies == Counter(list(positions))


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_a_record_too_large_for_its_topic_is_reported_and_committed_past_and_the_rest_replayed_once(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
    guarantee: str,
) -> None:
    dlq, source = unique_topic("dlq", partitions=2), unique_topic("source")
    small = f"{source}.small"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(small, 1, 1, config={"max.message.bytes": "2000"})])[small].result(30)
    # Dead-letter partition 0: ten records from `source`; partition 1: one too large for its topic `small`
    # between two from `source`. Read at full speed, they share a transaction, which the refused one makes
    # abortable: exactly_once aborts it, reads again, and redoes it without the refused one. (The broker
    # refuses a whole batch for one record too large: records batched with it to `small` would be refused
    # with it, reported as it is; docs/operations.md says so.)
    letters = [DeadLetter(f"v{i}".encode(), source_partition=0) for i in range(10)]
    around = [DeadLetter(f"s{i}".encode(), source_partition=1) for i in range(2)]
    _seed(
        kafka_bootstrap,
        dlq,
        source,
        [*letters, around[0], DeadLetter(b"x" * 5000, source_partition=1, source_topic=small), around[1]],
    )
    args = _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--guarantee", guarantee, "--json")

    summary = _replay_json(capsys, args)
    rerun = _replay_json(capsys, args)

    assert (summary["counts"]["replayed"], summary["counts"]["refused"]) == (12, 1)
    (refused,) = summary["attention"]
    assert (refused["outcome"], refused["partition"], refused["offset"]) == ("refused", 1, 1)
    assert refused["detail"].startswith(f"too large for {small} (MSG_SIZE_TOO_LARGE: ")
    # Committed past: the rerun finds nothing left, and the dead letter is still in its topic.
    assert sum(rerun["counts"].values()) == 0
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 2) == {0: 10, 1: 3}
    assert len(_read_all(kafka_bootstrap, dlq)) == 13
    assert Counter(r.value for r in _read_all(kafka_bootstrap, source)) == Counter(
        letter.value for letter in [*letters, *around]
    )
    assert _read_all(kafka_bootstrap, small) == []


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_a_shrunk_dead_letter_is_never_republished_and_needs_attention_with_its_reason_and_size(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str], guarantee: str
) -> None:
    dlq, source = unique_topic("dlq", partitions=1), unique_topic("source")
    big = b'{"ticket_id": "big", "body": "' + b"x" * 5000
    _seed(
        kafka_bootstrap,
        dlq,
        source,
        [DeadLetter(b"v0"), DeadLetter(big, "too_large", shrunk=True), DeadLetter(b"v2")],
    )
    args = _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--guarantee", guarantee, "--json")

    dry = _replay_json(capsys, [*args, "--dry-run"])
    real = _replay_json(capsys, args)

    for run in (dry, real):
        assert (run["counts"]["replayed"], run["counts"]["shrunk"]) == (2, 1)
        (attention,) = run["attention"]
        # Its original reason and size, and where the original is.
        assert (attention["offset"], attention["outcome"], attention["error_type"]) == (
            1,
            "shrunk",
            "too_large",
        )
        assert attention["omitted_bytes"] == len(b"key-1") + len(big) + len(b"trace-idtrace-1producershop")
        assert f"{source} [0] offset 101" in attention["detail"]
    assert [item["offset"] for item in dry["would_replay"]] == [0, 2]
    # Nothing went out for it: no null value that the worker would dead-letter again as null_value.
    assert sorted(_read_values(kafka_bootstrap, source)) == [b"v0", b"v2"]


def test_a_mistyped_filter_is_refused_before_anything_is_read_and_the_corrected_one_finds_everything(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    _seed(
        kafka_bootstrap, dlq, source, [DeadLetter(f"v{i}".encode(), source_partition=i % 3) for i in range(6)]
    )
    typos = [
        (
            ["--error-type", "invalid-json"],
            "--error-type 'invalid-json' is not an error type",
            "invalid_json",
        ),
        (["--source-topic", source[:-1]], "is not a topic of the cluster", source),
        (["--source-topic", source, "--source-partition", "3"], f"{source} has partitions 0 to 2", None),
    ]

    for typo, problem, suggestion in typos:
        code = main(_replay_args(kafka_bootstrap, dlq, "--from-beginning", *typo))
        out, err = capsys.readouterr()
        assert code == 2 and out == "", err
        (line,) = err.splitlines()  # one line, no traceback
        assert line.startswith("triage-worker: error: ") and problem in line
        if suggestion is not None:
            assert f"did you mean {suggestion}?" in line
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 3) == {}

    summary = _replay_json(
        capsys,
        _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--error-type", "invalid_json", "--json"),
    )
    assert summary["counts"]["replayed"] == 6


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_a_replay_that_matched_nothing_commits_nothing(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str], guarantee: str
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    _seed(
        kafka_bootstrap, dlq, source, [DeadLetter(f"v{i}".encode(), source_partition=i % 3) for i in range(6)]
    )
    args = _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--guarantee", guarantee)

    # A known type none of them has; a source partition none came from (no --source-topic to check it by).
    for selection in (["--error-type", "missing_field"], ["--source-partition", "7"]):
        summary = _replay_json(capsys, [*args, *selection, "--json"])
        assert summary["counts"]["skipped_filter"] == 6 and summary["committed"] == {}
    code = main([*args, "--error-type", "missing_field"])
    out, _ = capsys.readouterr()
    assert code == 0 and "matched none of the records read, so nothing was committed" in out
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 3) == {}

    assert _replay_json(capsys, [*args, "--json"])["counts"]["replayed"] == 6


def test_reset_group_puts_the_group_back_so_a_replay_can_be_redone(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq"), unique_topic("source")
    _seed(
        kafka_bootstrap, dlq, source, [DeadLetter(f"v{i}".encode(), source_partition=i % 3) for i in range(6)]
    )
    group = f"triage-replay.{dlq}"
    replay = _replay_args(kafka_bootstrap, dlq, "--from-beginning", "--json")
    assert _replay_json(capsys, replay)["counts"]["replayed"] == 6
    assert _replay_json(capsys, replay)["counts"]["replayed"] == 0
    assert _committed(kafka_bootstrap, group, dlq, 3) == {0: 2, 1: 2, 2: 2}

    dry = _replay_json(capsys, _replay_args(kafka_bootstrap, dlq, "--reset-group", "--dry-run", "--json"))
    assert [(p["committed_before"], p["beginning"]) for p in dry["partitions"]] == [(2, 0)] * 3
    assert _committed(kafka_bootstrap, group, dlq, 3) == {0: 2, 1: 2, 2: 2}  # a dry run changes nothing
    code = main(_replay_args(kafka_bootstrap, dlq, "--reset-group"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"Reset group {group} on {dlq}" in out and "those it republished before too" in out
    assert _committed(kafka_bootstrap, group, dlq, 3) == {0: 0, 1: 0, 2: 0}

    assert _replay_json(capsys, replay)["counts"]["replayed"] == 6
    assert Counter(record.value for record in _read_all(kafka_bootstrap, source)) == Counter(
        f"v{i}".encode() for i in range(6) for _ in range(2)
    )
    for flags, named in [
        (["--error-type", "invalid_json"], "--error-type"),
        (["--source-partition", "0"], "--source-partition"),
    ]:
        code = main(_replay_args(kafka_bootstrap, dlq, "--reset-group", *flags))
        assert code == 2 and f"--reset-group replays nothing: drop {named}" in capsys.readouterr().err


_NEVER_RETURNS_ON_HANG = (
    "def fix(value):\n"
    "    print('repairing', value)  # a print goes to stderr, never into the replay's --json\n"
    "    while value == b'hang':\n"
    "        pass\n"
    "    return value + b'}'\n"
)


def test_a_transform_that_never_returns_fails_its_record_at_the_time_limit_and_the_rest_is_replayed(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, source = unique_topic("dlq", partitions=1), unique_topic("source")
    positions = _seed(kafka_bootstrap, dlq, source, [DeadLetter(v) for v in (b"v0", b"hang", b"v2", b"v3")])
    fixes = tmp_path / "fixes.py"
    fixes.write_text(_NEVER_RETURNS_ON_HANG)
    args = _replay_args(
        kafka_bootstrap,
        dlq,
        "--from-beginning",
        "--transform",
        f"{fixes}:fix",
        "--transform-timeout",
        "1",
        "--json",
    )

    started = time.monotonic()
    summary = _replay_json(capsys, args)

    assert time.monotonic() - started < 20
    assert (summary["counts"]["replayed"], summary["counts"]["transform_failed"]) == (3, 1)
    (failure,) = summary["attention"]
    assert (failure["offset"], failure["outcome"]) == (positions[b"hang"][1], "transform_failed")
    assert failure["detail"].startswith("TransformTimeout: no answer within 1 s (--transform-timeout)")
    assert sorted(_read_values(kafka_bootstrap, source)) == [b"v0}", b"v2}", b"v3}"]
    # As for a transform that raises: reported, and behind the group's position (--offsets and another
    # --group replay it once the transform is fixed).
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 1) == {0: 4}


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_replay_inside_a_transform_that_never_returns(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path, signum: signal.Signals
) -> None:
    dlq, source = unique_topic("dlq", partitions=1), unique_topic("source")
    values = [b"v0", b"v1", b"hang", b"v3"]
    _seed(kafka_bootstrap, dlq, source, [DeadLetter(v) for v in values])
    fixes = tmp_path / "fixes.py"
    fixes.write_text(_NEVER_RETURNS_ON_HANG)
    command = [
        sys.executable,
        "-m",
        "worker",
        *_replay_args(kafka_bootstrap, dlq, "--from-beginning", "--json", "--transform", f"{fixes}:fix"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    replay = subprocess.Popen(
        [*command, "--transform-timeout", "600"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for(kafka_bootstrap, source, 2, replay)
        transform_processes = _children(replay.pid)
        assert transform_processes, "the transform runs in a process of its own"
        time.sleep(0.5)  # well inside the call that never returns
        replay.send_signal(signum)
        out, err = replay.communicate(timeout=15)
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.communicate()

    assert replay.returncode == 130
    lines = err.decode().splitlines()
    assert "Traceback" not in err.decode()
    (notice,) = [line for line in lines if line.startswith("triage-worker:")]
    assert notice.startswith(f"triage-worker: {signum.name}: stopping the replay")
    assert json.loads(out)["interrupted"] is True
    # Committed only past what was republished: the record inside the transform, and what follows, are not.
    assert _committed(kafka_bootstrap, f"triage-replay.{dlq}", dlq, 1) == {0: 2}
    assert sorted(_read_values(kafka_bootstrap, source)) == [b"v0}", b"v1}"]
    assert not any(Path(f"/proc/{pid}").exists() for pid in transform_processes)
