"""`triage-worker` command line: one sub-command per module, each registering itself.

Every command module exposes `register(subparsers)`, which adds its parser and sets `handler` to a function
`(args) -> int` (the exit code). Errors the user can fix (bad config, bad input file, missing runtime) are
raised as `UserError` and printed as one line, without a traceback. A reader of its output that goes away
(`| head`) ends the command quietly, its cleanup done, with exit code 141 (see `worker/cli/pipes.py`).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import types
from collections.abc import Sequence

from worker import __version__
from worker.cli.pipes import READER_GONE_EXIT, guard_standard_streams
from worker.errors import UserError
from worker.privacy.redaction import Redactor

# Modules that add a sub-command, in the order `--help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "worker.cli.run_command",
    "worker.cli.samples_command",
    "worker.cli.send_command",
    "worker.cli.watch_command",
    "worker.cli.demo_command",
    "worker.cli.classify_command",
    "worker.cli.replay_command",
    "worker.cli.shadow_command",
    "worker.cli.review_command",
    "worker.cli.lag_command",
    "worker.cli.broker_command",
    "worker.cli.registry_command",
    "worker.cli.config_command",
    "worker.cli.model_command",
    "worker.cli.taxonomy_command",
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


class HeldStopSignals:
    """SIGTERM/SIGINT held while the command modules import (ONNX Runtime, librdkafka: seconds on a loaded
    machine, long enough for a supervisor's stop to arrive), then handed to the command: a command that
    sets `takes_stop_signals` gets this object as `args.held_stop_signals` and installs its own handlers
    (`run` stops gracefully); for any other, `release` restores the defaults and a held signal acts then."""

    def __init__(self) -> None:
        self.received: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._hold)

    def _hold(self, signum: int, _frame: types.FrameType | None) -> None:
        self.received.append(signum)

    def release(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in self.received:
            signal.raise_signal(signum)


def main(argv: Sequence[str] | None = None) -> int:
    streams = guard_standard_streams()
    try:
        try:
            code = _run(argv)
        except SystemExit:  # --help, --version, a usage error: their text is output too
            streams.flush()
            raise
        streams.flush()
        return code
    except OSError:
        if not streams.reader_gone:  # not about our output: a problem to see, not a reader that left
            raise
        return READER_GONE_EXIT
    finally:
        streams.restore()


def _run(argv: Sequence[str] | None) -> int:
    held = HeldStopSignals()
    try:
        args = build_parser().parse_args(argv)
    except BaseException:  # --help, --version, a usage error: no command takes the held signals
        held.release()
        raise
    if getattr(args, "takes_stop_signals", False):
        args.held_stop_signals = held
    else:
        held.release()
    try:
        code: int = args.handler(args)
    except UserError as error:
        # Errors may quote what they were given (a ticket's text, a record's value): never its personal data.
        print(f"triage-worker: error: {Redactor().redact(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
