"""`triage-worker registry start|stop|status`: a local Schema Registry (Apicurio Registry built from Maven
Central jars, see `worker/dev/local_registry.py`) for the registry input and output formats."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from worker.dev import local_registry


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    registry = subparsers.add_parser(
        "registry",
        help="run a local Schema Registry with the Confluent API (no Docker needed)",
        description=(
            f"Local Apicurio Registry {local_registry.APICURIO_VERSION} serving the Confluent Schema "
            f"Registry API at http://127.0.0.1:PORT{local_registry.CCOMPAT_PATH}, built once from Maven "
            f"Central jars into {local_registry.registry_home()}. Schemas are kept in memory: a restart "
            "starts empty. Needs java and mvn."
        ),
    )
    actions = registry.add_subparsers(title="actions", metavar="ACTION", required=True)

    start = actions.add_parser("start", help="start the registry in the background and wait until it answers")
    start.add_argument(
        "--port", type=int, default=local_registry.DEFAULT_PORT, help="HTTP port (default 8081)"
    )
    _add_state_dir(start)
    start.set_defaults(handler=_start)

    stop = actions.add_parser("stop", help="stop the registry (SIGTERM, then SIGKILL after 30 s)")
    _add_state_dir(stop)
    stop.set_defaults(handler=_stop)

    status = actions.add_parser(
        "status", help="say whether the registry runs, its URL and log file (exit code 3 when stopped)"
    )
    _add_state_dir(status)
    status.set_defaults(handler=_status)


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"the registry's log and pid file (default {local_registry.default_state_dir()})",
    )


def _start(args: argparse.Namespace) -> int:
    registry = local_registry.LocalRegistry(args.state_dir, args.port)
    before = registry.status()
    status = registry.start()
    if before.running:
        print(f"already running (pid {status.pid})")
    print(f"url:      {status.url}")
    print(f"log file: {status.log_file}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    print("stopped" if local_registry.LocalRegistry(args.state_dir).stop() else "not running")
    return 0


def _status(args: argparse.Namespace) -> int:
    status = local_registry.LocalRegistry(args.state_dir).status()
    print(f"running (pid {status.pid})" if status.running else "not running")
    if status.url is not None:
        print(f"url:      {status.url}")
    print(f"log file: {status.log_file}")
    return 0 if status.running else 3
