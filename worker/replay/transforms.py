"""`replay --transform`: the ops' repair function, run in a process of its own, each call under a time limit.

The function is arbitrary code. Called in the replay's own thread, one that never returns hangs the replay at
full CPU and deaf to SIGTERM (the handler only sets a flag the loop never gets back to read), and a Python
thread cannot be stopped from outside. A process can: `TransformProcess` sends each value to a child
(`python -P -m worker.replay.transforms`) over a pipe and waits at most `timeout_s` for the answer; a child
that overruns is killed, its record is reported as a transform failure, and the next record gets a fresh
child. While it waits it checks the replay's stop flag, so SIGTERM/SIGINT stop a replay even inside a call.

The child starts in the folder the operator runs `replay` from, which anyone may have written to: `-P` keeps
that folder off its `sys.path` (plain `-m` puts it first), so a `struct.py` or `json.py` lying there is never
imported in place of the real module. The fix the spec names in that folder is loaded from its file alone.

Frames on the pipes: one kind byte, a 4-byte big-endian length, the payload. The child's own stdout goes to
stderr, so a `print()` in a transform never mixes into the frames (nor into `replay --json`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, TracebackType

from worker.errors import UserError

TransformFunction = Callable[[bytes], bytes | None]

DEFAULT_TRANSFORM_TIMEOUT_S = 5.0
# Loading the function (the child's interpreter and the ops' module with its imports) has its own limit.
LOAD_TIMEOUT_S = 60.0
# How often a wait for the child looks at the stop flag: how late a SIGTERM is noticed inside a call.
STOP_CHECK_S = 0.05

_HEADER = struct.Struct(">cI")
_READ_SIZE = 1 << 16
# Parent to child: the function to load (`module:function`), then one value per call.
_LOAD, _VALUE = b"L", b"V"
# Child to parent: loaded or why not; per call, the new value, "skip this record", or why it failed.
_READY, _LOAD_FAILED, _REPAIRED, _SKIP, _FAILED = b"R", b"X", b"O", b"S", b"F"


class TransformFailed(Exception):
    """The transform failed on one record (raised, returned a wrong type, overran its time, or its process
    died): reported for that record; the replay goes on."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class TransformStopped(Exception):
    """The replay was asked to stop while a call was running: that record was not taken."""


def load_transform(spec: str) -> TransformFunction:
    """``module:function`` (its file in the current directory, else importable) or
    ``path/to/file.py:function``. A module of the current directory is loaded from its file alone: the
    directory never goes on `sys.path`, where its other files would shadow the modules the process imports."""
    module_name, sep, function_name = spec.rpartition(":")
    if not sep or not module_name or not function_name:
        raise UserError(f"invalid --transform {spec!r}: expected module:function or file.py:function")
    local = Path(*module_name.split(".")).with_suffix(".py")
    try:
        if module_name.endswith(".py"):
            module = _load_file(Path(module_name))
        elif local.is_file():  # ops keep fixes next to them, and it came first when `-m` put it on sys.path
            module = _load_file(local)
        else:
            module = importlib.import_module(module_name)
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"--transform: cannot load {module_name}: {type(error).__name__}: {error}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserError(f"--transform: {module_name} has no function {function_name!r}")
    transform: TransformFunction = function
    return transform


def _load_file(path: Path) -> ModuleType:
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None or not path.is_file():
        raise UserError(f"--transform: no such file {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def apply_transform(transform: TransformFunction, value: bytes) -> bytes | None:
    """Run the ops' fix; None means "skip this record". Raises with a readable message on bad results."""
    result = transform(value)
    if result is not None and not isinstance(result, bytes | bytearray):
        raise TypeError(f"transform returned {type(result).__name__}, expected bytes or None")
    return None if result is None else bytes(result)


def describe_failure(problem: BaseException, limit: int = 200) -> str:
    """`Type: text` of an exception raised by the ops' code, short and printable whatever it holds (a
    whole record value, lone surrogates, or a __str__ that itself raises)."""
    try:
        text = str(problem)
    except Exception:
        text = "(no description)"
    detail = f"{type(problem).__name__}: {text}".encode("utf-8", "backslashreplace").decode("utf-8")
    return detail if len(detail) <= limit else detail[: limit - 1] + "…"


class TransformProcess:
    """`--transform SPEC` in a child process, one call at a time, each answered within `timeout_s`.

    Use as a context manager: entering loads the function in the child (UserError saying why it cannot be
    loaded, before the replay reads anything), leaving ends the child. `should_stop` is the replay's stop
    flag, checked while waiting."""

    def __init__(self, spec: str, timeout_s: float, should_stop: Callable[[], bool]) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._should_stop = should_stop
        self._child: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> TransformProcess:
        self._start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def repair(self, value: bytes) -> bytes | None:
        """The repaired value, or None to skip the record; TransformFailed for this record, or
        TransformStopped when the replay was asked to stop meanwhile."""
        if self._child is None:  # the last call overran or died: a fresh child for this record
            try:
                self._start()
            except UserError as error:
                raise TransformFailed(f"TransformRestartFailed: {error}") from None
        child = self._running()
        try:
            _write_frame(child, _VALUE, value)
            kind, payload = _read_frame(child, time.monotonic() + self.timeout_s, self._should_stop)
        except _Overran:
            self._kill()
            raise TransformFailed(
                f"TransformTimeout: no answer within {self.timeout_s:g} s (--transform-timeout); "
                "its process was restarted"
            ) from None
        except _Ended:
            code = self._kill()
            raise TransformFailed(f"TransformProcessEnded: the transform's process exited ({code})") from None
        except BaseException:  # stopped, or a second signal: the child may be mid-call, never reuse it
            self._kill()
            raise
        if kind == _FAILED:
            raise TransformFailed(payload.decode("utf-8", "replace"))
        return None if kind == _SKIP else payload

    def close(self) -> None:
        """End the child: at once if it is busy, else by closing its input (it exits on end of file)."""
        child, self._child = self._child, None
        if child is None:
            return
        if child.stdin is not None:
            child.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)
        _kill_group(child)

    def _start(self) -> None:
        # Its own session: a terminal's Ctrl-C reaches only the replay, which decides what to stop.
        child = subprocess.Popen(
            [sys.executable, "-P", "-m", "worker.replay.transforms"],  # -P: see the module docstring
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,
        )
        self._child = child
        try:
            _write_frame(child, _LOAD, self.spec.encode("utf-8", "surrogateescape"))
            kind, payload = _read_frame(child, time.monotonic() + LOAD_TIMEOUT_S, self._should_stop)
        except _Overran:
            self._kill()
            raise UserError(f"--transform: {self.spec} did not load within {LOAD_TIMEOUT_S:g} s") from None
        except _Ended:
            code = self._kill()
            raise UserError(f"--transform: its process exited ({code}) while loading {self.spec}") from None
        except BaseException:
            self._kill()
            raise
        if kind != _READY:
            self._kill()
            raise UserError(payload.decode("utf-8", "replace"))

    def _running(self) -> subprocess.Popen[bytes]:
        if self._child is None:
            raise RuntimeError("the transform's process is not running")
        return self._child

    def _kill(self) -> int | None:
        """Kill the child (and anything it started) now; its exit code."""
        child, self._child = self._child, None
        if child is None:
            return None
        _kill_group(child)
        return child.returncode


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """Kill the child's process group (it and whatever it started) unless it exited; reap it, close its
    pipes."""
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            pipe.close()


