"""`triage-worker classify`: classify one ticket text, or a JSONL stream of TicketEvents, without Kafka.

Prints TriageResult JSON lines, exactly what the worker would publish (source topic `cli`, partition 0,
offset = the ticket's line index), so a model or taxonomy can be tried and compared offline. The tickets go
through the worker's own loop and triage stage (`worker.app.offline`), its cascade included: an unsure
first answer goes to the escalation stage when the ticket's deadline leaves time; offline nothing else
competes for the cores, so the first stage is never under pressure and the stage waits rather than sheds.

`--input` is read as a stream (a file, or `-` for stdin) and the results are written in input order as they
come, within the bounds of `worker/pipeline/sources/lines.py` (a large file, or one without newlines such as
`/dev/zero`, cannot take the memory); a line that is not a ticket is named on stderr with the reason it
would be dead-lettered, and skipped. What could destroy data is refused before any work: an output that is
the input file itself, or one that cannot be written. An existing `--output` FILE is opened (so a path that
cannot be written fails at once) but emptied only when the first result is written, after every check passed
(the ticket text, the first ticket line, the settings, the model): a refusal leaves it as it was, and a FILE
the refused run created is removed again.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Protocol

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from worker.app.offline import classify_lines
from worker.cli.arguments import checked_argument_text
from worker.decoding import DecodeError, decode_ticket, has_text
from worker.errors import UserError
from worker.logs import configure_logging
from worker.messages import TicketEvent
from worker.pipeline.sources.lines import Line, LineReader, stream_lines
from worker.settings import Settings, add_config_argument, settings_from_args

# `--input` lines that were not tickets were skipped (the rest were classified): a script must not take the
# results for the whole file.
EXIT_LINES_SKIPPED = 3
STANDARD_STREAM = Path("-")


class Sink(Protocol):
    """Where results go: stdout's buffer, or an `--output` file (`_DeferredOutput`)."""

    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...


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


def _classify_text(settings: Settings, text: str, out: Sink) -> int:
    """One ticket, through the same loop as a file, on an in-process context (starting worker processes would
    cost more than the ticket)."""
    event = TicketEvent(ticket_id="cli-0", body=checked_argument_text(text, "the ticket text"))
    if not has_text(event):
        raise UserError("classify: the ticket text is empty; there is nothing to classify")
    in_process = msgspec.structs.replace(settings.inference, pool="thread", pool_size=1)
    settings = msgspec.structs.replace(settings, inference=in_process)
    reader = LineReader(iter([(0, msgspec.json.encode(event), None)]), "the ticket text")
    run = classify_lines(
        settings, reader, lambda _line, value: _write_line(out, value), _never_skipped, announce=False
    )
    return 0 if run.written == 1 else 1


def _write_line(out: Sink, value: bytes) -> None:
    out.write(value + b"\n")


def _never_skipped(line: int, error_type: str, message: str) -> None:
    raise UserError(f"classify: the ticket text is not a ticket: {error_type}: {message}")


