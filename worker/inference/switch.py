"""A `Classifier` whose pool can be replaced while tickets flow (hot reload), without the pipeline noticing.

A new pool is loaded, warmed and checked elsewhere (on a background thread: that takes seconds, and the
consumer loop must keep polling meanwhile) and handed over with `stage`. The consumer's thread adopts it at
its next call: new tickets go to the new pool, tickets already at the old one are answered there (each
request id remembers its pool), and the old pool is closed once it has none left, on a thread of its own
(closing waits for its processes). Every pool answers each of its requests exactly once, so nothing is
lost or answered twice across a switch.

Only the consumer's thread calls `model_id`, `submit` and `poll` (the `Classifier` contract); `stage` and
`close` may come from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from worker.classification import ClassifyRequest
from worker.inference.pool import ClassifierPool, Result

log = structlog.get_logger(__name__)


class SwitchingClassifier:
    """The current pool plus the retired ones that still owe answers."""

    def __init__(self, pool: ClassifierPool, closer: Callable[[ClassifierPool], None] | None = None) -> None:
        """`closer` closes a pool that is done (default: on a new daemon thread, off the consumer's)."""
        self._current = pool
        self._retired: list[ClassifierPool] = []
        self._owner: dict[int, ClassifierPool] = {}  # request id -> the pool that has it
        self._staged: ClassifierPool | None = None
        self._lock = threading.Lock()  # guards `_staged` and `_closed` (the only state other threads touch)
        self._closed = False
        self._closer = closer or _close_in_background

    @property
    def model_id(self) -> str:
        """The model new tickets go to (the pipeline puts it on the fallbacks it makes itself)."""
        self._adopt()
        return self._current.model_id

    @property
    def current(self) -> ClassifierPool:
        """The pool new tickets go to, without adopting a staged one (any thread may read it)."""
        return self._current

    def stage(self, pool: ClassifierPool) -> None:
        """Make `pool` (loaded, warm, checked) the one new tickets go to, from the next call on."""
        with self._lock:
            if self._closed:
                superseded: ClassifierPool | None = pool
            else:
                superseded, self._staged = self._staged, pool
        if superseded is not None:  # staged twice before the loop came by, or staged after close
            self._closer(superseded)

    def submit(self, request: ClassifyRequest) -> None:
        self._adopt()
        self._current.submit(request)
        self._owner[request.request_id] = self._current

    def poll(self, timeout: float) -> list[Result]:
        self._adopt()
        results: list[Result] = []
        for pool in self._retired:
            results.extend(pool.poll(0.0))
        # Wait on the current pool only when the retired ones had nothing ready.
        results.extend(self._current.poll(0.0 if results else timeout))
        for request_id, _ in results:
            self._owner.pop(request_id, None)
        if self._retired:
            self._close_finished()
        return results

    def close(self) -> None:
        """Close every pool (at shutdown); a pool staged later is closed at once."""
        with self._lock:
            self._closed = True
            staged, self._staged = self._staged, None
        for pool in (self._current, *self._retired, *([staged] if staged else [])):
            pool.close()
        self._retired = []

    def _adopt(self) -> None:
        if self._staged is None:  # the common case, without the lock
            return
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        old, self._current = self._current, staged
        self._retired.append(old)
        log.info(
            "model_switched",
            model=staged.model_id,
            previous=old.model_id,
            previous_in_flight=sum(1 for pool in self._owner.values() if pool is old),
        )
        self._close_finished()

    def _close_finished(self) -> None:
        busy = set(map(id, self._owner.values()))
        for pool in [pool for pool in self._retired if id(pool) not in busy]:
            self._retired.remove(pool)
            log.info("old_pool_closing", model=pool.model_id)
            self._closer(pool)


def _close_in_background(pool: ClassifierPool) -> None:
    threading.Thread(target=pool.close, name="close-retired-pool", daemon=True).start()
