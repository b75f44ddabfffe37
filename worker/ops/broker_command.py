"""`triage-worker broker start|stop|status|fetch` and `triage-worker topics create`.

The broker commands drive the local development broker (real Apache Kafka from Maven Central jars, see
`worker/kafka/local_broker.py`); `topics create` works against any cluster the settings point at.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from worker.config import add_config_argument, settings_from_args
from worker.kafka import local_broker
from worker.kafka.admin import create_topics, worker_topics


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    broker = subparsers.add_parser(
        "broker",
        help="run a local Apache Kafka broker (no Docker needed)",
        description=(
            f"Local single-node Kafka {local_broker.KAFKA_VERSION} (KRaft), from jars Maven resolves into "
            f"{local_broker.kafka_home()} (override with TRIAGE_KAFKA_HOME). Needs java and mvn."
        ),
    )
    actions = broker.add_subparsers(title="actions", metavar="ACTION", required=True)

    start = actions.add_parser("start", help="start the broker in the background and wait until it is ready")
    start.add_argument(
        "--port", type=int, default=local_broker.DEFAULT_PORT, help="client port (default 9092)"
    )
    start.add_argument("--fresh", action="store_true", help="wipe topics and messages of earlier runs first")
    _add_state_dir(start)
    start.set_defaults(handler=_start)

    stop = actions.add_parser("stop", help="stop the broker (SIGTERM, then SIGKILL after 30 s)")
    _add_state_dir(stop)
    stop.set_defaults(handler=_stop)

    status = actions.add_parser(
        "status", help="say whether the broker runs, where, and its log file (exit code 3 when stopped)"
    )
    _add_state_dir(status)
    status.set_defaults(handler=_status)

    fetch = actions.add_parser("fetch", help="resolve the broker's jars from Maven Central (once)")
    fetch.set_defaults(handler=_fetch)

    topics = subparsers.add_parser("topics", help="manage the worker's Kafka topics")
    topic_actions = topics.add_subparsers(title="actions", metavar="ACTION", required=True)
    create = topic_actions.add_parser(
        "create",
        help="create the input, output and dead-letter topics (existing ones are left alone)",
    )
    add_config_argument(create)
    create.set_defaults(handler=_create_topics)


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"broker data, logs and pid file (default {local_broker.default_state_dir()})",
    )


def _start(args: argparse.Namespace) -> int:
    broker = local_broker.LocalBroker(args.state_dir, args.port)
    before = broker.status()
    status = broker.start(fresh=args.fresh)
    if before.running:
        print(f"already running (pid {status.pid})")
    print(f"bootstrap: {status.bootstrap}")
    print(f"log file:  {status.log_file}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    broker = local_broker.LocalBroker(args.state_dir)
    print("stopped" if broker.stop() else "not running")
    return 0


def _status(args: argparse.Namespace) -> int:
    status = local_broker.LocalBroker(args.state_dir).status()
    if status.running:
        print(f"running (pid {status.pid})")
        print(f"bootstrap: {status.bootstrap}")
    else:
        print("not running")
    print(f"log file:  {status.log_file}")
    return 0 if status.running else 3


def _fetch(args: argparse.Namespace) -> int:
    print(f"Kafka {local_broker.KAFKA_VERSION} jars: {local_broker.fetch_jars()}")
    return 0


def _create_topics(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    specs = worker_topics(settings.topics)
    outcomes = create_topics(settings.kafka, specs)
    for spec in specs:
        if outcomes[spec.name] == "created":
            layout = f"partitions={spec.partitions}, replication_factor={spec.replication_factor}"
            print(f"{spec.name}: created ({layout})")
        else:
            print(f"{spec.name}: already exists (left unchanged)")
    return 0
