"""Classifier pools: where the contexts run, so that the consumer's poll loop is never starved.

ORT GenAI holds the GIL inside `append_tokens` and `generate_next_token` (measured), so a context running in
a thread of the consumer's process freezes that process's other threads for the whole prefill: Kafka
polling, heartbeats, metrics. Hence the pool kinds:

- `process` (default on CPU): N worker processes, each with its own model and one prefix-prefilled context;
  requests and results travel as msgpack over pipes. Processes also scale with the cores (1.75x on 2 cores,
  measured), where threads do not. The parent only waits on pipes, so its poll loop stays responsive.
- `thread`: N contexts in threads of this process, sharing one model; cheap to start, but starves the
  caller's threads (see the bench) — for tools and tests, not for the consumer.
- `batch` (default on GPU): one worker process that runs `generate` requests in static batches of up to
  `batch_size` (a GPU's throughput comes from batching, not from more contexts, measured). `score` requests
  go through its prefix context one by one: ORT GenAI refuses `rewind_to` to a non-zero length when
  batch_size > 1, so a batched label continuation would need a full re-prefill per label.

All pools answer every submitted request exactly once: a worker process that dies is restarted and its
in-flight requests are answered with `model_error`, marked `process_died` (queue mode gives those another
try; a `model_error` the engine itself answered, when the model raised, is not marked); a request that is
already past its deadline when its turn comes is answered `overloaded` without running.
"""

from __future__ import annotations

import abc
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType

import msgspec
import structlog

from worker.classification import Classification, ClassifyRequest, fallback_answer
from worker.errors import UserError
from worker.inference.candidates import CandidatesContext, CandidatesEngine
from worker.inference.encoder import EncoderContext, EncoderEngine, serves_encoder_stage
from worker.inference.engine import Context, GenAIEngine
from worker.inference.genai import require_runtime
from worker.inference.pairing import warn_once_if_unpaired
from worker.inference.prompt import max_ticket_chars
from worker.inference.taxonomy import Taxonomy
from worker.settings import InferenceSettings, LogSettings, PoolKind, PrivacySettings

log = structlog.get_logger(__name__)

Result = tuple[int, Classification]
_WARM_TICKET = "Warm-up ticket: where is my card? It has not arrived yet."
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 5.0


class _Ready(msgspec.Struct, tag="ready", array_like=True):
    model_id: str


class _Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class _Done(msgspec.Struct, tag="done", array_like=True):
    request_id: int
    result: Classification


_Reply = _Ready | _Failed | _Done
_ENCODER = msgspec.msgpack.Encoder()
_REPLY_DECODER = msgspec.msgpack.Decoder(_Reply)
_REQUEST_DECODER = msgspec.msgpack.Decoder(ClassifyRequest)


def open_engine(
    settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path
) -> GenAIEngine | EncoderEngine | CandidatesEngine:
    """The engine for the folder in `settings.model`: an encoder stage (it has `encoder.json`, see
    worker/inference/encoder.py; or a `model train` folder with only its encoder stage, `encoder_stage_only`),
    with an LLM deciding among its top candidates when the settings are a stage's with one
    (worker/inference/candidates.py), or an ORT GenAI model, with the resolved `taxonomy` from
    `taxonomy_path`."""
    if settings.candidates_llm_settings() is not None:
        return CandidatesEngine(settings, taxonomy, taxonomy_path)
    if serves_encoder_stage(Path(settings.model).expanduser()):
        return EncoderEngine(settings, taxonomy, taxonomy_path)
    return GenAIEngine(settings, taxonomy, taxonomy_path)


def default_pool_kind(settings: InferenceSettings) -> PoolKind:
    """CPU: processes (they scale with cores and keep the GIL away from the consumer); GPU: batching."""
    if settings.pool is not None:
        return settings.pool
    return "process" if settings.provider == "cpu" else "batch"


