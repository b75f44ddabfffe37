"""Standard streams whose reader may go away: `triage-worker demo | head -n 8`, `make run | tee log` + Ctrl-C.

Python ignores SIGPIPE, so a write to a pipe nobody reads any more raises BrokenPipeError (one to a terminal
that hung up, OSError EIO), and so does every later write: the `finally` blocks that stop a command's children
(the demo's worker, the broker it started) print a line first, that print raises again, and the rest of the
cleanup never runs. So the CLI guards its own stdout and stderr: the first write that finds the reader gone
points the file descriptor at /dev/null and raises, which unwinds the command like any error, and every later
write, the cleanup's own lines included, goes nowhere without a word. `cli.main` then exits with
`READER_GONE_EXIT`, without a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

# What a shell reports for a tool that SIGPIPE ended (128 + 13): `set -o pipefail` scripts see the same as
# with `yes | head`.
READER_GONE_EXIT = 141


class _ReaderGoneRaw(io.RawIOBase):
    """Writes to `fd`; the first write that finds the pipe's reader gone sends the descriptor to /dev/null
    (for the rest of the process, its children included) and raises."""

    def __init__(self, fd: int, on_reader_gone: _Guard) -> None:
        super().__init__()
        self._fd = fd
        self._guard = on_reader_gone

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: ReadableBuffer) -> int | None:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:  # a full non-blocking descriptor: None, as a raw file's contract says
            return None
        except OSError as error:
            # EPIPE: a pipe nobody reads any more; EIO: a terminal hung up (closed under `make run`).
            if error.errno not in (errno.EPIPE, errno.EIO):
                raise
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._fd)
            os.close(devnull)
            self._guard.reader_gone = True
            raise


class _Guard:
    """The process's stdout and stderr replaced by guarded copies while a command runs (see the module)."""

    def __init__(self) -> None:
        self.reader_gone = False
        self._replaced: list[tuple[str, TextIO]] = []

    def install(self) -> None:
        for name, original in (("stdout", sys.__stdout__), ("stderr", sys.__stderr__)):
            # Only the process's own streams: a test runner's capture (in-process `main`) is left as it is.
            if (
                original is None
                or getattr(sys, name) is not original
                or not isinstance(original, io.TextIOWrapper)
            ):
                continue
            try:
                fd = original.fileno()
            except (OSError, ValueError):
                continue
            original.flush()
            guarded = io.TextIOWrapper(
                io.BufferedWriter(_ReaderGoneRaw(fd, self)),
                encoding=original.encoding,
                errors=original.errors,
                line_buffering=original.line_buffering,
                write_through=original.write_through,
            )
            setattr(sys, name, guarded)
            self._replaced.append((name, original))

    def flush(self) -> None:
        """Flush what the command wrote: a reader gone by now is found here, while `main` can still say so."""
        for name, _ in self._replaced:
            getattr(sys, name).flush()

    def restore(self) -> None:
        """Put the original streams back (quietly: a reader gone at this point has nothing more to lose)."""
        for name, original in reversed(self._replaced):
            with contextlib.suppress(OSError):
                getattr(sys, name).flush()
            setattr(sys, name, original)
        self._replaced.clear()


def guard_standard_streams() -> _Guard:
    """Install the guard on the process's stdout and stderr; `restore` it when the command is done."""
    guard = _Guard()
    guard.install()
    return guard
