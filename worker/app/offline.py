"""The offline doors: `classify` (a ticket text, or a JSONL stream) and `model eval`, on the one loop.

A line of input is a record (`sources/lines.py`), the triage stage classifies it exactly as the worker
would — its cascade included — and each line's triage record or dead letter is handed over in input order
(`settlements/in_order.py`). What differs from `run` is only what a door must: no Kafka, reading paced by the
model so that each ticket's deadline starts when it is sent, and the escalation stage opened on the first
unsure answer (`LazyPool`: most tickets need none, and it takes seconds to open).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from worker.app.doors import TriageParts, limits, triage_stage
from worker.app.stages import dispatch_window
from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.errors import UserError
from worker.inference.escalation import choose_escalation, escalation_threshold
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import ClassifierPool, open_pool
from worker.inference.taxonomy import Taxonomy
from worker.kafka.dead_letters import read_dead_letter
from worker.messages import TicketEvent, TriageResult
from worker.pipeline.engine import Engine, GiveUpAt
from worker.pipeline.failure import Failure
from worker.pipeline.settlements.in_order import Deliver, InOrder
from worker.pipeline.sources.lines import LineReader, LinesSource
from worker.pipeline.triage.cascade import Cascade
from worker.pipeline.triage.dispatch_queue import DispatchQueue
from worker.pipeline.triage.requests import ModelRequests
from worker.pipeline.work import Output, Work
from worker.settings import ESCALATION_AUTO, InferenceSettings, Settings
from worker.telemetry.tracing import tracing_for

# Lines read and not yet written (at the model, at the escalation stage, or waiting for an earlier line to be
# written first): the memory bound of a stream, and the escalation stage's window, so that it never sheds.
HELD_LINES = 64
_RESULTS = msgspec.json.Decoder(TriageResult)


class LazyPool:
    """A classifier pool opened by `open_pool` on the first request sent to it (see the module docstring)."""

    def __init__(self, open_pool: Callable[[], ClassifierPool]) -> None:
        self._open = open_pool
        self._pool: ClassifierPool | None = None

    @property
    def opened(self) -> ClassifierPool:
        if self._pool is None:
            self._pool = self._open()
        return self._pool

    @property
    def model_id(self) -> str:
        return self.opened.model_id

    def submit(self, request: ClassifyRequest) -> None:
        self.opened.submit(request)

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        if self._pool is None:
            time.sleep(timeout)  # nothing was sent to it: nothing can come back
            return []
        return self._pool.poll(timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


@dataclass
class Offline:
    """An offline door's model side: the first stage's pool, the cascade over a lazily opened escalation
    stage (None: no cascade for this taxonomy), the taxonomy's fallback."""

    pool: ClassifierPool
    cascade: Cascade | None
    fallback: FallbackLabel


@contextlib.contextmanager
def offline_stages(
    settings: Settings,
    inference: InferenceSettings | None = None,
    *,
    resolved: tuple[Taxonomy, Path] | None = None,
    cascade: bool = True,
    escalation: InferenceSettings | None = None,
    escalate_below: float | None = None,
    echo: Callable[[str], None] = print,
    announce: bool = True,
) -> Iterator[Offline]:
    """The pools an offline door classifies with, closed on exit: `inference` (default: the settings') as the
    first stage, and, unless `cascade` is False, the cascade as `run` would have it — or over `escalation`
    with `escalate_below` when given (model eval measures thresholds). `announce`: log the pools' start.
    `resolved`: the first stage's taxonomy and its file as the caller resolved them (a command that reads its
    examples with them), else resolved here; both stages take this one value."""
    inference = inference or settings.inference
    taxonomy, taxonomy_path = resolved or resolve_taxonomy(inference)
    if not cascade:
        escalation = None
    elif escalation is None:
        choice = choose_escalation(inference, taxonomy, taxonomy_path)
        # "auto" standing aside for a taxonomy its stage was not trained for is the expected quiet case (a
        # test model, a team's own taxonomy); any other reason is news to the user.
        quiet = inference.escalation == ESCALATION_AUTO and "intents, not the" in (choice.why_off or "")
        if choice.why_off is not None and not quiet:
            echo(f"running without the cascade: {choice.why_off}")
        escalation = choice.settings
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(
            open_pool(inference, taxonomy, taxonomy_path, settings.log, settings.privacy, announce=announce)
        )
        over: Cascade | None = None
        if escalation is not None:
            # The stage answers with the first stage's taxonomy: the one value resolved above.
            stage = LazyPool(
                lambda: _open_stage(settings, escalation, taxonomy, taxonomy_path, echo, announce)
            )
            stack.callback(stage.close)
            over = _offline_cascade(inference, stage, pool.size, taxonomy, escalate_below)
        yield Offline(pool, over, taxonomy.fallback_label)


def _open_stage(
    settings: Settings,
    escalation: InferenceSettings,
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    echo: Callable[[str], None],
    announce: bool,
) -> ClassifierPool:
    # Nothing fetched (see worker/app/stages.py's open_cascade): a missing encoder ran no cascade.
    return open_pool(escalation, taxonomy, taxonomy_path, settings.log, settings.privacy, announce=announce)


