"""Pure parts of the replay: what ops type (times, ranges, rates, transforms), filters, rate, progress."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import KafkaError, KafkaException

from worker.cli.cli import main
from worker.cli.replay_command import parse_offset_ranges, parse_rate, parse_seconds, parse_time
from worker.errors import UserError
from worker.kafka import errors
from worker.kafka.clients import kafka_call, transactional_id
from worker.kafka.dead_letters import DeadLetterInfo
from worker.replay.outcomes import RecordReport, ReplayOutcome, ReplaySummary, fatal_reason
from worker.replay.selection import (
    OffsetRange,
    ReplayOptions,
    check_source,
    replay_transactional_id,
    why_not_replayed,
)
from worker.replay.source import TokenBucket
from worker.replay.transforms import (
    TransformFailed,
    TransformProcess,
    TransformStopped,
    apply_transform,
    load_transform,
)
from worker.settings import load_settings


def test_offset_ranges_accept_closed_open_and_single_forms() -> None:
    assert parse_offset_ranges("2:10-20, 0:5-,1:7") == (
        OffsetRange(0, 5, None),
        OffsetRange(1, 7, 8),
        OffsetRange(2, 10, 21),
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0:20-10", "END is before START"),
        ("0:1-2,0:3-4", "given twice"),
        ("zero:1-2", "expected P:START-END"),
    ],
)
def test_bad_offset_ranges_say_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(UserError, match=problem):
        parse_offset_ranges(text)


def test_times_are_rfc3339_dates_or_durations_ago() -> None:
    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    assert parse_time("2h", now) == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
    assert parse_time("30m", now) == datetime(2024, 5, 1, 11, 30, tzinfo=UTC)
    assert parse_time("2024-05-01T10:00:00Z") == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
    assert parse_time("2024-05-01") == datetime(2024, 5, 1, tzinfo=UTC)
    with pytest.raises(UserError, match="RFC 3339"):
        parse_time("yesterday")


def test_transform_timeouts_are_seconds() -> None:
    assert parse_seconds("5") == 5
    assert parse_seconds("2.5s") == 2.5
    assert parse_seconds("250ms") == 0.25
    for bad in ("0", "-1", "soon", "5m"):
        with pytest.raises(UserError, match="--transform-timeout"):
            parse_seconds(bad)


def test_rates_are_per_second() -> None:
    assert parse_rate("50") == 50
    assert parse_rate("50/s") == 50
    assert parse_rate("600/m") == 10
    for bad in ("0", "-5", "fast"):
        with pytest.raises(UserError, match="--rate"):
            parse_rate(bad)


def test_transform_loads_from_a_file_and_checks_its_result(tmp_path: Path) -> None:
    fixes = tmp_path / "fixes.py"
    fixes.write_text("def close(value):\n    return value + b'}'\n\ndef text(value):\n    return 'oops'\n")
    assert apply_transform(load_transform(f"{fixes}:close"), b'{"a": 1') == b'{"a": 1}'
    with pytest.raises(TypeError, match="returned str"):
        apply_transform(load_transform(f"{fixes}:text"), b"x")
    with pytest.raises(UserError, match="no function 'missing'"):
        load_transform(f"{fixes}:missing")
    with pytest.raises(UserError, match="cannot load"):
        load_transform("no_such_module_here:fix")


def _info(
    error_type: str = "invalid_json", topic: str = "t", partition: int = 0, count: int = 0
) -> DeadLetterInfo:
    return DeadLetterInfo(
        error_type=error_type,
        error_message="m",
        topic=topic,
        partition=partition,
        offset=1,
        failed_at="2024-05-01T12:00:00.000Z",
        replay_count=count,
    )


def test_a_mistyped_error_type_is_one_line_naming_the_nearest_before_kafka_is_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No broker at that address: the check comes before any connection.
    args = [
        "replay",
        "--from-beginning",
        "--bootstrap-servers",
        "127.0.0.1:1",
        "--error-type",
        "invalid-json",
    ]

    code = main(args)

    err = capsys.readouterr().err
    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith("triage-worker: error: --error-type 'invalid-json' is not an error type")
    assert "did you mean invalid_json?" in line and "missing_field" in line  # the known ones, listed


def test_source_filters_are_checked_against_the_cluster() -> None:
    topics = {"tickets.raw": 3, "tickets.dlq": 3, "__consumer_offsets": 50}

    check_source(
        topics, ReplayOptions(dlq_topic="d", group="g", source_topic="tickets.raw", source_partition=2)
    )
    with pytest.raises(
        UserError, match=r"'tickets\.rwa' is not a topic of the cluster \(did you mean tickets\.raw"
    ):
        check_source(topics, ReplayOptions(dlq_topic="d", group="g", source_topic="tickets.rwa"))
    with pytest.raises(UserError, match=r"tickets\.raw has partitions 0 to 2"):
        check_source(
            topics, ReplayOptions(dlq_topic="d", group="g", source_topic="tickets.raw", source_partition=3)
        )


def test_filters_select_and_max_replays_stop_loops() -> None:
    options = ReplayOptions(
        dlq_topic="dlq",
        group="g",
        error_types=frozenset({"invalid_json"}),
        source_topic="t",
        source_partition=1,
    )
    assert why_not_replayed(_info(partition=1), options) is None
    assert why_not_replayed(_info("missing_field", partition=1), options) is ReplayOutcome.SKIPPED_FILTER
    assert why_not_replayed(_info(topic="other", partition=1), options) is ReplayOutcome.SKIPPED_FILTER
    assert why_not_replayed(_info(partition=2), options) is ReplayOutcome.SKIPPED_FILTER
    assert why_not_replayed(_info(partition=1, count=2), options) is None
    assert why_not_replayed(_info(partition=1, count=3), options) is ReplayOutcome.SKIPPED_MAX_REPLAYS
    shrunk = msgspec.structs.replace(_info(partition=1, count=3), omitted_bytes=5000)
    assert (
        why_not_replayed(shrunk, options) is ReplayOutcome.SHRUNK
    )  # whatever its count: it can never be replayed


def test_token_bucket_holds_the_rate_for_a_greedy_caller() -> None:
    """Over 10 simulated seconds, with late wake-ups, the bucket grants rate * 10 tokens within 10 %."""
    now, granted = 0.0, 0
    bucket = TokenBucket(50.0, now)
    while now < 10.0:
        if bucket.ready(now):
            bucket.take()
            granted += 1
        else:
            now += 0.013  # the loop looks again a turn later (10 ms), late; the burst lets it catch up
    assert 450 <= granted <= 550


def test_summary_counts_by_error_type_and_lists_what_needs_attention() -> None:
    summary = ReplaySummary("dlq", "g", dry_run=False)

    def report(offset: int, outcome: ReplayOutcome, error_type: str | None) -> RecordReport:
        return RecordReport(0, offset, outcome, error_type, 0, "t", b"k", None)

    summary.add(report(0, ReplayOutcome.REPLAYED, "invalid_json"))
    summary.add(report(1, ReplayOutcome.SKIPPED_MAX_REPLAYS, "invalid_json"))
    summary.add(report(2, ReplayOutcome.PUBLISH_FAILED, "missing_field"))
    summary.add(report(3, ReplayOutcome.UNREADABLE, None))
    data = summary.to_json()
    assert data["counts"]["replayed"] == 1
    assert data["counts"]["transform_failed"] == 0
    assert data["by_error_type"]["invalid_json"]["skipped_max_replays"] == 1
    assert data["by_error_type"]["(unreadable)"]["unreadable"] == 1
    assert [item["offset"] for item in data["attention"]] == [1, 2, 3]
    assert summary.failed


def test_kafka_errors_never_echo_a_secret_config_value() -> None:
    def fail() -> None:
        raise KafkaException(KafkaError(KafkaError._INVALID_ARG, 'Invalid value "hunter2" for sasl.password'))

    with pytest.raises(UserError) as caught:
        kafka_call("create a consumer", fail, {"sasl.password": "hunter2", "bootstrap.servers": "b:9092"})
    assert "hunter2" not in str(caught.value)
    assert "***" in str(caught.value)


def test_an_exactly_once_replay_has_one_transactional_id_per_group_on_any_host_never_a_workers() -> None:
    defaults = load_settings(env={})
    replay_id = replay_transactional_id(defaults.pipeline, "triage-replay.tickets.dlq")
    assert (
        replay_id == "triage-worker-replay-triage-replay.tickets.dlq"
    )  # no host name: a rerun anywhere fences
    assert replay_id != transactional_id(defaults.pipeline)
    assert replay_transactional_id(defaults.pipeline, "triage-replay.incident-42") != replay_id
    pinned = load_settings(env={}, overrides={"pipeline.transactional_id": "triage-eu.worker-1"})
    assert (
        replay_transactional_id(pinned.pipeline, "g") == "triage-eu.worker-1-replay-g"
    )  # within an ACL prefix


def test_a_fenced_replay_says_so_in_one_line_without_secret_values() -> None:
    error = KafkaError(KafkaError._FENCED, "fenced by a newer instance (sasl.password=hunter2)", fatal=True)

    line = fatal_reason(
        errors.describe(error),
        errors.fenced(error),
        "triage-replay.tickets.dlq",
        {"sasl.password": "hunter2"},
    )

    assert line.startswith("fenced: another replay of group triage-replay.tickets.dlq took over")
    assert "hunter2" not in line and "***" in line and "\n" not in line


_FIXES = """\
import os, sys, time