def default_pool_size(settings: InferenceSettings, kind: PoolKind) -> int:
    """One context per core on CPU (more only adds contention, measured); one batching worker on GPU."""
    if settings.pool_size is not None:
        return settings.pool_size
    if kind == "batch":
        return 1
    return max(1, (os.cpu_count() or 1) // settings.intra_op_num_threads)


class ClassifierPool(abc.ABC):
    """Pre-warmed contexts behind a non-blocking submit / poll interface (the caller bounds in-flight)."""

    model_id: str
    size: int  # contexts (or batching workers) answering in parallel

    @abc.abstractmethod
    def submit(self, request: ClassifyRequest) -> None:
        """Queue a request; never blocks on the model."""

    @abc.abstractmethod
    def poll(self, timeout: float) -> list[Result]:
        """Completed results, waiting at most `timeout` seconds for the first one."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the workers (idempotent); requests still in flight are not answered."""

    def worker_pids(self) -> list[int]:
        """The process id of each context's worker process, in context order; none when the contexts run
        in this process (their cost is this process's own)."""
        return []

    def __enter__(self) -> ClassifierPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def open_pool(
    settings: InferenceSettings,
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    log_settings: LogSettings | None = None,
    privacy: PrivacySettings | None = None,
    initializer: Callable[[], None] | None = None,
    announce: bool = True,
) -> ClassifierPool:
    """Start the configured pool and return once every context is loaded and warmed (progress is logged,
    unless `announce` is False: `classify` of one ticket prints its result alone). A process pool's
    processes log with `log_settings`, redacted as `privacy` says (the logs' phone region).

    `taxonomy` from `taxonomy_path`: the model's, resolved once where the model is assembled
    (`worker.inference.loading.resolve_taxonomy`); every context, and the fallbacks of a dead worker's
    requests, use this one value. Checked against the model here (`taxonomy_mark`: a UserError in score mode
    when the model was not trained for its labels, a warning once in generate mode).

    `initializer` (picklable) runs first in each worker process of a process or batch pool (see
    `ProcessPool`); a thread pool has none to run it in."""
    require_runtime()  # here, not in each of the pool's processes
    kind = default_pool_kind(settings)
    size = default_pool_size(settings, kind)
    warn_once_if_unpaired(settings, taxonomy, taxonomy_path)
    if announce:
        log.info("starting classifier pool", pool=kind, size=size, model=settings.model, mode=settings.mode)
    started = time.monotonic()
    pool: ClassifierPool
    if kind == "thread":
        pool = ThreadPool(settings, taxonomy, taxonomy_path, size)
    else:
        pool = ProcessPool(
            settings,
            taxonomy,
            taxonomy_path,
            size,
            batch=kind == "batch",
            log_settings=log_settings,
            privacy=privacy,
            initializer=initializer,
        )
    if announce:
        log.info("classifier pool ready", model=pool.model_id, seconds=round(time.monotonic() - started, 2))
    return pool


def measure_turnaround(pool: ClassifierPool, samples: int = 8, timeout_s: float = 60.0) -> float:
    """Seconds from submit to answer of the slowest of `samples` warm-up tickets sent one at a time to an
    idle `pool` (with 8 samples, about a p95): a first estimate of its latency, before traffic gives one."""
    slowest = 0.0
    for index in range(samples):
        started = time.monotonic()
        pool.submit(ClassifyRequest(-1 - index, _WARM_TICKET, started + timeout_s))
        while not any(request_id == -1 - index for request_id, _ in pool.poll(0.5)):
            if time.monotonic() - started > timeout_s:
                raise UserError(f"{pool.model_id} did not answer a warm-up ticket within {timeout_s:.0f} s")
        slowest = max(slowest, time.monotonic() - started)
    return slowest


def _cut(request: ClassifyRequest, limit: int) -> ClassifyRequest:
    """Drop text the engine would cut anyway before it crosses a pipe, keeping one extra character so the
    engine still sees (and reports) that the ticket was truncated."""
    if len(request.text) <= limit:
        return request
    return ClassifyRequest(request.request_id, request.text[: limit + 1], request.deadline)


# -- threads ---------------------------------------------------------------------------------------------


class ThreadPool(ClassifierPool):
    """Contexts in threads of this process, sharing one model (see the module docstring for the cost)."""

    def __init__(
        self, settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path, size: int
    ) -> None:
        self._engine = open_engine(settings, taxonomy, taxonomy_path)
        self.model_id = self._engine.model_id
        self.size = size
        self._requests: queue.SimpleQueue[ClassifyRequest | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        for index in range(size):
            context = self._engine.new_context()
            _warm(context)
            thread = threading.Thread(
                target=self._serve, args=(context,), name=f"classifier-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def submit(self, request: ClassifyRequest) -> None:
        self._requests.put(request)

    def poll(self, timeout: float) -> list[Result]:
        results: list[Result] = []
        try:
            results.append(self._results.get(timeout=max(0.0, timeout)))
            while True:
                results.append(self._results.get_nowait())
        except queue.Empty:
            return results

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._requests.put(None)
        for thread in self._threads:
            thread.join(_STOP_TIMEOUT_S)

    def _serve(self, context: Context | EncoderContext | CandidatesContext) -> None:
        while (request := self._requests.get()) is not None:
            self._results.put((request.request_id, context.classify(request)))


# -- processes -------------------------------------------------------------------------------------------


class _Worker:
    """One worker process, its pipe, the requests it has not answered yet and a feeder thread that writes
    to the pipe (a blocking write releases the GIL, so `submit` never waits for a busy worker)."""

    def __init__(self, process: BaseProcess, conn: multiprocessing.connection.Connection) -> None:
        self.process = process
        self.conn = conn
        self.in_flight: dict[int, tuple[ClassifyRequest, float]] = {}
        self.outbox: queue.SimpleQueue[ClassifyRequest | None] = queue.SimpleQueue()
        self.feeder = threading.Thread(target=self._feed, name=f"feeder-{process.pid}", daemon=True)

    def _feed(self) -> None:
        while (request := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(_ENCODER.encode(request))
            except (OSError, ValueError):
                return  # the worker died; poll() answers its in-flight requests


class ProcessPool(ClassifierPool):
    """Worker processes, each with its own model and context (or a batching runner when `batch`)."""

    def __init__(
        self,
        settings: InferenceSettings,
        taxonomy: Taxonomy,
        taxonomy_path: Path,
        size: int,
        batch: bool,
        log_settings: LogSettings | None = None,
        privacy: PrivacySettings | None = None,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        """`initializer` (picklable) runs first in every worker process, e.g. to instrument the model. Every
        worker process gets `taxonomy` (from `taxonomy_path`) as this process resolved it."""
        self._settings = settings
        self._taxonomy = taxonomy  # also for the fallbacks of a dead worker's requests
        self._taxonomy_path = taxonomy_path
        self._initializer = initializer
        self.size = size
        self._batch = batch
        self._log_settings = log_settings or LogSettings()
        self._privacy = privacy or PrivacySettings()
        self._mp = multiprocessing.get_context("spawn")
        self._limit = max_ticket_chars(settings.max_ticket_tokens)
        self._lock = threading.Lock()
        self._closed = False
        self._pending: list[Result] = []
        self.model_id = ""
        self._workers: list[_Worker] = []
        try:
            for _ in range(size):
                self._workers.append(self._spawn())
            for worker in self._workers:
                self.model_id = self._await_ready(worker)
        except BaseException:
            self.close()
            raise

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [worker.process.pid for worker in self._workers if worker.process.pid is not None]

    def submit(self, request: ClassifyRequest) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("classifier pool is closed")
            worker = min(self._workers, key=lambda w: len(w.in_flight))
            worker.in_flight[request.request_id] = (request, time.monotonic())
            worker.outbox.put(_cut(request, self._limit))

    def poll(self, timeout: float) -> list[Result]:
        with self._lock:
            results, self._pending = self._pending, []
            if self._closed:
                return results
            waitables: dict[object, _Worker] = {}
            for worker in self._workers:
                waitables[worker.conn] = worker
                waitables[worker.process.sentinel] = worker
        ready = multiprocessing.connection.wait(
            list(waitables),  # type: ignore[arg-type]  # connections and sentinels
            0.0 if results else max(0.0, timeout),
        )
        with self._lock:
            for handle in ready:
                worker = waitables[handle]
                if handle is worker.conn:
                    results.extend(self._receive(worker))
                elif worker in self._workers and not worker.process.is_alive():
                    results.extend(self._replace(worker))
        return results

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.outbox.put(None)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for worker in workers:
            if worker.feeder.is_alive():
                worker.feeder.join(max(0.0, deadline - time.monotonic()))
            with _suppress():
                worker.conn.send_bytes(b"")
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(1.0)
            worker.conn.close()

    def _spawn(self) -> _Worker:
        parent, child = self._mp.Pipe(duplex=True)
        process = self._mp.Process(
            target=_worker_main,
            args=(
                child,
                msgspec.msgpack.encode(self._settings),
                msgspec.msgpack.encode(self._taxonomy),
                str(self._taxonomy_path),
                msgspec.msgpack.encode(self._log_settings),
                msgspec.msgpack.encode(self._privacy),
                self._batch,
                self._initializer,
            ),
            name="triage-classifier",
            daemon=True,
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        worker.feeder.start()
        return worker

    def _await_ready(self, worker: _Worker) -> str:
        if not worker.conn.poll(_START_TIMEOUT_S):
            raise UserError(f"classifier worker did not start within {_START_TIMEOUT_S:.0f} s")
        try:
            reply = _REPLY_DECODER.decode(worker.conn.recv_bytes())
        except EOFError:
            worker.process.join(1.0)
            raise UserError(
                f"classifier worker exited at start (exit code {worker.process.exitcode})"
            ) from None
        if isinstance(reply, _Failed):
            raise UserError(reply.message)
        if not isinstance(reply, _Ready):
            raise RuntimeError(f"unexpected first reply from a classifier worker: {reply!r}")
        log.info("classifier worker ready", pid=worker.process.pid, model=reply.model_id)
        return reply.model_id

    def _receive(self, worker: _Worker) -> list[Result]:
        results: list[Result] = []
        try:
            while worker.conn.poll(0):
                reply = _REPLY_DECODER.decode(worker.conn.recv_bytes())
                if isinstance(reply, _Done) and worker.in_flight.pop(reply.request_id, None) is not None:
                    results.append((reply.request_id, reply.result))
                elif isinstance(reply, _Ready):  # a replacement finished loading
                    log.info("classifier worker ready", pid=worker.process.pid, model=reply.model_id)
                elif isinstance(reply, _Failed):  # it exits next; its sentinel brings the next restart
                    log.error("classifier worker restart failed", error=reply.message)
        except (EOFError, OSError):
            if worker in self._workers:
                results.extend(self._replace(worker))
        return results

    def _replace(self, worker: _Worker) -> list[Result]:
        """A worker died: answer its unanswered requests with `model_error` and start a new one."""
        results = []
        with _suppress():
            while worker.conn.poll(0):  # results it sent before dying still count
                reply = _REPLY_DECODER.decode(worker.conn.recv_bytes())
                if isinstance(reply, _Done) and worker.in_flight.pop(reply.request_id, None) is not None:
                    results.append((reply.request_id, reply.result))
        worker.process.join(1.0)
        log.error(
            "classifier worker died; restarting",
            pid=worker.process.pid,
            exit_code=worker.process.exitcode,
            lost_requests=len(worker.in_flight),
        )
        for request_id, (_, submitted) in worker.in_flight.items():
            latency_ms = (time.monotonic() - submitted) * 1000.0
            answer = fallback_answer(
                "model_error", self._taxonomy.fallback_label, self.model_id, latency_ms, process_died=True
            )
            results.append((request_id, answer))
        worker.in_flight.clear()
        worker.outbox.put(None)
        worker.conn.close()
        index = self._workers.index(worker)
        # Its ready message is read by poll() like any reply; requests sent meanwhile wait in its pipe
        # until its model is loaded. (Reading it from another thread would race poll() on the same pipe.)
        self._workers[index] = self._spawn()
        return results


class _suppress:
    """Ignore the errors of closing or reading a dead worker's pipe."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, (OSError, EOFError, ValueError, msgspec.DecodeError))


def _warm(context: Context | EncoderContext | CandidatesContext) -> None:
    context.classify(ClassifyRequest(-1, _WARM_TICKET, time.monotonic() + 60.0))


def _worker_main(
    conn: multiprocessing.connection.Connection,
    settings: bytes,
    taxonomy: bytes,
    taxonomy_path: str,
    logs: bytes,
    privacy: bytes,
    batch: bool,
    initializer: Callable[[], None] | None,
) -> None:
    """Entry point of a worker process: load, warm, then answer requests until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    if hasattr(signal, "SIGHUP"):  # a hang-up reloads the parent's model (a terminal's reaches us too)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if initializer is not None:
        initializer()
    from worker.logs import configure_logging

    configure_logging(
        msgspec.msgpack.decode(logs, type=LogSettings), msgspec.msgpack.decode(privacy, type=PrivacySettings)
    )
    try:
        engine = open_engine(
            msgspec.msgpack.decode(settings, type=InferenceSettings),
            msgspec.msgpack.decode(taxonomy, type=Taxonomy),
            Path(taxonomy_path),
        )
        serve: Callable[[list[ClassifyRequest]], list[Classification]]
        if batch and isinstance(engine, EncoderEngine):  # an encoder batches natively
            _warm(engine.new_context())
            serve = engine.classify_batch
            max_batch = engine.settings.batch_size
        elif batch and isinstance(engine, GenAIEngine):
            from worker.inference.batch import BatchRunner

            runner = BatchRunner(engine)
            serve = runner.classify_batch
            max_batch = engine.settings.batch_size
        else:
            context = engine.new_context()
            _warm(context)
            serve = lambda requests: [context.classify(r) for r in requests]  # noqa: E731
            max_batch = 1
    except UserError as error:
        conn.send_bytes(_ENCODER.encode(_Failed(str(error))))
        return
    conn.send_bytes(_ENCODER.encode(_Ready(engine.model_id)))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        if not data:
            return
        requests = [_REQUEST_DECODER.decode(data)]
        while len(requests) < max_batch and conn.poll(0):
            data = conn.recv_bytes()
            if not data:
                break
            requests.append(_REQUEST_DECODER.decode(data))
        for request, result in zip(requests, serve(requests), strict=True):
            conn.send_bytes(_ENCODER.encode(_Done(request.request_id, result)))
        if not data:
            return