def _offline_cascade(
    inference: InferenceSettings,
    stage: LazyPool,
    first_contexts: int,
    taxonomy: Taxonomy,
    escalate_below: float | None,
) -> Cascade:
    """The cascade as `run` has it, but with no turnaround measured first (that would open the stage): offline
    nothing else competes, so the gate only asks for the ticket's time left; at most `HELD_LINES` at the
    stage, so it never sheds."""
    threshold = escalation_threshold(inference) if escalate_below is None else escalate_below
    return Cascade(stage, threshold, HELD_LINES, 0.0, first_contexts, taxonomy.labels)


def lines_pipeline(
    settings: Settings,
    offline: Offline,
    reader: LineReader,
    deliver: Deliver,
    clock: Callable[[], float] = time.monotonic,
) -> Engine:
    """The loop over `reader`'s lines, each line's outcome handed to `deliver` in input order; `clock` is the
    loop's and the stage's (a virtual one in tests/simulation)."""
    parts = TriageParts(
        offline.pool,
        offline.fallback,
        dispatch_window(settings),
        cascade=offline.cascade,
        tracing=tracing_for(settings.tracing, None),
    )
    # Offline the loop holds at most HELD_LINES lines, reads only when the model has room, and waits half a
    # second at most for a line; the rest is the settings' (`limits`).
    numbers = dataclasses.replace(
        limits(settings),
        max_in_flight=HELD_LINES,
        resume_below=HELD_LINES // 2,
        poll_timeout_s=0.5,
        paced_by_model=True,
    )
    metrics = parts.metrics(numbers.deadline_s)
    failure, give_up = Failure(), GiveUpAt()
    settlement = InOrder(deliver)
    source = LinesSource(reader, lambda: settlement.held)
    # Arrival order: offline every ticket has the same deadline, and results are written in input order.
    queue, requests = DispatchQueue("fifo"), ModelRequests()
    stage = triage_stage(settings, parts, queue, requests, settlement, source.hand_back, metrics, clock)
    return Engine(
        source,
        stage,
        settlement,
        numbers,
        metrics,
        failure,
        give_up,
        clock=clock,
        lifecycle_log=False,
        tracing=parts.tracing,
    )


def result_of(value: bytes | None) -> TriageResult:
    """A triage record as an offline door hands it over (JSON, `output.format` does not apply offline)."""
    return _RESULTS.decode(value or b"")


@dataclass
class LinesRun:
    """What an offline run did: triage records written, lines skipped (by their dead letter's type),
    fallbacks (by reason), the seconds from the first line to the last (pools' start excluded)."""

    written: int = 0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    fallbacks: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0


def classify_lines(
    settings: Settings,
    reader: LineReader,
    on_result: Callable[[int, bytes], None],
    on_skipped: Callable[[int, str, str], None],
    announce: bool = True,
) -> LinesRun:
    """Classify `reader`'s lines through the loop: each line's triage record (JSON) to `on_result(line,
    value)`, each line that is not a ticket to `on_skipped(line, error type, message)`, in input order."""
    run = LinesRun()

    def deliver(work: Work, output: Output) -> None:
        if output.topic == settings.topics.dead_letter:
            info = read_dead_letter(output.headers or [])
            run.skipped[info.error_type] += 1
            on_skipped(work.offset, info.error_type, info.error_message)
            return
        assert output.value is not None
        result = result_of(output.value)
        if result.fallback_reason is not None:
            run.fallbacks[result.fallback_reason] += 1
        run.written += 1
        on_result(work.offset, output.value)

    with offline_stages(settings, echo=_to_stderr, announce=announce) as offline:
        started = time.monotonic()
        code = lines_pipeline(settings, offline, reader, deliver).run()
        run.seconds = time.monotonic() - started
    if code != 0:
        raise UserError("classify: the run failed (see the log above)")
    return run


def classify_texts(
    settings: Settings, offline: Offline, texts: Sequence[str], progress: Callable[[], None] | None = None
) -> tuple[list[TriageResult | None], float]:
    """Each text as a ticket's body through the loop (`model eval`): its triage record, or None where the text
    is not a ticket (an empty one), in order; and the seconds they took (pools' start excluded)."""
    lines = (
        (index, msgspec.json.encode(TicketEvent(ticket_id=f"example-{index}", body=text)), None)
        for index, text in enumerate(texts)
    )
    results: list[TriageResult | None] = [None] * len(texts)

    def deliver(work: Work, output: Output) -> None:
        if output.topic != settings.topics.dead_letter:
            results[work.offset] = result_of(output.value)
        if progress is not None:
            progress()

    reader = LineReader(lines, "examples")
    started = time.monotonic()
    with contextlib.closing(reader):
        code = lines_pipeline(settings, offline, reader, deliver).run()
    if code != 0:
        raise UserError("the evaluation run failed (see the log above)")
    return results, time.monotonic() - started


def _to_stderr(line: str) -> None:
    """Where an offline door says what it fetches: stderr, since stdout carries its results."""
    print(line, file=sys.stderr)
