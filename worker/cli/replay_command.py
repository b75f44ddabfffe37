"""`triage-worker replay`: the ops' command around the replay door, `worker.app.replay` (flags, progress bar,
report).

Output is for two readers: a person (a live progress bar on stderr when it is a terminal, then tables on
stdout) and a script (``--json``: one JSON object on stdout). Exit codes: 0 done, 1 some publish failed
(those records stay before the committed position and are retried by the next run) or, with exactly_once,
the transactional producer stopped (e.g. fenced by another replay of the group; the summary says why), 2 a
user error (one line, nothing read), 130 stopped by SIGINT or SIGTERM (confirmed progress is committed
first; `worker.app.signals`: a second signal exits at once, and the next run sends again what was not
committed).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime, timedelta
from types import TracebackType

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from worker.app.replay import INTERRUPT_DRAIN_S, Replay
from worker.app.signals import StopOnSignals
from worker.errors import UserError
from worker.kafka.admin import check_cluster
from worker.kafka.clients import producer_config
from worker.logs import configure_logging
from worker.replay.outcomes import PartitionPlan, RecordReport, ReplayOutcome, ReplaySummary, printable
from worker.replay.selection import (
    DEFAULT_MAX_REPLAYS,
    OffsetRange,
    ReplayOptions,
    default_group,
    reset_group,
)
from worker.replay.transforms import DEFAULT_TRANSFORM_TIMEOUT_S, TransformProcess, TransformStopped
from worker.settings import Settings, add_config_argument, settings_from_args
from worker.telemetry.replay import replay_metrics

EXAMPLES = """\
examples:
  # what would be replayed, by error type (publishes and commits nothing)
  triage-worker replay --from-beginning --dry-run
  # replay one kind of failure, repaired in flight, at most 200 records/s
  triage-worker replay --from-beginning --error-type invalid_json --transform fixes:repair_json --rate 200/s
  # the last two hours, into a scratch topic to check first
  triage-worker replay --since 2h --to tickets.replay-check --group triage-replay.check-1
"""

_COLUMNS: tuple[tuple[ReplayOutcome, str], ...] = (
    (ReplayOutcome.REPLAYED, "replayed"),
    (ReplayOutcome.SKIPPED_FILTER, "filtered out"),
    (ReplayOutcome.SKIPPED_MAX_REPLAYS, "at max replays"),
    (ReplayOutcome.SHRUNK, "value not kept"),
    (ReplayOutcome.TRANSFORM_SKIPPED, "transform skipped"),
    (ReplayOutcome.TRANSFORM_FAILED, "transform failed"),
    (ReplayOutcome.REFUSED, "refused by target"),
    (ReplayOutcome.PUBLISH_FAILED, "publish failed"),
    (ReplayOutcome.UNREADABLE, "unreadable"),
)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """An RFC 3339 time or date (naive = UTC), or a duration ago: ``30m``, ``2h``, ``1d``, ``1w``."""
    value = text.strip()
    match = _DURATION.match(value.lower())
    if match:
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise UserError(
            f"invalid time {text!r}: expected RFC 3339 (2024-05-01T10:00:00Z), a date, or a duration ago (2h)"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


_RANGE = re.compile(r"^(\d+):(\d+)(?:-(\d*))?$")


def parse_offset_ranges(text: str) -> tuple[OffsetRange, ...]:
    """``P:START-END`` (END inclusive), ``P:START-`` (to the end) or ``P:OFFSET``, comma-separated."""
    ranges: dict[int, OffsetRange] = {}
    for item in (part.strip() for part in text.split(",")):
        match = _RANGE.match(item)
        if not match:
            raise UserError(f"invalid --offsets item {item!r}: expected P:START-END, P:START- or P:OFFSET")
        partition, start = int(match.group(1)), int(match.group(2))
        last = match.group(3)
        if last is None:
            end: int | None = start + 1
        elif last == "":
            end = None
        else:
            end = int(last) + 1
            if end <= start:
                raise UserError(f"invalid --offsets item {item!r}: END is before START")
        if partition in ranges:
            raise UserError(f"invalid --offsets: partition {partition} is given twice")
        ranges[partition] = OffsetRange(partition, start, end)
    return tuple(ranges[p] for p in sorted(ranges))


def parse_rate(text: str) -> float:
    """``50``, ``50/s``, ``3000/m`` → records per second (> 0)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*(s|m|min|h))?\s*", text)
    rate = float(match.group(1)) if match else 0.0
    if not match or rate <= 0:
        raise UserError(
            f"invalid --rate {text!r}: expected a positive number of records per second, e.g. 50/s"
        )
    per = {"s": 1, None: 1, "m": 60, "min": 60, "h": 3600}[match.group(2)]
    return rate / per