def close(value):
    print("fixing", len(value))  # to stderr: never mixed into the frames
    return value + b"}"

def skip(value):
    return None

def fail(value):
    raise ValueError("cannot repair " + "x" * 500)

def leave(value):
    sys.exit(3)

def die(value):
    os._exit(9)

def spin(value):
    if value == b"spin":
        while True:
            pass
    return value
"""


def _fixes(tmp_path: Path) -> Path:
    path = tmp_path / "fixes.py"
    path.write_text(_FIXES)
    return path


def test_a_transform_process_answers_each_call_and_a_failure_is_that_calls_only(tmp_path: Path) -> None:
    fixes = _fixes(tmp_path)
    with TransformProcess(f"{fixes}:close", 5.0, lambda: False) as transform:
        assert transform.repair(b'{"a": 1') == b'{"a": 1}'
        assert transform.repair(b"x" * 3_000_000) == b"x" * 3_000_000 + b"}"  # larger than a pipe's buffer
    with TransformProcess(f"{fixes}:skip", 5.0, lambda: False) as transform:
        assert transform.repair(b"v") is None
    for name, detail in [
        ("fail", "ValueError: cannot repair xxx"),
        ("leave", "SystemExit: 3"),
        ("die", "TransformProcessEnded: the transform's process exited (9)"),
    ]:
        with TransformProcess(f"{fixes}:{name}", 5.0, lambda: False) as transform:
            for _ in range(2):  # and again: after a death, a fresh process
                with pytest.raises(TransformFailed) as failed:
                    transform.repair(b"v")
                assert failed.value.detail.startswith(detail) and len(failed.value.detail) <= 200


def test_a_transform_that_never_returns_is_cut_off_at_its_time_limit_and_the_next_call_works(
    tmp_path: Path,
) -> None:
    with TransformProcess(f"{_fixes(tmp_path)}:spin", 0.5, lambda: False) as transform:
        started = time.monotonic()
        with pytest.raises(TransformFailed, match=r"TransformTimeout: no answer within 0\.5 s"):
            transform.repair(b"spin")
        assert time.monotonic() - started < 2.0
        assert transform.repair(b"fine") == b"fine"


def test_a_stop_asked_for_during_a_call_ends_the_call_at_once(tmp_path: Path) -> None:
    # Timed from when the transform's process is up: starting it takes over a second on a loaded machine.
    stop_at = [float("inf")]
    with TransformProcess(
        f"{_fixes(tmp_path)}:spin", 60.0, lambda: time.monotonic() > stop_at[0]
    ) as transform:
        stop_at[0] = time.monotonic() + 0.3
        with pytest.raises(TransformStopped):
            transform.repair(b"spin")
        assert time.monotonic() - stop_at[0] < 0.5


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("nocolon", "expected module:function"),
        ("no_such_module_here:fix", "cannot load no_such_module_here: ModuleNotFoundError"),
        ("{fixes}:missing", "has no function 'missing'"),
    ],
)
def test_a_transform_that_cannot_be_loaded_is_one_user_error(tmp_path: Path, spec: str, problem: str) -> None:
    with (
        pytest.raises(UserError, match=problem),
        TransformProcess(spec.format(fixes=_fixes(tmp_path)), 5.0, lambda: False),
    ):
        pass


# What an operator's folder may hold besides the fix: files named like modules the transform's process
# imports (the standard library's, msgspec). Each leaves a mark when it runs.
_PLANTED = ("struct", "json", "msgspec", "select", "signal", "threading")


def test_modules_planted_in_the_current_folder_never_run_in_the_transform_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`replay` is run from a folder anyone may have written to: the documented `fixes:close_json` there is
    loaded from `fixes.py`, and a `struct.py` beside it is not the standard library's `struct`."""
    marks = tmp_path / "marks"
    marks.mkdir()
    for name in _PLANTED:
        (tmp_path / f"{name}.py").write_text(
            f"import pathlib\npathlib.Path({str(marks / name)!r}).touch()\n", encoding="utf-8"
        )
    # The README tour's fix as the tour writes it, and one importing a module a planted file is named after.
    (tmp_path / "fixes.py").write_text('def close_json(value):\n    return value + b"}"\n', encoding="utf-8")
    (tmp_path / "compact.py").write_text(
        "import json\n\ndef compact(value):\n    return json.dumps(json.loads(value)).encode()\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)

    with TransformProcess("fixes:close_json", 5.0, lambda: False) as transform:
        assert transform.repair(b'{"ticket_id": "t-1", "body": "charged twice"') == (
            b'{"ticket_id": "t-1", "body": "charged twice"}'
        )
    with TransformProcess("compact:compact", 5.0, lambda: False) as transform:
        assert transform.repair(b'{ "ticket_id" :  "t-1" }') == b'{"ticket_id": "t-1"}'

    assert sorted(path.name for path in marks.iterdir()) == []
