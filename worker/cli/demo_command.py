"""`triage-worker demo` (what `make run` calls): the whole flow on one machine, results shown live.

1. Kafka: `KAFKA_BOOTSTRAP_SERVERS` (or --bootstrap-servers / the config) when given; otherwise the local
   development broker is started (and stopped again at the end if this command started it), on --port, else
   on 9092, else (9092 taken, e.g. by another Kafka on a laptop) on a free port, which it says.
2. The input, output and dead-letter topics are created if missing.
3. The worker runs as a child process (`triage-worker run`, default: the embedded model), its JSON log in a
   file; it is started in its own session so that Ctrl-C reaches only this command, which then stops the
   worker with one SIGTERM (the graceful path).
4. Sample tickets are published at --rate; every triage record and dead letter is printed as it arrives,
   with a running summary, until Ctrl-C, SIGTERM or SIGHUP (or --count records, then --linger seconds).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import statistics
import subprocess
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import msgspec

from worker.cli.launch import run_command
from worker.cli.viewer import dead_letter_line, decode_result, open_viewer, result_line
from worker.dev import local_broker
from worker.dev.samples import Sample, SampleFactory, produce_samples
from worker.errors import UserError
from worker.kafka.admin import create_topics, worker_topics
from worker.settings import Settings, add_config_argument, settings_from_args

_SUMMARY_EVERY_S = 5.0
_WORKER_STOP_TIMEOUT_S = 60.0


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run broker (if needed) + worker + sample producer and show triage results live (make run)",
        description=(
            "Start everything on this machine and show results as they arrive: the local Kafka broker "
            "unless KAFKA_BOOTSTRAP_SERVERS is set, the topics, the worker (embedded model by default) and a "
            "stream of sample tickets. Ctrl-C stops it all cleanly."
        ),
    )
    add_config_argument(parser)
    parser.add_argument(
        "--bootstrap-servers", metavar="SERVERS", help="use this Kafka instead of a local one"
    )
    parser.add_argument(
        "--port",
        type=int,
        help=(
            f"client port of the local broker it starts (default {local_broker.DEFAULT_PORT}, or a free one "
            "when that is taken)"
        ),
    )
    parser.add_argument("--model", help="model folder for the worker (default: the embedded model)")
    parser.add_argument("--rate", type=float, default=5.0, help="sample tickets per second (default 5)")
    parser.add_argument(
        "--count", type=int, default=0, help="stop after this many tickets (default: no limit)"
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --count: how long to wait for the last results before stopping (default 10)",
    )
    parser.add_argument("--malformed-ratio", type=float, default=0.1, metavar="RATIO", help="default 0.1")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=local_broker.default_state_dir(),
        help="local broker's state directory (default %(default)s)",
    )
    parser.set_defaults(handler=demo)


class _Summary:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.results = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.dead = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=1000)
        self.priorities: collections.Counter[str] = collections.Counter()

    def line(self, published: int) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        p50 = statistics.median(self.latencies) if self.latencies else 0.0
        fallback = sum(self.fallbacks.values())
        by_priority = " ".join(f"{p}:{self.priorities[p]}" for p in ("Critical", "High", "Medium", "Low"))
        reasons = ", ".join(f"{r} {n}" for r, n in self.fallbacks.most_common()) or "none"
        return (
            f"── published {published} · results {self.results} ({self.results / elapsed:.1f}/s, "
            f"p50 latency {p50:.0f} ms; {by_priority}) · fallbacks {fallback} ({reasons}) · "
            f"dead letters {self.dead}"
        )


def demo(args: argparse.Namespace) -> int:
    """The broker this command starts is stopped whatever ends it: Ctrl-C (or SIGTERM, SIGHUP), an error,
    or the reader of its output gone (`demo | head`); from the moment it is started, not once it is ready."""
    with _stopped_like_ctrl_c(signal.SIGTERM, signal.SIGHUP):
        return _demo(args)


@contextlib.contextmanager
def _stopped_like_ctrl_c(*signals: signal.Signals) -> Iterator[None]:
    """`signals` end the demo as Ctrl-C does, its cleanup included: a supervisor's or `timeout`'s SIGTERM,
    and the SIGHUP of a terminal closed under `make run`, killed it on the spot, its worker and broker left
    running."""

    def interrupt(_signum: int, _frame: types.FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _demo(args: argparse.Namespace) -> int:
    given = args.bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    broker: local_broker.LocalBroker | None = None
    try:
        if given is None:
            running = local_broker.LocalBroker(args.state_dir).status()
            if running.running and running.bootstrap is not None:
                ignored = (
                    f" (not --port {args.port}: `broker stop` it first)"
                    if args.port not in (None, running.port)
                    else ""
                )
                print(f"using the local broker already running at {running.bootstrap}{ignored}", flush=True)
                given = running.bootstrap  # not ours to stop
            else:
                broker = local_broker.LocalBroker(args.state_dir, args.port or _free_default_port())
                where = f"port {broker.port} ({args.state_dir})"
                print(f"starting the local Kafka broker on {where} ...", flush=True)
                broker.start(fresh=False)
                given = broker.bootstrap
        settings = settings_from_args(args, {"kafka.bootstrap.servers": given, "inference.model": args.model})
        return _run(args, settings)
    finally:
        if broker is not None and broker.status().running:
            print("stopping the local Kafka broker ...", flush=True)
            broker.stop()


def _free_default_port() -> int:
    """The usual Kafka port, unless something (another Kafka, most likely) already listens there."""
    if not local_broker.port_open(local_broker.DEFAULT_PORT):
        return local_broker.DEFAULT_PORT
    port = local_broker.free_port()
    print(f"port {local_broker.DEFAULT_PORT} is taken (another Kafka?); using port {port}", flush=True)
    return port


def _run(args: argparse.Namespace, settings: Settings) -> int:
    topics = settings.topics
    bootstrap = settings.kafka["bootstrap.servers"]
    for name, outcome in create_topics(settings.kafka, worker_topics(topics)).items():
        print(f"topic {name}: {outcome}", flush=True)
    viewer = open_viewer(settings, from_beginning=False)  # only this run's records
    # Into the broker's state folder (made and marked as its own if need be, so `broker start --fresh` may
    # wipe it later), beside the broker's logs.
    local_broker.make_state_dir(Path(args.state_dir))
    log_path = Path(args.state_dir) / "logs" / f"demo-worker-{uuid.uuid4().hex[:6]}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    worker = _start_worker(args, bootstrap, log_path)
    print(f"worker pid {worker.pid}, log {log_path}; press Ctrl-C to stop", flush=True)

    texts: dict[str, str] = {}
    published = [0]
    stop = threading.Event()
    factory = SampleFactory(malformed_ratio=args.malformed_ratio)

    def remember(sample: Sample, sent: int) -> None:
        # Results carry only the ticket id; keep the text to show next to them.
        published[0] = sent
        if sample.malformed is None and sample.value is not None:
            ticket = msgspec.json.decode(sample.value)
            if len(texts) > 10_000:
                texts.clear()
            texts[ticket["ticket_id"]] = ticket["body"]

    def produce() -> None:
        produce_samples(settings, topics.input, args.count, args.rate, factory, stop, remember)

    producer = threading.Thread(target=produce, name="samples", daemon=True)
    producer.start()
    summary = _Summary()
    last_summary = time.monotonic()
    finished_at: float | None = None
    try:
        while True:
            if worker.poll() is not None:
                print(f"the worker exited with code {worker.returncode}; its log {log_path}:", flush=True)
                print(_tail(log_path), flush=True)
                return 1
            for message in viewer.consume(100, 0.5):
                if message.error() is None:
                    _show(message, topics.dead_letter, texts, summary)
            if time.monotonic() - last_summary >= _SUMMARY_EVERY_S:
                print(summary.line(published[0]), flush=True)
                last_summary = time.monotonic()
            if args.count and not producer.is_alive():
                finished_at = finished_at or time.monotonic()
                done = summary.results + summary.dead >= args.count
                if done or time.monotonic() - finished_at > args.linger:
                    break
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        stop.set()
        code = _stop_worker(worker)
        producer.join(10)
        for message in viewer.consume(500, 1.0):
            if message.error() is None:
                _show(message, topics.dead_letter, texts, summary)
        viewer.close()
        print(summary.line(published[0]), flush=True)
        print(f"worker stopped (exit code {code}); its log: {log_path}", flush=True)
    return 0 if code == 0 else 1


def _start_worker(args: argparse.Namespace, bootstrap: str, log_path: Path) -> subprocess.Popen[bytes]:
    options = ["--config", str(args.config)] if args.config is not None else []
    options += [f"--set={pair}" for pair in args.config_overrides]
    if args.model:
        options += ["--model", args.model]
    command = run_command(bootstrap, options)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches this command only; the worker gets one SIGTERM
        )


def _stop_worker(worker: subprocess.Popen[bytes]) -> int:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(_WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return worker.returncode


def _show(
    message: confluent_kafka.Message, dead_letter_topic: str, texts: dict[str, str], summary: _Summary
) -> None:
    if message.topic() == dead_letter_topic:
        summary.dead += 1
        print(dead_letter_line(message), flush=True)
        return
    result = decode_result(message)
    if result is None:
        return
    summary.results += 1
    summary.latencies.append(result.latency_ms)
    summary.priorities[result.priority] += 1
    if result.fallback:
        summary.fallbacks[result.fallback_reason or "?"] += 1
    print(result_line(result, texts.pop(result.ticket_id, "")), flush=True)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        raise UserError(f"cannot read {path}: {error}") from None
