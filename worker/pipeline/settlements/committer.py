"""Offset commits on a thread of their own, so that their confirmations never depend on polling the consumer.

A confirmed commit is what frees in-flight slots (see `offsets.py`). An asynchronous commit's confirmation
is only delivered inside `consumer.consume()`, and a consume call hands over records too: at the in-flight
bound the loop would have to pause its partitions to poll safely, and librdkafka restarts a resumed
partition's fetcher only at its broker thread's next wake-up, about a second later (measured here: 950 ms).
With a model faster than that, every pause/resume cycle left the model idle for most of a second. Here a
blocking commit runs on this thread and the loop picks up its outcome with `results()`, so the loop can wait
for free slots without polling, and pauses only when the bound holds for long (a slow model).

Contract: at most one commit is outstanding (`busy`); `submit` while busy is a programming error. The loop
owns the offset tracker, so outcomes are only *reported* here and applied by the loop. A commit from this
thread waits while the loop is inside a rebalance callback (measured: it only completes once the callback
returns), so the loop does not poll while a commit is on its way, and commits on revoke from its own thread.

What a commit *is* is given by the caller: a group commit (at-least-once) or a transaction's commit
(exactly-once); both are in `worker/kafka/commits.py`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

from worker.kafka.commits import CommitCall, CommitOutcome, TopicPartitionKey


class Committing(Protocol):
    """What a guarantee asks of its committer (`Committer` below; a deterministic test may give one that
    commits on the loop's thread, `GuaranteeWiring.committer`)."""

    @property
    def busy(self) -> bool: ...

    def submit(self, positions: dict[TopicPartitionKey, int]) -> None: ...

    def results(self) -> list[CommitOutcome]: ...

    def wait_idle(self, timeout: float) -> bool: ...

    def close(self, timeout: float = 5.0) -> None: ...


# Makes a guarantee's committer for its commit call (`Committer`: a thread of its own).
CommitterFactory = Callable[[CommitCall], Committing]


class Committer:
    """Runs a blocking `commit` on a daemon thread, one commit at a time."""

    def __init__(self, commit: CommitCall) -> None:
        self._commit = commit
        self._requests: queue.SimpleQueue[dict[TopicPartitionKey, int] | None] = queue.SimpleQueue()
        self._outcomes: queue.SimpleQueue[CommitOutcome] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._serve, name="offset-committer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A commit was submitted and its outcome has not been produced yet."""
        return not self._idle.is_set()

    def submit(self, positions: dict[TopicPartitionKey, int]) -> None:
        """Commit `positions` (next offset to read, per partition) in the background."""
        if self.busy:
            raise RuntimeError("a commit is already outstanding")
        self._idle.clear()
        self._requests.put(positions)

    def results(self) -> list[CommitOutcome]:
        """Outcomes that arrived since the last call (never blocks)."""
        outcomes = []
        while True:
            try:
                outcomes.append(self._outcomes.get_nowait())
            except queue.Empty:
                return outcomes

    def wait_idle(self, timeout: float) -> bool:
        """Until the outstanding commit (if any) has its outcome; False when it is still running."""
        return self._idle.wait(max(0.0, timeout))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after the outstanding commit; call before closing the consumer."""
        self._requests.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while (positions := self._requests.get()) is not None:
            try:
                self._outcomes.put(self._commit(positions))
            finally:
                self._idle.set()
