"""The simulated model, the Schema Registry, and the bytes of each input shape.

`SimModel` is a `Classifier` answering at virtual times: each try of a ticket does what the input's `fates`
say (answer after its latency, answer slowly — past the deadline the pool answers `deadline_exceeded` at the
deadline —, raise in the engine, or have its process die under it, and with it every request it had not
answered yet). The real pool answers both of the last two with a `model_error` fallback; the model
remembers which it was (`raised`, `died`), so that the checker can hold each door to what each means: an
engine error is the ticket's answer, a death is a reason to try again.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import Counter
from collections.abc import Sequence

import msgspec

from worker.classification import Classification, ClassifyRequest, FallbackLabel, fallback_answer
from worker.decoding import RegistryUnavailable, decode_ticket
from worker.messages import TicketEvent

from .clock import VirtualClock
from .schedule import ANSWER, DIE, RAISE, Input

FALLBACK = FallbackLabel("unclassified", "Medium")
MODEL_ID = "sim@test"
_TICKET = re.compile(r"\[T-(\d+)\]")
# A process death is noticed this long after the request (the pool sees the pipe close).
DEATH_NOTICED_S = 0.05


def ticket_id(index: int) -> str:
    return f"T-{index}"


def value_of(each: Input) -> bytes | None:
    """The record value of an input of `each.shape` (each names its index, so outputs map back to it)."""
    tid = ticket_id(each.index)
    body = f"[{tid}] my card never arrived"
    ticket: dict[str, object] = {"ticket_id": tid, "body": body}
    shape = each.shape
    if shape == "ticket_subject_only":
        ticket = {"ticket_id": tid, "body": "", "subject": body}
    elif shape == "deadline_future":
        ticket["metadata"] = {"deadline_at": "2999-01-01T00:00:00Z"}
    elif shape == "deadline_past":
        ticket["metadata"] = {"deadline_at": "2001-01-01T00:00:00Z"}
    elif shape == "deadline_past_lower":
        ticket["metadata"] = {"deadline_at": "2001-01-01t00:00:00z"}
    elif shape == "deadline_invalid":
        ticket["metadata"] = {"deadline_at": "tomorrow"}
    elif shape == "undecodable":
        return f"\xff\xfe{{not json {tid}".encode("latin-1")
    elif shape == "not_an_object":
        return msgspec.json.encode([tid, body])
    elif shape == "missing_ticket_id":
        ticket = {"body": body, "customer_id": tid}
    elif shape == "empty_ticket":
        ticket = {"ticket_id": tid, "body": "", "subject": ""}
    elif shape == "wrong_type":
        ticket = {"ticket_id": tid, "body": 42}
    elif shape == "oversized":
        ticket["body"] = body + " x" * 3000
    elif shape == "null_value":
        return None
    return msgspec.json.encode(ticket)


def key_of(each: Input) -> bytes:
    if each.shape == "big_key":
        return b"k" * 5000
    return f"customer-{each.index}".encode()


def headers_of(each: Input) -> list[tuple[str, bytes | None]]:
    if each.shape == "big_headers":
        return [(f"h{i}", b"v" * 1000) for i in range(30)] + [("traceparent", None)]
    return [("source", b"sim")]


class _World:
    """What every pool of one run shares: each ticket's tries (its fates go on across a hot reload: the
    same ticket makes the new model raise too), what happened to each, and whether the faults healed."""

    def __init__(self) -> None:
        self.tries: Counter[int] = Counter()
        self.raised: set[int] = set()
        self.died: set[int] = set()
        self.healed = False
        # Broken pool contracts: a request given to a pool after it was closed, a pool closed with
        # answers it still owed (`SwitchingClassifier` must retire a pool only once it has answered all).
        self.broken: list[str] = []


class SimModel:
    """A `Classifier` at virtual times (see the module docstring); `successor` is the pool a hot reload
    loads beside it."""

    def __init__(
        self,
        clock: VirtualClock,
        inputs: Sequence[Input],
        model_id: str = MODEL_ID,
        world: _World | None = None,
    ) -> None:
        self._clock = clock
        self._inputs = {each.index: each for each in inputs}
        self._due: list[tuple[float, int, int, int | None, Classification]] = []
        self._order = itertools.count()
        self.model_id = model_id
        self._world = world or _World()
        self.tries, self.raised, self.died = self._world.tries, self._world.raised, self._world.died
        self.closed = False

    @property
    def healed(self) -> bool:
        """Once healed, every try is answered at once (the run after the schedule), by every pool."""
        return self._world.healed

    @healed.setter
    def healed(self, value: bool) -> None:
        self._world.healed = value

    @property
    def broken(self) -> list[str]:
        return self._world.broken

    def successor(self, model_id: str) -> SimModel:
        """A new pool of `model_id` over the same tickets and the same world, as a worker's start or a hot
        reload opens one (what the pool before it still owed dies with it, or stays with it)."""
        return SimModel(self._clock, list(self._inputs.values()), model_id, self._world)

    def submit(self, request: ClassifyRequest) -> None:
        if self.closed:
            self.broken.append(f"{self.model_id} was given request {request.request_id} after it was closed")
        now = self._clock.peek()
        index = _index(request.text)
        each = self._inputs.get(index) if index is not None else None
        attempt = self.tries[index] if index is not None else 0
        if index is not None:
            self.tries[index] += 1
        fate = ANSWER
        latency = 0.01
        if each is not None:
            latency = each.latency_s
            if each.raises:
                fate = RAISE  # whatever the healing: the ticket itself makes the engine raise
            elif not self.healed and attempt < len(each.fates):
                fate = each.fates[attempt]
        if fate == RAISE:
            assert index is not None
            self.raised.add(index)
            self._answer(now + latency, request.request_id, index, self._fallback("model_error", latency))
        elif fate == DIE:
            self._die(now, request.request_id, index)
        else:
            if fate.startswith("slow:"):
                latency = float(fate.removeprefix("slow:"))
            if now + latency >= request.deadline:
                spent = max(0.0, request.deadline - now)
                self._answer(
                    request.deadline, request.request_id, index, self._fallback("deadline_exceeded", spent)
                )
            else:
                self._answer(now + latency, request.request_id, index, _answered(self.model_id, latency))

    def _die(self, now: float, request_id: int, index: int | None) -> None:
        """The process dies under this request: it and every request it had not answered yet are answered
        `model_error` once the pool notices (as `pool.py` answers a dead worker's requests)."""
        at = now + DEATH_NOTICED_S
        died = self._fallback("model_error", DEATH_NOTICED_S)
        pending = [entry for entry in self._due if entry[0] > at]
        self._due = [entry for entry in self._due if entry[0] <= at]
        heapq.heapify(self._due)
        for _, _, other, other_index, _ in [*pending, (at, 0, request_id, index, died)]:
            self._answer(at, other, other_index, died)
            if other_index is not None:
                self.died.add(other_index)

    def _answer(self, at: float, request_id: int, index: int | None, answer: Classification) -> None:
        heapq.heappush(self._due, (at, next(self._order), request_id, index, answer))

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        if not self._ready():
            next_due = self._due[0][0] if self._due else float("inf")
            self._clock.wait(min(timeout, max(0.0, next_due - self._clock.peek())))
        answers = []
        while self._ready():
            _, _, request_id, _, answer = heapq.heappop(self._due)
            answers.append((request_id, answer))
        return answers

    def _ready(self) -> bool:
        return bool(self._due) and self._due[0][0] <= self._clock.peek()

    def close(self) -> None:
        if self._due and not self.closed:
            owed = ", ".join(str(entry[2]) for entry in sorted(self._due))
            self.broken.append(f"{self.model_id} was closed owing answers to requests {owed}")
        self.closed = True

    def _fallback(self, reason: str, latency_s: float) -> Classification:
        return fallback_answer(reason, FALLBACK, self.model_id, latency_s * 1000.0)  # type: ignore[arg-type]


class SimRegistry:
    """A registry-format decoder whose registry is away while `answering` is False (`RegistryUnavailable`),
    and decodes the plain JSON ticket otherwise, as `tests/doubles.FlakyRegistry`."""

    def __init__(self, max_value_bytes: int) -> None:
        self.answering = True
        self._limit = max_value_bytes

    def decode(self, value: bytes | None, topic: str) -> TicketEvent:
        if not self.answering:
            raise RegistryUnavailable("outage", "schema registry unreachable: connection refused")
        return decode_ticket(value, self._limit)


def _index(text: str) -> int | None:
    found = _TICKET.search(text)
    return int(found.group(1)) if found else None


def _answered(model_id: str, latency_s: float) -> Classification:
    return Classification(
        intent="card_arrival",
        priority="Low",
        confidence=0.9,
        scores={"card_arrival": 0.9},
        model=model_id,
        latency_ms=latency_s * 1000.0,
        truncated=False,
    )
