"""`triage-worker run`: the worker itself — consume tickets, classify them, produce one record each.

Every pipeline, topic, inference and log setting has a flag here (worker/cli/flags.py); flags beat `--set`,
which beats the environment and the `--config` file (see worker/settings). The worker is assembled and run
by `worker.app.application.WorkerApp`: the process runs until SIGTERM/SIGINT, then shuts down gracefully
(exit 0); a second signal exits at once (exit 128+signal). SIGHUP (and `POST /reload` when metrics.port and
metrics.reload_token_file are set) reloads the model without leaving the group (see worker/app/reload.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from worker.app.application import WorkerApp
from worker.cli.flags import add_run_flags, overrides
from worker.settings import Settings, add_config_argument, settings_from_args


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run the worker: consume tickets, classify, produce triage records (until Ctrl-C/SIGTERM)",
        description=(
            "Consume tickets from the input topic, classify each with the local model within its deadline, "
            "produce one triage record per ticket (dead letters for undecodable records) and commit only "
            "finished offsets. At-least-once: a crash re-delivers at most --max-in-flight tickets."
        ),
    )
    add_config_argument(parser)
    add_run_flags(parser)
    parser.add_argument(
        "--metrics-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often the metrics event is logged (default 10; also logged at shutdown)",
    )
    parser.set_defaults(handler=run, takes_stop_signals=True)


def run(args: argparse.Namespace) -> int:
    def load() -> Settings:
        """The settings as configured now: at start, and again at each hot reload."""
        return settings_from_args(args, overrides(args))

    app = WorkerApp(
        load(),
        load,
        metrics_interval_s=args.metrics_interval,
        held_stop_signals=args.held_stop_signals.received,
    )
    return app.run()
