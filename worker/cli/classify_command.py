"""`triage-worker classify`: classify one ticket text, or a JSONL stream of TicketEvents, without Kafka.

Prints TriageResult JSON lines, exactly what the worker would publish (source topic `cli`, partition 0,
offset = the ticket's line index), so a model or taxonomy can be tried and compared offline. The cascade
runs as in the worker (`inference.escalation`): an unsure first answer goes to the escalation stage when the
ticket's deadline leaves time; offline nothing else competes for the cores, so the first stage is never
under pressure and the stage waits rather than sheds.

`--input` is read as a stream (a file, or `-` for stdin) and the results are written in input order as they
come: at most `_HELD_LINES` tickets are held at once, and one line at most `pipeline.max_value_bytes`, so
neither a large file nor one without newlines (`/dev/zero`) can take the memory. What could destroy data is
refused before any work: an output that is the input file itself, or one that cannot be written.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import queue
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from worker.app.stages import open_cascade
from worker.classification import Classification, ClassifyRequest, ticket_text
from worker.cli.arguments import checked_argument_text
from worker.config import Settings, add_config_argument, settings_from_args
from worker.decoding import DecodeError, decode_ticket, has_text
from worker.errors import UserError
from worker.inference.escalation import choose_escalation, escalation_threshold
from worker.inference.loading import resolve_taxonomy
from worker.inference.pairing import warn_once_if_unpaired
from worker.inference.pool import open_engine, open_pool
from worker.inference.taxonomy import Taxonomy
from worker.logs import configure_logging
from worker.messages import SourcePosition, TicketEvent, TriageResult
from worker.pipeline.cascade import Cascade, first_standing, is_unsure
from worker.pipeline.records import encode_result, triage_result
from worker.privacy.redaction import Redactor

SOURCE_TOPIC = "cli"
# `--input` lines that were not tickets were skipped (the rest were classified): a script must not take the
# results for the whole file.
EXIT_LINES_SKIPPED = 3
STANDARD_STREAM = Path("-")
# Tickets read but not yet written (in the model, at the escalation stage, or waiting for an earlier line to
# be written first): the memory bound of a stream, and the escalation stage's window, so it never sheds.
_HELD_LINES = 64
# Tickets decoded ahead of the model, so that it never waits for the reading.
_READ_AHEAD = 16
# How much of an over-long line is read at a time while it is skipped.
_SKIP_CHUNK_BYTES = 1 << 16


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "classify",
        help="classify a ticket text or a JSONL file of tickets with the local model (no Kafka)",
        description=(
            "Print one TriageResult JSON line per ticket. Exit codes: 0 every ticket classified, 2 refused "
            f"before any work (one line says why), {EXIT_LINES_SKIPPED} some --input lines were skipped "
            "(each named on stderr, the others classified)."
        ),
    )
    parser.add_argument("text", nargs="?", help="ticket text (omit when using --input)")
    parser.add_argument(
        "--input",
        type=Path,
        metavar="FILE",
        help="JSONL file of TicketEvent objects, read as a stream (- for stdin)",
    )
    parser.add_argument(
        "--output", type=Path, metavar="FILE", help="write results here (default, or -: stdout)"
    )
    parser.add_argument("--model", metavar="DIR", help="ORT GenAI model folder (inference.model)")
    parser.add_argument("--taxonomy", metavar="FILE", help="taxonomy TOML (inference.taxonomy)")
    parser.add_argument("--mode", choices=["score", "generate"], help="inference.mode")
    parser.add_argument("--provider", choices=["cpu", "cuda", "dml"], help="inference.provider")
    parser.add_argument(
        "--deadline-ms", type=int, metavar="MS", help="per-ticket deadline (pipeline.deadline_ms)"
    )
    add_config_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if (args.text is None) == (args.input is None):
        raise UserError("classify: give either a ticket TEXT or --input FILE")
    settings = settings_from_args(
        args,
        {
            "inference.model": args.model,
            "inference.taxonomy": args.taxonomy,
            "inference.mode": args.mode,
            "inference.provider": args.provider,
            "pipeline.deadline_ms": args.deadline_ms,
        },
    )
    configure_logging(settings.log, settings.privacy)
    with contextlib.ExitStack() as files:
        source = None if args.input is None else files.enter_context(_open_input(args.input))
        out = files.enter_context(_open_output(args.output, source))
        if source is None:
            return _classify_text(settings, args.text, out)
        return _classify_stream(settings, _name(args.input), source, out)


def _classify_text(settings: Settings, text: str, out: IO[bytes]) -> int:
    """One ticket: an in-process context (starting worker processes would cost more than the ticket), of an
    ORT GenAI model or an encoder stage, as the worker's pools open either."""
    event = TicketEvent(ticket_id="cli-0", body=checked_argument_text(text, "the ticket text"))
    if not has_text(event):
        raise UserError("classify: the ticket text is empty; there is nothing to classify")
    engine = open_engine(settings.inference)
    warn_once_if_unpaired(settings.inference, engine.taxonomy, engine.taxonomy_path)
    context = engine.new_context()
    request = ClassifyRequest(0, text, time.monotonic() + settings.pipeline.deadline_ms / 1000.0)
    answer = context.classify(request)
    with contextlib.ExitStack() as stack:
        stage = _escalation_stage(settings, engine.taxonomy, engine.taxonomy_path, stack, window=1)
        if stage is not None:
            escalations = _Escalations(escalation_threshold(settings.inference), stage)
            settled = escalations.first(request, answer)
            while not settled:
                settled = escalations.settled(0.5)
            ((_, answer),) = settled
    pii = settings.privacy.redactor().scan(event.subject, event.body).kinds
    out.write(encode_result(triage_result(event, answer, _source(0), pii=pii)) + b"\n")
    return 0