def _classify_stream(settings: Settings, name: str, source: IO[bytes], out: Sink) -> int:
    """Classify each ticket line of `source` and write its result to `out` in input order, as they come
    (see the module's docstring for the bounds)."""
    console = Console(stderr=True, soft_wrap=True)  # one line per message, whatever the width
    limit = settings.pipeline.max_value_bytes
    reader = LineReader(stream_lines(source, limit), name)
    with contextlib.closing(reader):
        redactor = settings.privacy.log_redactor()
        before = collections.Counter[str]()

        def skipped(line: int, error_type: str, message: str) -> None:
            # The message quotes the line's own text: print it as is, never as rich markup.
            console.print(
                f"{name}:{line + 1}: skipped, not a TicketEvent: {error_type}: {redactor.redact(message)}",
                markup=False,
                highlight=False,
            )

        def readable(line: Line) -> bool:
            problem = _problem(line, limit)
            if problem is not None:
                before[problem[0]] += 1
                skipped(line[0], *problem)
            return problem is None

        if not reader.first(readable):
            # Before the pool starts: loading the model for nothing would only hide the problem for a while.
            total = sum(before.values())
            detail = f"{total} line(s) rejected ({_why(before)})" if total else "the file has no lines"
            raise UserError(f"{name}: no ticket to classify: {detail}")
        progress = Progress(
            TextColumn("classifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        with progress:
            task = progress.add_task("classify", total=None)

            def result(_line: int, value: bytes) -> None:
                out.write(value + b"\n")
                out.flush()  # a reader sees each result once it is known, whatever the buffering
                progress.advance(task)

            run = classify_lines(settings, reader, result, skipped)
            run.skipped.update(before)
            progress.update(task, total=run.written)
    rate = run.written / run.seconds if run.seconds > 0 else 0.0
    summary = ", ".join(f"{reason}={count}" for reason, count in sorted(run.fallbacks.items())) or "none"
    bad_lines = sum(run.skipped.values())
    bad = f"{bad_lines} ({_why(run.skipped)}), exit code {EXIT_LINES_SKIPPED}" if bad_lines else "0"
    console.print(
        f"classified {run.written} tickets in {run.seconds:.1f} s ({rate:.1f} tickets/s); "
        f"fallbacks: {summary}; bad lines skipped: {bad}",
        markup=False,
        highlight=False,
    )
    return EXIT_LINES_SKIPPED if run.skipped else 0


def _problem(line: Line, limit: int) -> tuple[str, str] | None:
    """Why a line is not a ticket (its dead letter's type and message), or None: it is one."""
    _, value, unread = line
    if unread is not None:
        return unread
    try:
        decode_ticket(value, limit)
    except DecodeError as error:
        return error.error_type, error.message
    return None


def _why(skipped: collections.Counter[str]) -> str:
    """`empty_ticket 2, invalid_utf8 1`: the skipped lines by reason, most frequent first."""
    return ", ".join(f"{kind} {count}" for kind, count in skipped.most_common())


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


class _DeferredOutput:
    """An `--output` file opened before any work and emptied by the first write only (a regular file's old
    content is kept until a result replaces it; a FIFO or a device is written as it is)."""

    def __init__(self, handle: IO[bytes], regular: bool) -> None:
        self._handle = handle
        self._regular = regular
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            if self._regular:
                self._handle.truncate(0)

    def write(self, data: bytes, /) -> int:
        self.start()
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


@contextlib.contextmanager
def _open_output(output: Path | None, source: IO[bytes] | None) -> Iterator[Sink]:
    """The output, opened before any work, so that a path that cannot be written fails at once, but emptied
    only by the first result (see the module's docstring); refused when it is the input file itself (by
    any name: a symlink, a hard link, or stdout redirected to it), which writing would destroy while it is
    read."""
    if output is None or output == STANDARD_STREAM:
        if source is not None:
            with contextlib.suppress(OSError, ValueError):  # no file behind stdout (a test's capture)
                _refuse_same_file(source, os.fstat(sys.stdout.buffer.fileno()), "stdout")
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    created = False
    try:
        try:
            fd = os.open(output, os.O_WRONLY | os.O_CLOEXEC)  # no O_TRUNC: see _DeferredOutput
        except FileNotFoundError:
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
            created = True
    except OSError as error:
        raise UserError(f"cannot write {output}: {error.strerror or error}") from None
    handle = os.fdopen(fd, "wb")
    with handle:
        opened = os.fstat(fd)
        sink: _DeferredOutput | None = None
        try:
            if source is not None:
                _refuse_same_file(source, opened, str(output))
            sink = _DeferredOutput(handle, stat.S_ISREG(opened.st_mode))
            yield sink
        except BaseException:  # refused (or interrupted) before a result: as it was, or gone if it was not
            if created and (sink is None or not sink.started):
                _remove_if_still(output, opened)
            raise
        sink.start()  # a run that wrote nothing still leaves its (empty) output, as it ran


def _remove_if_still(output: Path, opened: os.stat_result) -> None:
    """Remove the file a refused run created, if the path still names it (and not through a symlink)."""
    with contextlib.suppress(OSError):
        now = output.lstat()
        if stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
            output.unlink()


def _refuse_same_file(source: IO[bytes], target: os.stat_result, what: str) -> None:
    read = os.fstat(source.fileno())
    if stat.S_ISREG(target.st_mode) and (read.st_dev, read.st_ino) == (target.st_dev, target.st_ino):
        raise UserError(
            f"classify: the output ({what}) is the input file itself; writing it would destroy the tickets "
            "while they are read: write the results to another file"
        )