class _Overran(Exception):
    """No complete answer before the deadline."""


class _Ended(Exception):
    """The other side closed its pipe (it exited, or was killed)."""


def _write_frame(child: subprocess.Popen[bytes], kind: bytes, payload: bytes) -> None:
    if child.stdin is None:
        raise _Ended
    try:
        _write_all(child.stdin.fileno(), _frame(kind, payload))
    except BrokenPipeError:
        raise _Ended from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_frame(
    child: subprocess.Popen[bytes], deadline: float, should_stop: Callable[[], bool]
) -> tuple[bytes, bytes]:
    """The child's next frame, waiting until `deadline`; TransformStopped as soon as `should_stop()`."""
    if child.stdout is None:
        raise _Ended
    fd = child.stdout.fileno()
    poller = select.poll()  # not select.select: no limit on the descriptor's number
    poller.register(fd, select.POLLIN)

    def readable() -> None:
        while True:
            if should_stop():
                raise TransformStopped
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Overran
            if poller.poll(min(remaining, STOP_CHECK_S) * 1000):
                return

    frame = _next_frame(fd, readable)
    if frame is None:
        raise _Ended
    return frame


def _next_frame(fd: int, readable: Callable[[], None]) -> tuple[bytes, bytes] | None:
    """The next frame on `fd`, or None when the other side closed it first. `readable` returns once `fd` can
    be read. Reads in large chunks, usually the whole frame at once: each side has at most one frame on its
    way to the other (one answer per value), so no read takes a part of the next one."""
    buffer = bytearray()
    needed = _HEADER.size
    while len(buffer) < needed:
        readable()
        chunk = os.read(fd, max(needed - len(buffer), _READ_SIZE))
        if not chunk:
            return None
        buffer += chunk
        if len(buffer) >= _HEADER.size:
            needed = _HEADER.size + _HEADER.unpack_from(buffer)[1]
    return bytes(buffer[:1]), bytes(buffer[_HEADER.size :])


# --- the child -------------------------------------------------------------------------------------------


def _serve() -> None:
    """The child: load the function the first frame names, then answer one frame per value until the replay
    closes the pipe."""
    # The replay decides when to stop (and kills this process); a terminal's Ctrl-C is not for us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests, answers = os.dup(0), os.dup(1)
    # The transform's own reads and prints never touch the frames: stdin is empty, stdout goes to stderr.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    _exit_with_parent(os.getppid())
    spec = _child_frame(requests)
    if spec is None:
        return
    try:
        function = load_transform(spec[1].decode("utf-8", "surrogateescape"))
    except UserError as error:
        _write_all(answers, _frame(_LOAD_FAILED, str(error).encode()))
        return
    except BaseException as problem:  # SystemExit in the module's own code, say
        _write_all(answers, _frame(_LOAD_FAILED, f"--transform: {describe_failure(problem)}".encode()))
        return
    _write_all(answers, _frame(_READY, b""))
    while (request := _child_frame(requests)) is not None:
        try:
            result = apply_transform(function, request[1])
        # The ops' code: any failure, even sys.exit(), is this record's failure only.
        except BaseException as problem:
            _write_all(answers, _frame(_FAILED, describe_failure(problem).encode()))
            continue
        _write_all(answers, _frame(_SKIP, b"") if result is None else _frame(_REPAIRED, result))


def _exit_with_parent(parent: int) -> None:
    """A replay killed with SIGKILL cannot end this process; a transform stuck in a loop would then spin on
    its own. A thread notices the new parent and leaves (pure Python loops give it the interpreter)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def _child_frame(fd: int) -> tuple[bytes, bytes] | None:
    """The next frame from the replay (waiting as long as it takes), or None when it closed the pipe."""
    return _next_frame(fd, lambda: None)


if __name__ == "__main__":
    _serve()
