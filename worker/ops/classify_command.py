"""`triage-worker classify`: classify one ticket text, or a JSONL file of TicketEvents, without Kafka.

Prints TriageResult JSON lines, exactly what the worker would publish (source topic `cli`, partition 0,
offset = the ticket's line index), so a model or taxonomy can be tried and compared offline. The cascade
runs as in the worker (`inference.escalation`): an unsure first answer goes to the escalation stage when the
ticket's deadline leaves time; offline nothing else competes for the cores, so the first stage is never
under pressure and the stage's own bound is the file's size.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from worker.classification import Classification, ClassifyRequest, ticket_text
from worker.config import Settings, add_config_argument, settings_from_args
from worker.decoding import DecodeError, decode_ticket, has_text
from worker.errors import UserError
from worker.inference.engine import Engine
from worker.inference.escalation import choose_escalation
from worker.inference.loading import resolve_taxonomy
from worker.inference.pairing import warn_once_if_unpaired
from worker.inference.pool import ClassifierPool, open_pool
from worker.inference.taxonomy import Taxonomy
from worker.logs import configure_logging
from worker.messages import SourcePosition, TicketEvent, TriageResult
from worker.ops.arguments import checked_argument_text
from worker.ops.artifacts import fetch_stage_files
from worker.ops.run_command import start_cascade
from worker.pipeline.cascade import Cascade, first_standing, is_unsure
from worker.pipeline.records import encode_result, triage_result

SOURCE_TOPIC = "cli"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "classify",
        help="classify a ticket text or a JSONL file of tickets with the local model (no Kafka)",
        description="Print one TriageResult JSON line per ticket.",
    )
    parser.add_argument("text", nargs="?", help="ticket text (omit when using --input)")
    parser.add_argument("--input", type=Path, metavar="FILE", help="JSONL file of TicketEvent objects")
    parser.add_argument("--output", type=Path, metavar="FILE", help="write results here (default: stdout)")
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
    configure_logging(settings.log)
    if args.text is not None:
        return _classify_text(settings, args.text, args.output)
    return _classify_file(settings, args.input, args.output)


def _classify_text(settings: Settings, text: str, output: Path | None) -> int:
    """One ticket: an in-process context (starting worker processes would cost more than the ticket)."""
    event = TicketEvent(ticket_id="cli-0", body=checked_argument_text(text, "the ticket text"))
    if not has_text(event):
        raise UserError("classify: the ticket text is empty; there is nothing to classify")
    engine = Engine(settings.inference)
    warn_once_if_unpaired(settings.inference, engine.taxonomy, engine.taxonomy_path)
    context = engine.new_context()
    request = ClassifyRequest(0, text, time.monotonic() + settings.pipeline.deadline_ms / 1000.0)
    answers: Iterator[tuple[int, Classification]] = iter([(0, context.classify(request))])
    with contextlib.ExitStack() as stack:
        stage = _escalation_stage(settings, engine.taxonomy, engine.taxonomy_path, stack, window=1)
        if stage is not None:
            answers = _cascaded(answers, {0: request}, settings.inference.escalate_below, stage)
        ((_, answer),) = answers
    with _open_output(output) as out:
        out.write(encode_result(triage_result(event, answer, _source(0))) + b"\n")
    return 0


def _classify_file(settings: Settings, path: Path, output: Path | None) -> int:
    console = Console(stderr=True, soft_wrap=True)  # one line per message, whatever the width
    events, rejected = _read_events(path, console, settings.pipeline.max_value_bytes)
    bad = sum(rejected.values())
    if not events:
        # Before the pool starts: loading the model for nothing would only hide the problem for a while.
        why = ", ".join(f"{kind} {count}" for kind, count in rejected.most_common())
        detail = f"{bad} line(s) rejected ({why})" if bad else "the file has no lines"
        raise UserError(f"{path}: no ticket to classify: {detail}")
    results: dict[int, TriageResult] = {}
    fallbacks: collections.Counter[str] = collections.Counter()
    taxonomy, taxonomy_path = resolve_taxonomy(settings.inference)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(open_pool(settings.inference, settings.log))
        started = time.monotonic()  # throughput of the model, not of loading it
        requests: dict[int, ClassifyRequest] = {}
        answers = _run(pool, settings, events, requests)
        # Offline the stage waits rather than sheds: its bound is the whole file.
        stage = _escalation_stage(settings, taxonomy, taxonomy_path, stack, window=len(events))
        if stage is not None:
            answers = _cascaded(answers, requests, settings.inference.escalate_below, stage)
        progress = Progress(
            TextColumn("classifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        with progress:
            task = progress.add_task("classify", total=len(events))
            for line, answer in answers:
                results[line] = triage_result(events[line], answer, _source(line))
                if answer.fallback_reason is not None:
                    fallbacks[answer.fallback_reason] += 1
                progress.advance(task)
    elapsed = time.monotonic() - started
    with _open_output(output) as out:
        for line in sorted(results):
            out.write(encode_result(results[line]) + b"\n")
    rate = len(results) / elapsed if elapsed > 0 else 0.0
    summary = ", ".join(f"{reason}={count}" for reason, count in sorted(fallbacks.items())) or "none"
    console.print(
        f"classified {len(results)} tickets in {elapsed:.1f} s ({rate:.1f} tickets/s); "
        f"fallbacks: {summary}; bad lines skipped: {bad}"
    )
    return 0


def _run(
    pool: ClassifierPool,
    settings: Settings,
    events: dict[int, TicketEvent],
    requests: dict[int, ClassifyRequest],
) -> Iterator[tuple[int, Classification]]:
    """Submit with a small in-flight window so each ticket's deadline starts when it is sent, not when the
    file was read (each request kept in `requests`); yield results as they complete."""
    window = max(2, 2 * pool.size)
    pending = collections.deque(sorted(events))
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < window:
            line = pending.popleft()
            deadline = time.monotonic() + settings.pipeline.deadline_ms / 1000.0
            requests[line] = ClassifyRequest(line, ticket_text(events[line]), deadline)
            pool.submit(requests[line])
            in_flight += 1
        for line, answer in pool.poll(0.1):
            in_flight -= 1
            yield line, answer


def _escalation_stage(
    settings: Settings, taxonomy: Taxonomy, taxonomy_path: Path, stack: contextlib.ExitStack, window: int
) -> Callable[[], Cascade] | None:
    """Starts the cascade's escalation stage (closed with `stack`) when called; None when there is no
    cascade. Started on the first unsure answer only: most tickets need none."""
    escalation = choose_escalation(settings.inference, taxonomy, taxonomy_path).settings
    if escalation is None:
        return None

    def start() -> Cascade:
        fetch_stage_files(escalation, lambda line: print(line, file=sys.stderr))
        pool = stack.enter_context(open_pool(escalation, settings.log))
        return start_cascade(settings, escalation, pool, taxonomy, first_contexts=1, window=window)

    return start


def _cascaded(
    firsts: Iterator[tuple[int, Classification]],
    requests: Mapping[int, ClassifyRequest],
    escalate_below: float,
    start_stage: Callable[[], Cascade],
) -> Iterator[tuple[int, Classification]]:
    """`firsts` through the cascade: an unsure answer goes to the escalation stage when its ticket's time
    left allows (the gate, as in the worker), and its line's result is the stage's answer."""
    stage: Cascade | None = None
    waiting: dict[int, Classification] = {}
    for line, first in firsts:
        if not is_unsure(first, escalate_below):
            yield line, first_standing(first)
        else:
            stage = stage or start_stage()
            now = time.monotonic()
            skipped = stage.gate(requests[line].deadline - now, now, first_stage_pressed=False)
            if skipped is None:
                stage.submit(requests[line], now)
                waiting[line] = first
            else:
                yield line, stage.first_stands(first, skipped)
        if stage is not None:
            yield from _second_answers(stage, waiting, 0.0)
    while stage is not None and waiting:
        yield from _second_answers(stage, waiting, 0.5)


def _second_answers(
    stage: Cascade, waiting: dict[int, Classification], timeout: float
) -> Iterator[tuple[int, Classification]]:
    for line, second in stage.poll(timeout, time.monotonic):
        yield line, stage.escalated(waiting.pop(line), second)


def _read_events(
    path: Path, console: Console, max_value_bytes: int
) -> tuple[dict[int, TicketEvent], collections.Counter[str]]:
    """Line index → event for every valid line, and the bad lines by reason (each reported with its line
    number and skipped, so one bad line does not cost the whole file). Lines are decoded exactly as the
    worker decodes record values, so a line is skipped here for the reason it would be dead-lettered."""
    events: dict[int, TicketEvent] = {}
    bad: collections.Counter[str] = collections.Counter()
    try:
        handle = path.open("rb")
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    with handle:
        for index, raw in enumerate(handle):
            if not raw.strip():
                continue
            try:
                events[index] = decode_ticket(raw, max_value_bytes)
            except DecodeError as error:
                bad[error.error_type] += 1
                # The message quotes the line's own text: print it as is, never as rich markup.
                console.print(
                    f"{path}:{index + 1}: skipped, not a TicketEvent: {error}", markup=False, highlight=False
                )
    return events, bad


def _source(line: int) -> SourcePosition:
    return SourcePosition(topic=SOURCE_TOPIC, partition=0, offset=line)


@contextlib.contextmanager
def _open_output(output: Path | None) -> Iterator[IO[bytes]]:
    if output is None:
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    try:
        handle = output.open("wb")
    except OSError as error:
        raise UserError(f"cannot write {output}: {error.strerror or error}") from None
    with handle:
        yield handle
