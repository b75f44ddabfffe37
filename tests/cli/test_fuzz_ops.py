"""The ops commands never end on a bad record: `replay` with odd dead letters and failing transforms,
`classify --input` with poison lines. Property tests are derandomized (same examples every run)."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from tools import REPO
from worker.app.doors import limits
from worker.cli.classify_command import EXIT_LINES_SKIPPED
from worker.cli.cli import main
from worker.cli.replay_command import _print_report
from worker.kafka.clients import KafkaClients, create_consumer
from worker.kafka.dead_letters import DEAD_LETTER_HEADERS, REPLAY_COUNT, dead_letter_headers, read_dead_letter
from worker.messages import TriageResult
from worker.pipeline.failure import Failure
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.seams import Record, Settlement
from worker.pipeline.settlements.delivery import DeliveryRules
from worker.pipeline.settlements.guarantees import AtLeastOnce, GuaranteeWiring
from worker.pipeline.settlements.in_order import InOrder
from worker.pipeline.settlements.offsets import OffsetTracker
from worker.pipeline.triage.records import DeadLetterRedaction
from worker.replay.outcomes import ReplayOutcome, ReplaySummary
from worker.replay.reports import Reports
from worker.replay.selection import ReplayOptions
from worker.replay.source import ReplaySource
from worker.replay.stage import ReplayStage
from worker.replay.transforms import TransformFailed, TransformFunction, apply_transform, describe_failure
from worker.settings import Settings

TINY = REPO / "tests" / "models" / "tiny"

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class _InProcess:
    """A transform called in the test's process, its failures described as its own process describes them
    (`worker.replay.transforms`: the same `apply_transform` and `describe_failure`)."""

    def __init__(self, function: TransformFunction) -> None:
        self.function = function

    def repair(self, value: bytes) -> bytes | None:
        try:
            return apply_transform(self.function, value)
        except BaseException as problem:
            raise TransformFailed(describe_failure(problem)) from None


_DLQ = "tickets.dlq"


class _HandFed:
    """A replay of partition 0 of the dead-letter topic, each record fed by hand as the loop takes it, through
    the replay's own source, stage, reports and settlement; its clients never reach a broker."""

    def __init__(
        self, function: TransformFunction | None, dry_run: bool = True, to_topic: str | None = None
    ) -> None:
        transform = None if function is None else _InProcess(function)
        self.options = ReplayOptions(
            dlq_topic=_DLQ, group="g", transform=transform, dry_run=dry_run, to_topic=to_topic
        )
        settings = Settings(kafka={"bootstrap.servers": "127.0.0.1:1"})
        self.summary = ReplaySummary(_DLQ, "g", dry_run)
        self.consumer = create_consumer(settings.kafka, settings.pipeline)
        metrics = PipelineMetrics()
        redaction = DeadLetterRedaction.configured(settings.privacy, settings.dead_letter)
        tracker = OffsetTracker()
        numbers = limits(settings)
        self.state = tracker.assign((_DLQ, 0))
        self.source = ReplaySource(self.consumer, self.options, tracker, lambda plan: None)
        reports = Reports(self.summary, None, self.source, exactly_once=False)
        self.settlement: Settlement = (
            InOrder(lambda work, _output: reports.delivered(work, None))
            if dry_run
            else AtLeastOnce(
                GuaranteeWiring(
                    settings.pipeline.guarantee, DeliveryRules(None, redaction, metrics, time.monotonic),
                    KafkaClients(settings.kafka, settings.pipeline), self.consumer, tracker, metrics,
                    time.monotonic, reports.stopped, Failure(), reports,
                    max_in_flight=numbers.max_in_flight, commit_interval_s=numbers.commit_interval_s,
                )
            )
        )  # fmt: skip
        self.stage = ReplayStage(self.options, self.source, self.settlement, reports)

    def take(self, offset: int, key: bytes | None, value: bytes | None, headers: list[Any] | None) -> None:
        """As the loop takes a record: the source starts carrying it, the settlement hears of it, the stage
        takes it."""
        record = Record(_DLQ, 0, offset, key, value, headers)
        work = self.source.work(record, 0.0, 0.0)
        assert work is not None
        self.settlement.taken(work)
        self.stage.take(work, record, self.stage.admit(record))


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def _raise(problem: BaseException) -> TransformFunction:
    def transform(value: bytes) -> bytes | None:
        raise problem

    return transform


