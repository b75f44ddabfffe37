"""`triage-worker watch`: print the triage records and dead letters as they are written.

A reader by assignment (it joins no group and commits nothing), from the beginning of the output and
dead-letter topics unless `--new`: the quickest way to see what the worker made of the tickets.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from worker.cli.viewer import dead_letter_line, decode_result, open_viewer, result_line
from worker.errors import UserError
from worker.kafka.admin import check_cluster
from worker.kafka.clients import producer_config
from worker.settings import add_config_argument, settings_from_args


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "watch",
        help="print triage records and dead letters as they arrive (until Ctrl-C, --count or --idle)",
        description=(
            "One line per triage record (ticket id, intent, priority, confidence or fallback reason, "
            "latency) and per dead letter (source position, error type and message), from the beginning "
            "of the output and dead-letter topics."
        ),
    )
    add_config_argument(parser)
    parser.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers")
    parser.add_argument("--new", action="store_true", help="only records written from now on")
    parser.add_argument(
        "--count", type=int, default=0, help="stop after this many records (default: no limit)"
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="stop after this long without a new record (default: never)",
    )
    parser.set_defaults(handler=watch)


def watch(args: argparse.Namespace) -> int:
    if args.count < 0 or args.idle < 0:
        raise UserError("--count and --idle must not be negative")
    settings = settings_from_args(args, {"kafka.bootstrap.servers": args.bootstrap_servers})
    check_cluster(producer_config(settings.kafka))
    viewer = open_viewer(settings, from_beginning=not args.new)
    shown = 0
    last_seen = time.monotonic()
    try:
        while not args.count or shown < args.count:
            if args.idle and time.monotonic() - last_seen > args.idle:
                break
            for message in viewer.consume(100, 0.5):
                if message.error() is not None:
                    continue
                if message.topic() == settings.topics.dead_letter:
                    line = dead_letter_line(message)
                elif (result := decode_result(message)) is not None:
                    line = result_line(result)
                else:
                    continue
                print(line, flush=True)
                shown += 1
                last_seen = time.monotonic()
                if args.count and shown >= args.count:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        viewer.close()
    return 0
