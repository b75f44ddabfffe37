"""`triage-worker produce-samples`: publish sample tickets (some malformed on purpose) to the input topic."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from worker.dev.samples import SampleFactory, produce_samples
from worker.errors import UserError
from worker.kafka.admin import check_cluster
from worker.kafka.clients import producer_config
from worker.settings import add_config_argument, settings_from_args


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "produce-samples",
        help="publish sample tickets (real banking questions; some malformed) to the input topic",
        description=(
            "Publish sample tickets to the input topic at a steady rate. A share of them is malformed in "
            "varied ways (invalid JSON, missing fields, wrong types, bad timestamps, invalid UTF-8, "
            "tombstones) to exercise the dead-letter path. Records are keyed by customer id."
        ),
    )
    add_config_argument(parser)
    parser.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers")
    parser.add_argument("--topic", help="topic to publish to (default: topics.input)")
    parser.add_argument(
        "--count", type=int, default=100, help="how many records (0 = until Ctrl-C; default 100)"
    )
    parser.add_argument(
        "--rate", type=float, default=10.0, help="records per second (0 = as fast as possible)"
    )
    parser.add_argument(
        "--malformed-ratio",
        type=float,
        default=0.1,
        metavar="RATIO",
        help="share of malformed records, 0..1 (default 0.1)",
    )
    parser.add_argument("--seed", type=int, help="random seed, for a reproducible stream")
    parser.set_defaults(handler=_produce)


def _produce(args: argparse.Namespace) -> int:
    if args.count < 0 or args.rate < 0:
        raise UserError("--count and --rate must not be negative")
    if not 0.0 <= args.malformed_ratio <= 1.0:
        raise UserError(f"--malformed-ratio must be between 0 and 1, got {args.malformed_ratio}")
    settings = settings_from_args(args, {"kafka.bootstrap.servers": args.bootstrap_servers})
    topic = args.topic or settings.topics.input
    # Without it a refused login or an untrusted certificate would only show as every record failing after
    # the flush timeout (two minutes).
    check_cluster(producer_config(settings.kafka))
    factory = SampleFactory(seed=args.seed, malformed_ratio=args.malformed_ratio)
    stop = threading.Event()
    # Ctrl-C ends the stream cleanly: what was published is flushed and counted.
    signal.signal(signal.SIGINT, lambda _signum, _frame: stop.set())
    stats = produce_samples(settings, topic, args.count, args.rate, factory, stop=stop)
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(stats.by_kind.items())) or "none"
    print(
        f"published {stats.sent} records to {topic} ({stats.malformed} malformed: {kinds}; "
        f"{stats.failed} failed)",
        file=sys.stderr,
    )
    return 1 if stats.failed else 0