def parse_seconds(text: str) -> float:
    """``5``, ``2.5s``, ``500ms`` → seconds (> 0)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|ms)?\s*", text)
    seconds = float(match.group(1)) / (1000 if match.group(2) == "ms" else 1) if match else 0.0
    if not match or seconds <= 0:
        raise UserError(
            f"invalid --transform-timeout {text!r}: expected a positive number of seconds, e.g. 5s"
        )
    return seconds


def _positive_int(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a partition number, got {text!r}")
    return int(text)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="republish dead letters to their source topic, filtered, rate-limited and resumable",
        description=(
            "Republish dead letters (original key, value and headers; triage.replay_count + 1) to the topic "
            "they came from. Progress is committed under the replay's own consumer group once the broker "
            "confirmed the records, so a rerun resumes where the last one stopped; records the group passed "
            "over (filtered or skipped) count as done for that group: use another --group for another "
            "selection, or --reset-group. A run that matched nothing commits nothing. The run stops at the "
            "end offsets seen at start."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_argument(parser)
    parser.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers, host:port")
    where = parser.add_argument_group("selection (one required), or --reset-group")
    selection = where.add_mutually_exclusive_group(required=True)
    selection.add_argument(
        "--from-beginning", action="store_true", help="from the group's committed position, else the start"
    )
    selection.add_argument(
        "--since", metavar="TIME", help="records dead-lettered since TIME: RFC 3339, a date, or ago (2h, 30m)"
    )
    selection.add_argument(
        "--offsets",
        metavar="P:START-END,...",
        help="dead-letter offsets per partition, END inclusive (P:START- = to the end, P:OFFSET = one)",
    )
    selection.add_argument(
        "--reset-group",
        action="store_true",
        help=(
            "replay nothing: put the group back to the beginning of the dead-letter topic, so a replay can "
            "be redone (it then republishes what the group replayed before, too)"
        ),
    )
    filters = parser.add_argument_group("filters (each checked before anything is read)")
    filters.add_argument("--until", metavar="TIME", help="stop at records dead-lettered after TIME")
    filters.add_argument(
        "--error-type",
        action="append",
        default=[],
        metavar="TYPE",
        help="only this triage.error.type (repeatable; one this worker writes, see schemas/dead_letter.md)",
    )
    filters.add_argument(
        "--source-topic", metavar="TOPIC", help="only records that came from TOPIC (a topic of the cluster)"
    )
    filters.add_argument(
        "--source-partition", type=_non_negative_int, metavar="P", help="only records from source partition P"
    )
    filters.add_argument("--limit", type=_positive_int, metavar="N", help="replay at most N records this run")
    safety = parser.add_argument_group("safety and output")
    safety.add_argument("--dry-run", action="store_true", help="show what would be replayed; publish nothing")
    safety.add_argument(
        "--max-replays",
        type=_positive_int,
        metavar="N",
        help=f"skip (and report) records already replayed N times (default {DEFAULT_MAX_REPLAYS})",
    )
    safety.add_argument("--rate", metavar="N/s", help="publish at most N records per second")
    safety.add_argument(
        "--transform",
        metavar="MODULE:FUNCTION",
        help="repair values in flight: bytes -> bytes, or None to skip (runs in a process of its own)",
    )
    safety.add_argument(
        "--transform-timeout",
        metavar="SECONDS",
        help=(
            f"time limit per transform call (default {DEFAULT_TRANSFORM_TIMEOUT_S:g}s): an overrun is that "
            "record's transform failure"
        ),
    )
    safety.add_argument("--to", metavar="TOPIC", help="publish here instead of each record's source topic")
    safety.add_argument(
        "--dlq", metavar="TOPIC", help="dead-letter topic to read (default: topics.dead_letter)"
    )
    safety.add_argument("--group", help="consumer group holding the progress (default: triage-replay.<dlq>)")
    safety.add_argument(
        "--guarantee",
        choices=("at_least_once", "exactly_once"),
        help=(
            "exactly_once: republished records and progress commit in one transaction; readers need "
            "isolation.level=read_committed (default: pipeline.guarantee)"
        ),
    )
    safety.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    safety.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the progress as Prometheus metrics on PORT while the replay runs (host: metrics.host)",
    )
    parser.set_defaults(handler=run, takes_stop_signals=True)


# What only a replay uses: refused with --reset-group, which would silently ignore them.
_REPLAY_ONLY = (
    "until",
    "error_type",
    "source_topic",
    "source_partition",
    "limit",
    "max_replays",
    "rate",
    "transform",
    "transform_timeout",
    "to",
    "guarantee",
    "metrics_port",
)


def options_from_args(args: argparse.Namespace, dlq_topic: str) -> ReplayOptions:
    """The flags as ReplayOptions, the transform not started yet; UserError for values argparse cannot check
    (times, ranges, error types)."""
    if args.transform_timeout is not None and args.transform is None:
        raise UserError("--transform-timeout needs --transform")
    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until) if args.until else None
    if since is not None and until is not None and until <= since:
        raise UserError("--until must be later than --since")
    return ReplayOptions(
        dlq_topic=dlq_topic,
        group=args.group or default_group(dlq_topic),
        since=since,
        until=until,
        offsets=parse_offset_ranges(args.offsets) if args.offsets else None,
        error_types=frozenset(args.error_type),
        source_topic=args.source_topic,
        source_partition=args.source_partition,
        limit=args.limit,
        max_replays=args.max_replays or DEFAULT_MAX_REPLAYS,
        to_topic=args.to,
        rate=parse_rate(args.rate) if args.rate else None,
        dry_run=args.dry_run,
    )


class _ProgressBar:
    """Live counts on stderr while the replay runs (only on a terminal; logs get the final report)."""

    def __init__(self, console: Console, dry_run: bool) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[counts]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self._label = "dry run" if dry_run else "replay"
        self._task: TaskID | None = None
        self._counts = {outcome: 0 for outcome, _ in _COLUMNS}

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._progress.stop()

    def planned(self, plan: list[PartitionPlan]) -> None:
        total = sum(item.end - item.start for item in plan)
        self._task = self._progress.add_task(self._label, total=total, counts=self._text())
        self._progress.start()

    def settled(self, report: RecordReport) -> None:
        self._counts[report.outcome] += 1
        if self._task is not None:
            self._progress.update(self._task, advance=1, counts=self._text())

    def _text(self) -> str:
        return "  ".join(f"{label} {self._counts[outcome]}" for outcome, label in _COLUMNS)


class _StopNotice:
    """Says in one line on stderr that a signal stops the replay (`StopOnSignals` announces with it): from a
    thread of its own, since a signal handler interrupts the main thread anywhere, perhaps inside the progress
    bar's own write to the same console."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._signal = threading.Event()
        self._name = ""
        threading.Thread(target=self._print, name="replay-stop-notice", daemon=True).start()

    def __call__(self, name: str, held: bool) -> None:
        self._name = name
        self._signal.set()

    def _print(self) -> None:
        self._signal.wait()
        self._console.print(
            f"triage-worker: {self._name}: stopping the replay: records in flight finish (at most "
            f"{INTERRUPT_DRAIN_S:g} s), the group is committed past what was republished; exit 130. "
            "Again to abort.",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    replay = Replay()
    stop = StopOnSignals(args.held_stop_signals.received, replay.request_stop, _StopNotice(err))
    try:
        settings = settings_from_args(
            args,
            {
                "kafka.bootstrap.servers": args.bootstrap_servers,
                "topics.dead_letter": args.dlq,
                "pipeline.guarantee": args.guarantee,
            },
        )
        dlq_topic = settings.topics.dead_letter
        if args.reset_group:
            given = [
                f"--{name.replace('_', '-')}"
                for name in _REPLAY_ONLY
                if getattr(args, name) not in (None, [])
            ]
            if given:
                raise UserError(f"--reset-group replays nothing: drop {', '.join(given)}")
            return _reset(args, settings, dlq_topic)
        options = options_from_args(args, dlq_topic)
        # The report is the output; logs (stderr) carry only what went wrong, whatever log.level says for
        # the worker (the delivery guarantee logs each commit at info).
        quiet = "warning" if settings.log.level in ("debug", "info") else settings.log.level
        configure_logging(msgspec.structs.replace(settings.log, level=quiet), settings.privacy)
        try:
            # Loaded before the broker is asked anything: a bad --transform is one line, nothing read.
            with _transform(args, replay.stop_requested) as transform:
                options = dataclasses.replace(options, transform=transform)
                # One clear line at start for a refused login or an untrusted certificate, which the
                # replay's own clients would only report as metadata timeouts.
                check_cluster(producer_config(settings.kafka))
                with (
                    _ProgressBar(err, options.dry_run) as bar,
                    replay_metrics(args.metrics_port, settings.metrics, bar) as observer,
                ):
                    summary = replay.run(settings, options, observer)
        except TransformStopped:  # stopped while the transform loaded: nothing was read
            return 130
    finally:
        stop.restore()
    if args.json:
        sys.stdout.write(msgspec.json.encode(summary.to_json()).decode() + "\n")
    else:
        # Piped to a file or a log, keep rows whole rather than folding them at 80 columns.
        out = Console()
        _print_report(out if out.is_terminal else Console(width=200), summary, options)
    if summary.fatal is not None:
        print(f"triage-worker: error: {summary.fatal}", file=sys.stderr)
        return 1
    if summary.interrupted:
        return 130
    return 1 if summary.failed else 0


def _transform(
    args: argparse.Namespace, should_stop: Callable[[], bool]
) -> AbstractContextManager[TransformProcess | None]:
    """The running --transform (its process ends with the block), or None."""
    if args.transform is None:
        return nullcontext()
    given = args.transform_timeout
    timeout = DEFAULT_TRANSFORM_TIMEOUT_S if given is None else parse_seconds(given)
    return TransformProcess(args.transform, timeout, should_stop)


def _reset(args: argparse.Namespace, settings: Settings, dlq_topic: str) -> int:
    """`--reset-group`: the group's positions on the dead-letter topic back to its beginning."""
    group = args.group or default_group(dlq_topic)
    check_cluster(producer_config(settings.kafka))
    resets = reset_group(settings.kafka, settings.pipeline, dlq_topic, group, args.dry_run)
    if args.json:
        data = {
            "dlq_topic": dlq_topic,
            "group": group,
            "dry_run": args.dry_run,
            "partitions": [
                {"partition": r.partition, "committed_before": r.committed, "beginning": r.beginning}
                for r in resets
            ],
        }
        sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
        return 0
    moved = [r for r in resets if r.moves]
    if not moved:
        print(f"Group {group} is at the beginning of {dlq_topic} already: nothing to reset.")
        return 0
    verb = "Would reset" if args.dry_run else "Reset"
    positions = ", ".join(f"{r.partition}: {r.committed}→{r.beginning}" for r in moved)
    print(f"{verb} group {group} on {dlq_topic} (partition: committed→beginning) {positions}.")
    print(
        "The next replay of this group goes through every dead letter again, those it republished before "
        "too: narrow it with --error-type, --since or --offsets."
    )
    return 0


def _print_report(console: Console, summary: ReplaySummary, options: ReplayOptions) -> None:
    title = escape(f"{summary.dlq_topic} → {options.to_topic or 'source topics'} (group {summary.group})")
    if summary.dry_run:
        console.print(f"[bold]Dry run[/] of {title}: nothing was published, no progress was committed.")
        if summary.would_replay:
            title = f"Would replay ({len(summary.would_replay)})"
            console.print(_records_table(title, summary.would_replay, outcome=False))
    else:
        console.print(f"[bold]Replay[/] ({summary.guarantee}) of {title}")
    for item in summary.plan:
        resumed = f", resumed after group's committed {item.committed}" if item.committed is not None else ""
        console.print(f"  partition {item.partition}: offsets {item.start}..{item.end - 1}{resumed}")
    if summary.attention:
        console.print(_records_table(f"Needs attention ({len(summary.attention)})", summary.attention))
    console.print(_summary_table(summary))
    if summary.committed:
        positions = ", ".join(f"{p}→{offset}" for p, offset in sorted(summary.committed.items()))
        console.print(f"Committed for group {summary.group}: partition→next offset {positions}")
    if summary.matched_nothing:
        console.print(
            "Note: the selection matched none of the records read, so nothing was committed: the group can "
            "run again with other filters."
        )
    elif summary.counts[ReplayOutcome.SKIPPED_FILTER] and not summary.dry_run:
        console.print(
            f"Note: {summary.counts[ReplayOutcome.SKIPPED_FILTER]} records skipped by the filters are behind "
            "the committed position of this group: replay them with another --group (or after --reset-group)."
        )
    if summary.counts[ReplayOutcome.SHRUNK]:
        console.print(
            f"Note: {summary.counts[ReplayOutcome.SHRUNK]} dead letters were too large to keep whole and "
            "carry no value: they are never republished; the detail names each original in its source topic."
        )
    if summary.counts[ReplayOutcome.TRANSFORM_FAILED] and not summary.dry_run:
        console.print(
            "Note: records the transform failed on stay in the dead-letter topic; after fixing it, replay "
            "them with --offsets and another --group."
        )
    if summary.counts[ReplayOutcome.REFUSED]:
        console.print(
            f"Note: {summary.counts[ReplayOutcome.REFUSED]} records were refused by their target topic for "
            "their content (the detail says why, e.g. too large for it): sending them again cannot help, so "
            "they were committed past and stay in the dead-letter topic; after raising the topic's limit, "
            "replay them with --offsets and another --group."
        )
    if summary.failed:
        console.print(
            "[red]Some publishes failed[/]: progress stopped before them; rerun the same command to retry."
        )
    if summary.interrupted:
        console.print("[yellow]Interrupted[/]: confirmed progress was committed; rerun to resume.")
    if summary.fatal is not None:
        console.print(
            f"[red]Stopped[/]: {escape(summary.fatal)}. What was committed stands and nothing else was "
            "published; rerun to resume, unless another replay of this group fenced this one and goes on."
        )


def _records_table(title: str, reports: list[RecordReport], outcome: bool = True) -> Table:
    """One row per record; `outcome` False for the dry-run listing, where every row would be replayed.

    Cells hold what the dead letters carry (keys, header text, exception text): escaped, so a `[/x]` in a
    key is shown, not read as rich markup (which would end the report with a MarkupError)."""
    table = Table(title=title, title_justify="left")
    columns = ["partition", "offset", "error type", "replays", "target", "key"]
    for column in [*columns, "outcome", "detail"] if outcome else columns:
        table.add_column(column, overflow="fold")
    for report in reports:
        cells = [
            str(report.partition),
            str(report.offset),
            report.error_type or "-",
            "-" if report.replay_count is None else str(report.replay_count),
            report.target or "-",
            printable(report.key, limit=32) or "-",
        ]
        extra = [report.outcome.value, report.detail or ""] if outcome else []
        table.add_row(*(escape(cell) for cell in (*cells, *extra)))
    return table


def _summary_table(summary: ReplaySummary) -> Table:
    table = Table(title="By error type" + (" (dry run: replayed = would replay)" if summary.dry_run else ""))
    table.add_column("error type")
    for _, label in _COLUMNS:
        table.add_column(label, justify="right")
    for error_type, counts in sorted(summary.by_error_type.items()):
        table.add_row(escape(error_type), *(str(counts[outcome]) for outcome, _ in _COLUMNS))
    table.add_row("[bold]total[/]", *(f"[bold]{summary.counts[outcome]}[/]" for outcome, _ in _COLUMNS))
    return table