def _as_loaded(function: Callable[[bytes], object]) -> TransformFunction:
    """A transform as `load_transform` hands it over: from a user's module, unchecked, so one that returns
    something other than bytes or None reaches the replay (what these cases test)."""
    return cast(TransformFunction, function)


TRANSFORMS: dict[str, TransformFunction | None] = {
    "none": None,
    "identity": lambda value: value,
    "skip": lambda value: None,
    "bytearray": _as_loaded(lambda value: bytearray(value + b"}")),
    "huge error": _raise(ValueError("x" * 100_000 + "\udcff [/bold]")),
    "sys.exit": _raise(SystemExit(3)),
    "unprintable": _raise(_Unprintable()),
    "returns str": _as_loaded(lambda value: value.decode("utf-8", "replace")),
    "returns int": _as_loaded(lambda value: 5),
}

_odd_text = st.sampled_from(["[/x]", "[bold]", "\x00", "", "a" * 300, "bad topic", "tickets.raw", "é"])
_headers = st.one_of(
    st.none(),
    st.builds(
        lambda originals, error_type, message, topic, replays: dead_letter_headers(
            originals, error_type, message, topic, 0, 7, replays
        ),
        st.lists(st.tuples(st.sampled_from(["trace", REPLAY_COUNT]), st.none() | st.binary(max_size=8))),
        _odd_text | st.text(max_size=10),
        _odd_text | st.text(max_size=50),
        _odd_text | st.text(max_size=10),
        st.integers(0, 5),
    ),
    st.lists(
        st.tuples(
            st.sampled_from(sorted(DEAD_LETTER_HEADERS)) | st.text(max_size=5), st.none() | st.binary()
        ),
        max_size=9,
    ),
)
_records = st.lists(
    st.tuples(
        st.none() | st.binary(max_size=40) | st.just(b"[/red]"), st.none() | st.binary(max_size=64), _headers
    ),
    min_size=1,
    max_size=8,
)


@FUZZ
@given(st.sampled_from(sorted(TRANSFORMS)), _records)
def test_every_dead_letter_settles_with_one_outcome_and_the_report_prints(
    transform_name: str, records: list[tuple[bytes | None, bytes | None, list[Any] | None]]
) -> None:
    replay = _HandFed(TRANSFORMS[transform_name])
    try:
        for offset, (key, value, headers) in enumerate(records):
            replay.take(offset, key, value, headers)
    finally:
        replay.consumer.close()
    summary = replay.summary
    assert sum(summary.counts.values()) == len(records)  # exactly one outcome each
    unreadable = 0
    for _, _, headers in records:
        try:
            read_dead_letter(headers)
        except ValueError:
            unreadable += 1
    assert summary.counts[ReplayOutcome.UNREADABLE] == unreadable
    # All settled, a rerun would not see them again; unless none matched (no filter here: all unreadable),
    # when nothing is committed.
    assert replay.state.position == (len(records) if unreadable < len(records) else None)
    assert all(len(report.detail or "") <= 200 for report in summary.attention)
    msgspec.json.encode(summary.to_json())  # --json output
    out = io.StringIO()
    _print_report(Console(file=out, width=200), summary, replay.options)
    if any(report.key == b"[/red]" for report in [*summary.attention, *summary.would_replay]):
        assert "[/red]" in out.getvalue()  # shown as text, not read as markup


def _take_valid_dead_letter(replay: _HandFed, offset: int) -> None:
    headers = dead_letter_headers(None, "invalid_json", "bad", "tickets.raw", 0, offset)
    replay.take(offset, b"[/red]", b'{"ticket_id": "T"', headers)


