"""A slow model for tests: every classification first waits a fixed delay, as a slow model's steps would.

A deadline that passes during the wait gives `deadline_exceeded`, like a deadline checked between model
steps. Three ways in:
- in this process: `install(seconds)` (undo with the returned function);
- in a process pool's workers: `ProcessPool(..., initializer=functools.partial(install_for_good, seconds))`;
- a whole worker: `python tests/slow_model.py SECONDS run ...` runs `triage-worker run ...`; its pool's
  processes (spawned) re-import this script as their main module, so they install the delay too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import msgspec

from worker.classification import Classification, ClassifyRequest
from worker.inference.engine import Context, GenAIEngine

# Waits are cut into slices so that a deadline interrupts them promptly.
_SLICE_S = 0.005


def install(seconds: float) -> Callable[[], None]:
    """Slow down every `Context.classify` of this process by `seconds`; returns the undo."""
    original = Context.classify

    def classify(self: Context, request: ClassifyRequest) -> Classification:
        started = time.monotonic()
        until = started + seconds
        while (now := time.monotonic()) < until:
            if now >= request.deadline:
                return self.engine.fallback("deadline_exceeded", started)
            time.sleep(min(_SLICE_S, until - now))
        answer = original(self, request)
        # The answer's latency includes the delay, as a slow model's would.
        return msgspec.structs.replace(answer, latency_ms=(time.monotonic() - started) * 1000.0)

    Context.classify = classify  # type: ignore[method-assign]

    def undo() -> None:
        Context.classify = original  # type: ignore[method-assign]

    return undo


def install_for_good(seconds: float) -> None:
    """`install` for the life of this process: a pool's `initializer`, which returns nothing."""
    install(seconds)


def raise_for_good(word: str) -> None:
    """For the life of this process, the model raises on every ticket whose text holds `word` (its process
    lives on): a pool's `initializer`, as `install_for_good`."""
    original = GenAIEngine.prepare

    def prepare(self: GenAIEngine, text: str) -> tuple[list[int], bool]:
        if word in text:
            raise RuntimeError(f"the model raised on a ticket with {word!r}")
        return original(self, text)

    GenAIEngine.prepare = prepare  # type: ignore[method-assign]


if __name__ in ("__main__", "__mp_main__"):  # the worker and, re-imported, its pool's processes
    install(float(sys.argv[1]))
if __name__ == "__main__":
    from worker.cli.cli import main

    sys.exit(main(sys.argv[2:]))