def _classify_stream(settings: Settings, name: str, source: IO[bytes], out: IO[bytes]) -> int:
    """Classify each ticket line of `source` and write its result to `out` in input order, as they come
    (see the module's docstring for the bounds)."""
    console = Console(stderr=True, soft_wrap=True)  # one line per message, whatever the width
    skipped: collections.Counter[str] = collections.Counter()
    tickets = _Input(_tickets(source, name, console, settings.pipeline.max_value_bytes, skipped), name)
    with contextlib.closing(tickets):
        if not tickets.any():
            # Before the pool starts: loading the model for nothing would only hide the problem for a while.
            detail = (
                f"{sum(skipped.values())} line(s) rejected ({_why(skipped)})"
                if skipped
                else "the file has no lines"
            )
            raise UserError(f"{name}: no ticket to classify: {detail}")
        return _classify_tickets(settings, tickets, out, console, skipped)


def _classify_tickets(
    settings: Settings,
    tickets: _Input,
    out: IO[bytes],
    console: Console,
    skipped: collections.Counter[str],
) -> int:
    fallbacks: collections.Counter[str] = collections.Counter()
    taxonomy, taxonomy_path = resolve_taxonomy(settings.inference)
    deadline_s = settings.pipeline.deadline_ms / 1000.0
    order = _InputOrder(out, settings.privacy.redactor())
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(open_pool(settings.inference, settings.log, settings.privacy))
        started = time.monotonic()  # throughput of the model, not of loading it
        stage = _escalation_stage(settings, taxonomy, taxonomy_path, stack, window=_HELD_LINES)
        escalations = None if stage is None else _Escalations(escalation_threshold(settings.inference), stage)
        # A small window at the first stage, so that each ticket's deadline starts when it is sent.
        window = max(2, 2 * pool.size)
        sent: dict[int, ClassifyRequest] = {}  # not answered by the first stage yet
        progress = Progress(
            TextColumn("classifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        with progress:
            task = progress.add_task("classify", total=None)
            while True:
                while len(sent) < window and order.held < _HELD_LINES:
                    # Wait for input only when there is nothing else to wait for.
                    ticket = tickets.get(0.0 if order.held else 0.5)
                    if ticket is None:
                        break
                    line, event = ticket
                    order.hold(line, event)
                    sent[line] = ClassifyRequest(
                        line, ticket_text(event.subject, event.body), time.monotonic() + deadline_s
                    )
                    pool.submit(sent[line])
                if not order.held:
                    if tickets.ended:
                        break
                    continue
                settled: list[tuple[int, Classification]] = []
                for line, answer in pool.poll(0.1) if sent else ():
                    request = sent.pop(line)
                    settled += [(line, answer)] if escalations is None else escalations.first(request, answer)
                if escalations is not None:
                    settled += escalations.settled(0.0 if sent else 0.5)
                for line, answer in settled:
                    order.settle(line, answer)
                    if answer.fallback_reason is not None:
                        fallbacks[answer.fallback_reason] += 1
                    progress.advance(task)
                order.write_ready()
            progress.update(task, total=order.written)
    elapsed = time.monotonic() - started
    rate = order.written / elapsed if elapsed > 0 else 0.0
    summary = ", ".join(f"{reason}={count}" for reason, count in sorted(fallbacks.items())) or "none"
    bad = f"{sum(skipped.values())} ({_why(skipped)}), exit code {EXIT_LINES_SKIPPED}" if skipped else "0"
    console.print(
        f"classified {order.written} tickets in {elapsed:.1f} s ({rate:.1f} tickets/s); "
        f"fallbacks: {summary}; bad lines skipped: {bad}",
        markup=False,
        highlight=False,
    )
    return EXIT_LINES_SKIPPED if skipped else 0


def _why(skipped: collections.Counter[str]) -> str:
    """`empty_ticket 2, invalid_utf8 1`: the skipped lines by reason, most frequent first."""
    return ", ".join(f"{kind} {count}" for kind, count in skipped.most_common())


class _InputOrder:
    """Results written in the order of their lines, each as soon as every earlier line's is out: what is
    held is what was read and not yet written."""

    def __init__(self, out: IO[bytes], redactor: Redactor) -> None:
        self._redactor = redactor
        self._out = out
        self._events: dict[int, TicketEvent] = {}  # in line order
        self._results: dict[int, TriageResult] = {}
        self.written = 0

    @property
    def held(self) -> int:
        return len(self._events)

    def hold(self, line: int, event: TicketEvent) -> None:
        self._events[line] = event

    def settle(self, line: int, answer: Classification) -> None:
        event = self._events[line]
        pii = self._redactor.scan(event.subject, event.body).kinds
        self._results[line] = triage_result(event, answer, _source(line), pii=pii)

    def write_ready(self) -> None:
        while self._events and (line := next(iter(self._events))) in self._results:
            del self._events[line]
            self._out.write(encode_result(self._results.pop(line)) + b"\n")
            self.written += 1
        self._out.flush()  # a reader sees each result once it is known, whatever the buffering


def _escalation_stage(
    settings: Settings, taxonomy: Taxonomy, taxonomy_path: Path, stack: contextlib.ExitStack, window: int
) -> Callable[[], Cascade] | None:
    """Starts the cascade's escalation stage (closed with `stack`) when called; None when there is no
    cascade. Started on the first unsure answer only: most tickets need none."""
    escalation = choose_escalation(settings.inference, taxonomy, taxonomy_path).settings
    if escalation is None:
        return None

    def start() -> Cascade:
        pool, cascade = open_cascade(
            settings, escalation, taxonomy, 1, lambda line: print(line, file=sys.stderr), window=window
        )
        stack.callback(pool.close)
        return cascade

    return start


class _Escalations:
    """The cascade offline, as in the worker: an unsure first answer goes to the escalation stage (started
    on the first one) when its ticket's time left allows (the gate); its line's answer is then the stage's."""

    def __init__(self, escalate_below: float, start_stage: Callable[[], Cascade]) -> None:
        self._escalate_below = escalate_below
        self._start_stage = start_stage
        self._stage: Cascade | None = None
        self._waiting: dict[int, Classification] = {}

    def first(self, request: ClassifyRequest, first: Classification) -> list[tuple[int, Classification]]:
        """The line's answer when the first one stands; none yet when it went to the stage."""
        if not is_unsure(first, self._escalate_below):
            return [(request.request_id, first_standing(first))]
        stage = self._stage = self._stage or self._start_stage()
        now = time.monotonic()
        skipped = stage.gate(request.deadline - now, now, first_stage_pressed=False)
        if skipped is not None:
            return [(request.request_id, stage.first_stands(first, skipped))]
        stage.submit(request, now)
        self._waiting[request.request_id] = first
        return []

    def settled(self, timeout: float) -> list[tuple[int, Classification]]:
        """The stage's answers that are ready (waiting up to `timeout` for the first one)."""
        if self._stage is None or not self._waiting:
            return []
        stage = self._stage
        return [
            (line, stage.escalated(self._waiting.pop(line), second))
            for line, second in stage.poll(timeout, time.monotonic)
        ]


class _Input:
    """The tickets of `--input`, read on a thread of their own, so that a wait for the next line (stdin from
    a pipe) never holds back a result that is ready; at most `_READ_AHEAD` are read ahead."""

    def __init__(self, tickets: Iterator[tuple[int, TicketEvent]], name: str) -> None:
        self._name = name
        self._queue: queue.Queue[tuple[int, TicketEvent] | Exception | None] = queue.Queue(_READ_AHEAD)
        self._closed = threading.Event()
        self._first: tuple[int, TicketEvent] | None = None
        self.ended = False
        threading.Thread(target=self._read, args=(tickets,), name="classify-input", daemon=True).start()

    def _read(self, tickets: Iterator[tuple[int, TicketEvent]]) -> None:
        end: Exception | None = None  # None: the end of the input
        try:
            for ticket in tickets:
                if not self._put(ticket):
                    return
        except Exception as error:  # handed to the command's thread, which says so
            end = error
        self._put(end)

    def _put(self, item: tuple[int, TicketEvent] | Exception | None) -> bool:
        while not self._closed.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.2)
                return True
        return False

    def any(self) -> bool:
        """Whether the input has a ticket at all: waits for the first one (kept for `get`) or the end."""
        self._first = self.get(None)
        return self._first is not None

    def get(self, timeout: float | None) -> tuple[int, TicketEvent] | None:
        """The next ticket, waiting up to `timeout` seconds (None: until there is one or the input ended);
        None when there is none yet, or no more (`ended`)."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        while not self.ended:
            try:
                item = self._queue.get(timeout=0.2 if timeout is None else timeout)
            except queue.Empty:
                if timeout is None:
                    continue
                return None
            if isinstance(item, OSError):
                raise UserError(f"cannot read {self._name}: {item.strerror or item}")
            if isinstance(item, Exception):
                raise item
            if item is not None:
                return item
            self.ended = True
        return None

    def close(self) -> None:
        """The reading thread stops at its next ticket (or at once when it waits to hand one over)."""
        self._closed.set()


def _tickets(
    source: IO[bytes],
    name: str,
    console: Console,
    max_value_bytes: int,
    skipped: collections.Counter[str],
) -> Iterator[tuple[int, TicketEvent]]:
    """(line index, event) for every valid line; a bad line is reported with its line number, counted in
    `skipped` by reason and skipped, so that one bad line does not cost the whole file. Lines are decoded
    exactly as the worker decodes record values, so a line is skipped here for the reason it would be
    dead-lettered."""
    for index, raw in _lines(source, max_value_bytes):
        if raw is not None and not raw.strip():
            continue
        try:
            event = _decoded(raw, max_value_bytes)
        except DecodeError as error:
            skipped[error.error_type] += 1
            # The message quotes the line's own text: print it as is, never as rich markup.
            console.print(
                f"{name}:{index + 1}: skipped, not a TicketEvent: {error}", markup=False, highlight=False
            )
            continue
        yield index, event


def _decoded(line: bytes | None, max_value_bytes: int) -> TicketEvent:
    """`line` (None: longer than `max_value_bytes`, not read whole) decoded as the worker decodes a value."""
    if line is None:
        raise DecodeError(
            "too_large", f"line is over the {max_value_bytes}-byte limit (pipeline.max_value_bytes)"
        )
    return decode_ticket(line, max_value_bytes)


def _lines(source: IO[bytes], limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(index, line) for each line of `source`, None for a line over `limit` bytes: that one is given as soon
    as it is known to be too long, then read past a chunk at a time, never held whole."""
    for index in itertools.count():
        line = source.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            yield index, line
            continue
        yield index, None
        while line and not line.endswith(b"\n"):
            line = source.readline(_SKIP_CHUNK_BYTES)


def _source(line: int) -> SourcePosition:
    return SourcePosition(topic=SOURCE_TOPIC, partition=0, offset=line)


def _name(path: Path) -> str:
    return "<stdin>" if path == STANDARD_STREAM else str(path)


@contextlib.contextmanager
def _open_input(path: Path) -> Iterator[IO[bytes]]:
    if path == STANDARD_STREAM:
        yield sys.stdin.buffer
        return
    try:
        handle = path.open("rb")
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    with handle:
        yield handle


@contextlib.contextmanager
def _open_output(output: Path | None, source: IO[bytes] | None) -> Iterator[IO[bytes]]:
    """The output, opened (created, or emptied) before any work, so that a path that cannot be written fails
    at once; refused when it is the input file itself (by any name: a symlink, a hard link, or stdout
    redirected to it), which writing would destroy while it is read."""
    if output is None or output == STANDARD_STREAM:
        if source is not None:
            with contextlib.suppress(OSError, ValueError):  # no file behind stdout (a test's capture)
                _refuse_same_file(source, os.fstat(sys.stdout.buffer.fileno()), "stdout")
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    if source is not None:
        with contextlib.suppress(OSError):  # not there yet, or not reachable: opening it says why
            _refuse_same_file(source, output.stat(), str(output))
    try:
        handle = output.open("wb")
    except OSError as error:
        raise UserError(f"cannot write {output}: {error.strerror or error}") from None
    with handle:
        yield handle


def _refuse_same_file(source: IO[bytes], target: os.stat_result, what: str) -> None:
    read = os.fstat(source.fileno())
    if stat.S_ISREG(target.st_mode) and (read.st_dev, read.st_ino) == (target.st_dev, target.st_ino):
        raise UserError(
            f"classify: the output ({what}) is the input file itself; writing it would destroy the tickets "
            "while they are read: write the results to another file"
        )
