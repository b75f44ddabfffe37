"""The one loop: records from a source, each carried through a stage, each settled; every door rides it.

consume → decode → dispatch → classify → encode → produce → commit, on one thread. The three seams
(`seams.py`) say where records come from (`Source`), what happens to each (`Stage`) and how each is settled
(`Settlement`); the loop owns what every door shares, so that each door keeps every promise:

1. serves the settlement's delivery reports (a record is *done* only once its output was acknowledged), then
   the stage: the model's answers, expiry, dispatch, side topics;
2. advances the settlement (commits when due) and the source (start positions, locks, gauges), and the
   Schema Registry's wait (`registry_wait.py`): a record the registry cannot answer for is never taken
   — its source holds it back — and the registry is probed with it on a backoff until it answers;
3. counts the records in flight (from take until settled for good) against `max_in_flight`: at the bound it
   stops reading, and when the bound holds for longer (a slow model) it pauses the source, which keeps
   its member alive; it resumes below the low-water mark (`flow.py`);
4. reads records up to the free room and takes each: the stage admits it (a registry-format record is
   decoded here), the source starts carrying it, it gets its trace (`tracing.py`: a no-op unless the door
   was given a tracer), the settlement hears of it, the stage takes it on.

Partitions leaving in order (a consumer group's revoke) drain first: their records go before all others and
get up to the source's drain time to finish, then their progress is settled, so the next owner starts where
this worker stopped. Partitions lost, and records a source released (a share group's lock ending), are given
up: their later answers and reports are discarded.

Shutdown (`request_stop()`, or a failure): read nothing new, finish what was taken within
`shutdown_timeout_s`, let the settlement flush and settle, stop the source, close the side topics; the exit
code is 0, or 1 after a failure. A finite source (a file, a replay's range) ends the run once it is read and
every record is settled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from worker.decoding import RegistryUnavailable
from worker.errors import UserError
from worker.kafka.commits import TopicPartitionKey
from worker.messages import FallbackReason
from worker.pipeline.failure import Failure
from worker.pipeline.flow import Flow, InFlightGate
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.registry_wait import RegistryWait
from worker.pipeline.seams import Loop, Record, Settlement, Source, Stage
from worker.pipeline.tracing import NO_TRACING, Tracing
from worker.pipeline.work import Work

_log = structlog.get_logger("worker.pipeline")

# While work is in flight the loop waits at most this long on any one queue, so that delivery reports,
# commit confirmations and model answers are all picked up promptly.
BUSY_WAIT_S = 0.01
# How long the bound may hold before the source is paused. Shorter pauses cost more than they save:
# librdkafka refetches a resumed partition only about a second later. Longer delays rebalance callbacks.
_FULL_BEFORE_PAUSE_S = 0.5
# The longest background commits hold back reading in a row (see `_may_read`).
_COMMIT_BEFORE_READ_S = 1.0


class GiveUpAt:
    """While revoking or stopping: the instant (a clock value) a produce stops waiting for room in the
    client's queue; None otherwise. Set by the loop, read by its settlement."""

    def __init__(self) -> None:
        self.at: float | None = None

    def get(self) -> float | None:
        return self.at


@dataclass(frozen=True)
class Limits:
    """The loop's numbers: the in-flight bound and its low-water mark, each record's deadline, how long the
    first read waits when nothing is in flight, how long a shutdown may take, and whether reading waits for
    room at the model; and the longest time between commits, which the loop's settlement keeps (a door with
    nothing to commit ignores it). `worker.app.doors.limits` builds them from the settings, units converted
    there once; a door changes what is its own with `dataclasses.replace`."""

    max_in_flight: int
    resume_below: int
    deadline_s: float
    poll_timeout_s: float
    shutdown_timeout_s: float
    commit_interval_s: float
    # The most records read in one turn of the loop (`pipeline.poll_batch_size`), before it serves answers.
    read_batch: int = 100
    # Read a record only when the stage has room for it at once (offline doors: each ticket's deadline
    # starts when it is sent, since nothing else competes for the model).
    paced_by_model: bool = False


