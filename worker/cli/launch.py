"""The one way a `triage-worker run` child process is started (the demo, and the tests and tools through
`tools.harness`): the same interpreter, against one broker, with JSON logs that the starter reads."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def run_command(
    bootstrap: str, options: Sequence[str] = (), entry: Sequence[str] = ("-m", "worker")
) -> list[str]:
    """`triage-worker run --bootstrap-servers BOOTSTRAP --log-format json`, then `options`. `entry` replaces
    `-m worker` with a script that runs the same CLI (tests/slow_model.py)."""
    return [sys.executable, *entry, "run", "--bootstrap-servers", bootstrap, "--log-format", "json", *options]