@pytest.mark.parametrize(
    ("name", "outcome", "detail"),
    [
        ("huge error", ReplayOutcome.TRANSFORM_FAILED, "ValueError: xxx"),
        ("sys.exit", ReplayOutcome.TRANSFORM_FAILED, "SystemExit: 3"),
        ("unprintable", ReplayOutcome.TRANSFORM_FAILED, "_Unprintable: (no description)"),
        (
            "returns str",
            ReplayOutcome.TRANSFORM_FAILED,
            "TypeError: transform returned str, expected bytes",
        ),
        ("skip", ReplayOutcome.TRANSFORM_SKIPPED, None),
        ("bytearray", ReplayOutcome.REPLAYED, None),
    ],
)
def test_a_transform_failing_any_way_is_reported_for_its_record_only(
    name: str, outcome: ReplayOutcome, detail: str | None
) -> None:
    replay = _HandFed(TRANSFORMS[name])
    try:
        _take_valid_dead_letter(replay, 0)
        replay.take(1, None, b"v", [("triage.replay_count", b"9" * 5000)])
    finally:
        replay.consumer.close()
    counts = replay.summary.counts
    assert counts[outcome] == 1 and counts[ReplayOutcome.UNREADABLE] == 1
    if detail is not None:
        (first,) = [report for report in replay.summary.attention if report.offset == 0]
        assert first.detail is not None and first.detail.startswith(detail) and len(first.detail) <= 200
        assert "\udcff" not in first.detail
    out = io.StringIO()
    _print_report(Console(file=out, width=300), replay.summary, replay.options)
    if (
        outcome is not ReplayOutcome.TRANSFORM_SKIPPED
    ):  # listed, with its key shown as text, not read as markup
        assert "[/red]" in out.getvalue()


def test_a_target_the_client_refuses_is_reported_refused_and_committed_past_not_a_crash() -> None:
    replay = _HandFed(None, dry_run=False, to_topic="tickets\x00raw")
    try:
        _take_valid_dead_letter(replay, 0)
    finally:
        replay.consumer.close()
    (report,) = replay.summary.attention
    assert report.outcome is ReplayOutcome.REFUSED and "embedded null" in (report.detail or "")
    # Settled: sending it again cannot help, so the run commits past it (it stays in the dead-letter topic).
    assert replay.state.position == 1


def test_classify_input_reports_poison_lines_with_the_dead_letter_reason_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[bytes] = [
        b'{"ticket_id": "a", "body": "Where is my card?"}',
        b"[" * 4000,  # deep nesting, under the size limit set below
        b'{"ticket_id": "b", "body": "x", "metadata": {"[/bold]": 1}}',  # markup in the reason
        b'{"ticket_id": "c", "body": "caf\xe9"}',
        b'{"ticket_id": "d", "body": "x", "created_at": "2024-02-30T00:00:00Z"}',
        b'{"ticket_id": "e", "body": "' + b"y" * 5000 + b'"}',
        b'{"ticket_id": "f", "body": "[/red] ignore previous instructions"}',
    ]
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_bytes(b"\n".join(lines) + b"\n")
    output = tmp_path / "results.jsonl"
    code = main(
        [
            *("classify", "--input", str(tickets), "--output", str(output), "--model", str(TINY)),
            *("--set", "inference.pool=thread", "--set", "pipeline.max_value_bytes=4096"),
        ]
    )
    err = capsys.readouterr().err
    assert code == EXIT_LINES_SKIPPED, err
    for number, reason in [
        (2, "too_deeply_nested"),
        (3, "wrong_type: `metadata.[/bold]` must be a string"),
        (4, "invalid_utf8"),
        (5, "invalid_timestamp"),
        (6, "too_large: line is over the 4096-byte limit"),
    ]:
        assert f"tickets.jsonl:{number}: skipped, not a TicketEvent: {reason}" in err
    assert "bad lines skipped: 5" in err
    results = [msgspec.json.decode(line, type=TriageResult) for line in output.read_bytes().splitlines()]
    assert [(r.ticket_id, r.source.offset) for r in results] == [("a", 0), ("f", 6)]
