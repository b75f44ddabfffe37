"""SIGTERM and SIGINT for a command that runs until it is stopped (`run`, `replay`), handled one way.

- The first signal asks for a graceful stop (`stop()`), and `announce(signal, held)` says so: the command
  finishes what it took, settles it and exits in its own time.
- A signal that arrived while the modules imported (`held`, see `cli.HeldStopSignals`) counts as the first:
  `stop()` is asked at once (`received` says so to a caller that builds what is to be stopped later).
- A second signal exits the process at once (exit 128 + signal): nothing uncommitted is lost, the next run
  or the next owner of the partitions reads it again.

`restore()` puts the default handlers back, for a command that returns to its caller (one run in-process).
"""

from __future__ import annotations

import os
import signal
import types
from collections.abc import Callable, Sequence

# Told the name of the signal, and whether it arrived while the modules imported.
Announce = Callable[[str, bool], None]


class StopOnSignals:
    """SIGTERM/SIGINT from now on (see the module docstring). `announce` runs in the signal handler: it must
    not write to a stream the interrupted code may be writing to (hand the line to a thread instead)."""

    def __init__(self, held: Sequence[int], stop: Callable[[], None], announce: Announce) -> None:
        self.received: list[int] = []
        self._stop = stop
        self._announce = announce
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if held:  # held signals count as one: the next one is the one that exits at once
            self._first(held[0], held=True)

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _on_signal(self, signum: int, _frame: types.FrameType | None) -> None:
        if self.received:
            # Second signal: leave now. Nothing uncommitted is lost; it is read again.
            os._exit(128 + signum)
        self._first(signum, held=False)

    def _first(self, signum: int, held: bool) -> None:
        self.received.append(signum)
        self._announce(signal.Signals(signum).name, held)
        self._stop()
