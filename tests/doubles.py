"""Test doubles that more than one test module uses: stand-in classifiers, a Schema Registry that comes
back, a pipeline run on a thread and a broker check that always answers.

One-offs stay in their module; a double moves here once a second module needs the same behaviour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from worker.classification import Classification, ClassifyRequest, FallbackLabel, fallback_answer
from worker.decoding import RegistryUnavailable, decode_ticket
from worker.messages import TicketEvent
from worker.pipeline.engine import Engine
from worker.telemetry.server import Check


def instant_answer(model: str = "instant@test") -> Classification:
    return Classification(
        intent="card_arrival",
        priority="Low",
        confidence=0.9,
        scores={"card_arrival": 0.9},
        model=model,
        latency_ms=1.0,
        truncated=False,
    )


class InstantClassifier:
    """Answers every ticket at its next poll (`answer`: `instant_answer` unless a subclass says otherwise);
    a poll with nothing to answer waits a little, as a real classifier's does."""

    model_id = "instant@test"

    def __init__(self) -> None:
        self._asked: list[ClassifyRequest] = []
        self._lock = threading.Lock()

    def submit(self, request: ClassifyRequest) -> None:
        with self._lock:
            self._asked.append(request)

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        with self._lock:
            asked, self._asked = self._asked, []
        if not asked:
            time.sleep(min(timeout, 0.005))
        return [(request.request_id, self.answer(request)) for request in asked]

    def answer(self, request: ClassifyRequest) -> Classification:
        return instant_answer(self.model_id)


class HoldingClassifier(InstantClassifier):
    """Answers at once, except the tickets whose text contains "hold": those wait in `held` until
    `release()`, which answers them and holds nothing after."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[ClassifyRequest] = []
        self.holding = True

    def submit(self, request: ClassifyRequest) -> None:
        with self._lock:
            (self.held if self.holding and "hold" in request.text else self._asked).append(request)

    def release(self) -> None:
        with self._lock:
            self.holding = False
            self._asked.extend(self.held)
            self.held.clear()


class DyingClassifier(InstantClassifier):
    """Answers `model_error` for tickets whose text says `word`, the others at once: as a process pool answers
    a ticket whose worker process died under it (`process_died`), or, `died=False`, as the engine answers a
    ticket the model raised on."""

    fallback = FallbackLabel("unclassified", "Medium")

    def __init__(self, word: str = "die", died: bool = True) -> None:
        super().__init__()
        self._word, self._died = word, died

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        with self._lock:
            asked, self._asked = self._asked, []
        if not asked:
            time.sleep(min(timeout, 0.005))
        failed = fallback_answer("model_error", self.fallback, self.model_id, 1.0, process_died=self._died)
        return [
            (r.request_id, failed if self._word in r.text else instant_answer(self.model_id)) for r in asked
        ]


class RaisingClassifier(DyingClassifier):
    """Answers `model_error` without a process death (the model raised) for tickets whose text says
    "raise", the others at once."""

    def __init__(self) -> None:
        super().__init__("raise", died=False)


class FlakyRegistry:
    """A registry-format decoder whose registry is away until `answering`: every decode raises
    `RegistryUnavailable` (counted in `tries`), then decodes the plain JSON ticket."""

    def __init__(self) -> None:
        self.answering = False
        self.tries = 0

    def decode(self, value: bytes | None, topic: str) -> TicketEvent:
        if not self.answering:
            self.tries += 1
            raise RegistryUnavailable("outage", "schema registry unreachable: connection refused")
        return decode_ticket(value, 1 << 20)


class RecordingClassifier(InstantClassifier):
    """Answers at once and keeps the texts it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def submit(self, request: ClassifyRequest) -> None:
        self.texts.append(request.text)
        super().submit(request)


class Running:
    """`pipeline.run()` on a thread (the pipeline of consumer group `group`); `stop()` asks for the graceful
    shutdown and returns its exit code. `error` is what the run raised, if it did."""

    def __init__(self, pipeline: Engine, group: str = "") -> None:
        self.pipeline = pipeline
        self.group = group
        self.code: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.code = self.pipeline.run()
        except BaseException as error:
            self.error = error
            raise

    def join(self, timeout: float = 30.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the pipeline did not stop"

    def stop(self, timeout: float = 60.0) -> int | None:
        self.pipeline.request_stop()
        self.join(timeout)
        return self.code


class HealthyBroker:
    """What `WorkerProbes` asks of the broker watch: a broker that answers."""

    state = Check(True, "metadata answered")
