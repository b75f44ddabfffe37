"""`triage-worker` command line: one sub-command per module, each registering itself.

Every command module exposes `register(subparsers)`, which adds its parser and sets `handler` to a function
`(args) -> int` (the exit code). Errors the user can fix (bad config, bad input file, missing runtime) are
raised as `UserError` and printed as one line, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from worker import __version__
from worker.errors import UserError

# Modules that add a sub-command, in the order `--help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "worker.ops.run_command",
    "worker.ops.samples_command",
    "worker.ops.send_command",
    "worker.ops.watch_command",
    "worker.ops.demo_command",
    "worker.ops.classify_command",
    "worker.ops.replay_command",
    "worker.ops.shadow_command",
    "worker.ops.review_command",
    "worker.ops.lag_command",
    "worker.ops.broker_command",
    "worker.ops.config_command",
    "worker.ops.model_command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triage-worker",
        description="Kafka worker that triages support tickets with a local ONNX Runtime GenAI model.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except UserError as error:
        print(f"triage-worker: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