class Engine(Loop):
    """Runs the loop until `request_stop()`, a failure, or the end of a finite source; `run()` returns the
    exit code. `failure` is shared with the source and the settlement (why the run must end); `registry`
    is the Schema Registry's wait (None: the input needs no registry); `tracing` gives each taken record its
    trace (`tracing.py`; off by default)."""

    def __init__(
        self,
        source: Source,
        stage: Stage[Any],
        settlement: Settlement,
        limits: Limits,
        metrics: PipelineMetrics,
        failure: Failure,
        give_up: GiveUpAt,
        registry: RegistryWait | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_interval_s: float = 10.0,
        started_line: dict[str, object] | None = None,
        lifecycle_log: bool = True,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self._source, self._stage, self._settlement = source, stage, settlement
        self._limits = limits
        self.metrics = metrics
        self._failure = failure
        self._give_up_at = give_up
        self._registry = registry
        self._clock = clock
        self._metrics_interval_s = metrics_interval_s
        self._started_line = started_line or {}
        # The start, metrics and stop lines (offline doors report on the console instead).
        self._lifecycle_log = lifecycle_log
        self._tracing = tracing
        self._gate = InFlightGate(limits.max_in_flight, limits.resume_below, _FULL_BEFORE_PAUSE_S)
        self._stopping = False
        self._stop_by: float | None = None
        now = clock()
        self._last_read = now
        self._last_metrics = now

    # -- public ---------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a graceful shutdown at the next turn of the loop (safe from a signal handler)."""
        self._stopping = True

    def run(self) -> int:
        try:
            self._settlement.start()
            self._source.open(self)
        except UserError:
            self._source.stop(self._clock())
            raise
        if self._lifecycle_log:  # not `_announce`: described() may ask a lazily opened stage for its id
            _log.info(
                "pipeline_started",
                **self._started_line,
                max_in_flight=self._limits.max_in_flight,
                resume_below=self._limits.resume_below,
                deadline_ms=round(self._limits.deadline_s * 1000),
                **self._source.described(),
                **self._stage.described(),
            )
        try:
            while not self._stopping and self._failure.reason is None and not self._finished():
                self._turn()
        except UserError:
            self._source.stop(self._clock())
            raise
        return self._shutdown()

    # -- the loop -------------------------------------------------------------------------------------------

    def _turn(self) -> None:
        self._service(wait_s=0.0)
        busy = self._stage.busy
        if self._may_read():
            idle = not busy and self._in_flight() == 0
            wait_s = self._limits.poll_timeout_s if idle else BUSY_WAIT_S
            self._last_read = self._clock()
            room = min(self._gate.capacity(), self._limits.read_batch)
            if self._limits.paced_by_model:
                room = min(room, self._stage.room())
            if room > 0 or not self._limits.paced_by_model:
                self._read(max(1, room), 0.0 if busy else wait_s)
        elif not busy:
            self._settlement.wait(BUSY_WAIT_S)
        if busy:
            self._stage.serve(BUSY_WAIT_S)
        self._tick()

    def _tick(self) -> None:
        now = self.metrics.loop_turned_at = self._clock()
        if self._lifecycle_log and now - self._last_metrics >= self._metrics_interval_s:
            self._log_metrics("interval")

    def _finished(self) -> bool:
        """A finite source read to its end, with every record settled."""
        return self._source.exhausted and self._in_flight() == 0 and not self._stage.busy

    def _may_read(self) -> bool:
        """Read when the bound and the source allow it and, where a read may run a rebalance callback, no
        background commit is on its way: a commit from another thread waiting for the callback could land
        after the revoke's own and move the position back. Never held back longer than
        `_COMMIT_BEFORE_READ_S` (keeps the member alive)."""
        committing = self._source.rebalances and self._settlement.committing
        settled = not committing or self._clock() - self._last_read >= _COMMIT_BEFORE_READ_S
        return settled and self._gate.may_poll() and self._source.may_take()

    def _service(self, wait_s: float) -> None:
        """Everything but reading: the records' progress, commits, the registry's wait, flow control."""
        self._serve_work(wait_s)
        self._settlement.advance()
        self._source.maintain(self._clock())
        if self._registry is not None:
            self._probe_registry()
        self._update_gauge()

    def _serve_work(self, wait_s: float) -> None:
        """Move taken records forward: delivery reports, then the stage (answers, expiry, dispatch). Waits up
        to `wait_s` for an answer, or for a report when nothing is at a model."""
        if self._stage.busy:
            self._settlement.serve(0)
            self._stage.serve(wait_s)
        else:
            self._settlement.serve(wait_s)
            self._stage.serve(0)

    def _read(self, room: int, wait_s: float) -> None:
        self._source.read(room, wait_s, self._take)
        self._update_gauge()

    def _take(self, record: Record) -> None:
        now = self._clock()
        admission = self._stage.admit(record)
        if admission.unavailable is not None and self._hold(record, admission.unavailable):
            return  # not taken: its source offers it again once the registry answers
        work = self._source.work(record, now, now + self._limits.deadline_s)
        if work is None:
            return
        work.trace = self._tracing.ticket(work)
        self.metrics.consumed += 1
        self._settlement.taken(work)
        if admission.unavailable is not None:
            self._stage.cannot_hold(work, admission.unavailable)
            return
        self._stage.take(work, record, admission)

    # -- the Schema Registry's wait (the same for every source) ------------------------------------------

    def _hold(self, record: Record, unavailable: RegistryUnavailable) -> bool:
        """A record the registry cannot answer for: held back by its source (False: it cannot be, it is taken
        and answered otherwise)."""
        assert self._registry is not None  # only a registry-aware stage says `unavailable`
        if not self._source.hold_back(record):
            return False
        self._registry.hold(record, unavailable)
        return True

    def _probe_registry(self) -> None:
        """Each held partition, when its retry is due, is probed with the record it is held at: still
        unavailable, it waits longer (its source holds it, nothing is read again); answered, its source offers
        its records again."""
        assert self._registry is not None
        for probe in self._registry.due(self._clock()):
            admission = self._stage.admit(probe)
            if admission.unavailable is not None:
                self._registry.hold(probe, admission.unavailable)
            else:
                self._registry.answered(probe.partition_key)
                self._source.resume(probe.partition_key)

    # -- flow control ---------------------------------------------------------------------------------------

    def _in_flight(self) -> int:
        """Records taken and not settled for good, and records of partitions given up that are still at a
        model or awaiting a report (orphans)."""
        return self._source.in_flight() + self._stage.orphans + self._settlement.orphans

    def _update_gauge(self) -> None:
        flow = self._gate.update(self._in_flight(), self._clock())
        self.metrics.in_flight = self._gate.in_flight
        self.metrics.in_flight_max = self._gate.max_seen
        self.metrics.paused = self._gate.paused
        if flow is Flow.PAUSE:
            self._source.pause_all()
        elif flow is Flow.RESUME and not self._stopping:
            self._source.resume_all()
        if flow is not Flow.KEEP:
            _log.debug(flow.value, in_flight=self._gate.in_flight)

    # -- what a source tells the loop (seams.Loop) --------------------------------------------------------

    @property
    def holding_back(self) -> bool:
        return self._gate.paused or self._stopping

    def assigned(self, keys: Sequence[TopicPartitionKey]) -> None:
        if self._registry is not None:
            self._registry.forget(keys)
        self._settlement.assigned(keys)

    def revoking(self, keys: set[TopicPartitionKey], drain_s: float) -> int:
        self.metrics.revoked += len(keys)
        limit = self._clock() + drain_s
        if self._stop_by is not None:
            limit = min(limit, self._stop_by)
        self._settlement.settle(limit)
        # Their records go to the model first. They must finish, not be dropped: outputs of later offsets may
        # already be written, and the new owner would write them again.
        self._stage.first(keys)
        self._give_up_at.at = limit

        def pending() -> int:
            return self._stage.pending(keys) + self._settlement.pending(keys)

        # Not while outputs no longer go out (a doomed exactly-once transaction): waiting is pointless.
        while pending() and self._settlement.producing and self._clock() < limit:
            self._serve_work(BUSY_WAIT_S)
        self._give_up_at.at = self._stop_by
        left = pending()
        # Records that did not make it are left to the new owner; those at a model or awaiting a report are
        # still counted (orphans) until their answer or report arrives.
        self._give_up(keys)
        self._settlement.commit_now(keys, limit)
        if self._registry is not None:
            self._registry.forget(keys)
        return left

    def lost(self, keys: set[TopicPartitionKey]) -> None:
        self.metrics.lost += len(keys)
        self._settlement.lost(keys)
        self._give_up(keys)
        if self._registry is not None:
            self._registry.forget(keys)

    def abandon(self, works: Collection[Work], why: str) -> None:
        keys = {work.partition_key for work in works}
        self._stage.give_up(keys)
        self._settlement.abandon(works)
        _log.info("records_released", count=len(works), reason=why)

    @property
    def stop_by(self) -> float | None:
        return self._stop_by

    def take(self, record: Record) -> None:
        self._take(record)
        self._update_gauge()

    def answer_now(self, works: Collection[Work], reason: FallbackReason) -> None:
        self._stage.answer_now(works, reason)

    def _give_up(self, keys: set[TopicPartitionKey]) -> None:
        self._stage.give_up(keys)
        self._settlement.give_up(keys)

    # -- shutdown -------------------------------------------------------------------------------------------

    def _shutdown(self) -> int:
        started = self._clock()
        limit = started + self._limits.shutdown_timeout_s
        self._stop_by = self._give_up_at.at = limit
        self._stopping = True
        reason = self._failure.reason or ("end of input" if self._source.exhausted else "signal")
        self._announce("pipeline_stopping", in_flight=self._gate.in_flight, reason=reason)
        # Read nothing new, but keep the member alive while the taken records finish.
        self._source.stop_taking()
        while (
            (len(self._stage) or self._settlement.outstanding)
            and self._clock() < limit
            and self._failure.reason is None
        ):
            self._service(wait_s=BUSY_WAIT_S)
            if self._may_read():
                self._last_read = self._clock()
                self._source.poll_while_stopping()
        unfinished = len(self._stage)
        not_flushed = self._settlement.stop(limit)
        self._source.stop(limit)
        self._stage.close(max(0.0, limit - self._clock()))  # after the last commit: side topics hold none
        self._tracing.close(max(0.0, limit - self._clock()))
        if self._lifecycle_log:
            self._log_metrics("final")
        if self._failure.reason is not None:
            _log.error("pipeline_failed", reason=self._failure.reason)
            return 1
        self._announce(
            "pipeline_stopped",
            unfinished=unfinished,
            not_flushed=not_flushed,
            took_ms=round((self._clock() - started) * 1000.0),
        )
        return 0

    # -- metrics --------------------------------------------------------------------------------------------

    def _announce(self, event: str, **fields: object) -> None:
        if self._lifecycle_log:
            _log.info(event, **fields)

    def _log_metrics(self, kind: str) -> None:
        self._last_metrics = self._clock()
        waiting, at_model, escalated = self._stage.where()
        at_producer, held = self._settlement.where()
        # Where the in-flight records are: waiting, at the model, at the producer, held for order; orphans;
        # escalated (last, so that readers of the first five keep their meaning).
        orphans = self._stage.orphans + self._settlement.orphans
        where = [waiting, at_model, at_producer, held, orphans, escalated]
        _log.info(
            "metrics", kind=kind, **self._source.logged(), in_flight_at=where, **self.metrics.snapshot()
        )
