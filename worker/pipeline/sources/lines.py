"""The offline doors' source: lines of a file or stdin (`classify --input`), or a list of texts (`model
eval`), each line a record at its line index.

- **Read as a stream**, on a thread of its own (`LineReader`), so that a wait for the next line (stdin from a
  pipe) never holds back a result that is ready; at most `READ_AHEAD` lines are read ahead, and one line at
  most `max_value_bytes` (a longer one is read past a chunk at a time, never held whole, and rejected:
  `Record.rejected`), so neither a large file nor one without newlines (`/dev/zero`) can take the memory.
  Blank lines are skipped.
- **Paced by the model**: a line is read only when the model has room for it (`Limits.paced_by_model`), so
  each ticket's deadline starts when it is sent; offline, nothing else competes for the cores.
- **Finite**: once the reader reached the end and every line is settled, the loop ends (`exhausted`).

Nothing to commit, pause or hold back: the settlement writes each line's outcome in input order
(`settlements/in_order.py`), which is also what counts as in flight.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import IO

from worker.errors import UserError
from worker.pipeline.seams import Loop, Record
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.sources.without_group import WithoutGroup
from worker.pipeline.work import Work

# Where an offline result says its ticket came from: topic `cli`, partition 0, offset = the line's index.
SOURCE_TOPIC = "cli"
# Lines read ahead of the model, so that it never waits for the reading.
READ_AHEAD = 16
# How much of an over-long line is read at a time while it is skipped.
_SKIP_CHUNK_BYTES = 1 << 16

# (index, the line or its first bytes, why it was not read whole: a dead letter's type and message)
Line = tuple[int, bytes, tuple[str, str] | None]


def stream_lines(source: IO[bytes], limit: int) -> Iterator[Line]:
    """(index, line, None) for each line of `source` that is not blank; a line over `limit` bytes comes as
    (index, its first bytes, why) as soon as it is known to be too long, and is then read past a chunk at a
    time."""
    for index in itertools.count():
        line = source.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            if line.strip():
                yield index, line, None
            continue
        why = f"line is over the {limit}-byte limit (pipeline.max_value_bytes)"
        yield index, line[:limit], ("too_large", why)
        while line and not line.endswith(b"\n"):
            line = source.readline(_SKIP_CHUNK_BYTES)


class LineReader:
    """`lines`, read on a thread of their own, at most `READ_AHEAD` ahead; `name` for errors."""

    def __init__(self, lines: Iterator[Line], name: str) -> None:
        self.name = name
        self._queue: queue.Queue[Line | Exception | None] = queue.Queue(READ_AHEAD)
        self._closed = threading.Event()
        self._peeked: list[Line] = []
        self.ended = False
        threading.Thread(target=self._read, args=(lines,), name="lines-reader", daemon=True).start()

    def get(self, timeout: float | None) -> Line | None:
        """The next line, waiting up to `timeout` seconds (None: until there is one or the input ended); None
        when there is none yet, or no more (`ended`)."""
        if self._peeked:
            return self._peeked.pop(0)
        return self._next(timeout)

    def _next(self, timeout: float | None) -> Line | None:
        while not self.ended:
            try:
                item = self._queue.get(timeout=0.2 if timeout is None else timeout)
            except queue.Empty:
                if timeout is None:
                    continue
                return None
            if isinstance(item, OSError):
                raise UserError(f"cannot read {self.name}: {item.strerror or item}")
            if isinstance(item, Exception):
                raise item
            if item is not None:
                return item
            self.ended = True
        return None

    def first(self, readable: Callable[[Line], bool]) -> bool:
        """Read until a line is `readable` (kept for `get`): True; False when the input ends first. The lines
        before it are dropped (`readable` reported them as it read them)."""
        while (line := self._next(None)) is not None:
            if readable(line):
                self._peeked.append(line)
                return True
        return False

    @property
    def drained(self) -> bool:
        return self.ended and not self._peeked

    def close(self) -> None:
        """The reading thread stops at its next line (or at once when it waits to hand one over)."""
        self._closed.set()

    def _read(self, lines: Iterator[Line]) -> None:
        end: Exception | None = None  # None: the end of the input
        try:
            for line in lines:
                if not self._put(line):
                    return
        except Exception as error:  # handed to the loop's thread, which says so
            end = error
        self._put(end)

    def _put(self, item: Line | Exception | None) -> bool:
        while not self._closed.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.2)
                return True
        return False


class LinesSource(WithoutGroup):
    """The lines of a `LineReader` as records (see the module docstring); `held()` is the settlement's count
    of lines taken and not yet written. Outside any group (`WithoutGroup`): offline lines need no registry."""

    def __init__(self, reader: LineReader, held: Callable[[], int]) -> None:
        self._reader = reader
        self._held = held
        self._state = PartitionOffsets((SOURCE_TOPIC, 0))
        self._taking = True

    def open(self, loop: Loop) -> None:
        pass

    def may_take(self) -> bool:
        return self._taking and not self._reader.drained

    def read(self, room: int, wait_s: float, take: Callable[[Record], None]) -> None:
        for count in range(room):
            # Wait for a line only when there is nothing else to wait for.
            line = self._reader.get(wait_s if count == 0 and not self._held() else 0.0)
            if line is None:
                return
            index, value, unread = line
            take(Record(SOURCE_TOPIC, 0, index, None, value, None, rejected=unread))

    def work(self, record: Record, now: float, deadline: float) -> Work | None:
        return record.taken(self._state, now, deadline)

    def in_flight(self) -> int:
        return self._held()

    @property
    def exhausted(self) -> bool:
        return self._reader.drained

    def stop_taking(self) -> None:
        self._taking = False

    def stop(self, limit: float) -> None:
        self._reader.close()

    def described(self) -> dict[str, object]:
        return {"input": self._reader.name}
