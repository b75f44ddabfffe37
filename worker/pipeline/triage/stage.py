"""The triage stage: a taken record becomes a ticket, the model answers it, and its triage record or dead
letter is written — the same for every door that classifies (`run` in both modes, `classify`, `model eval`).

- `admit(record)`: in a Schema Registry format (`input.format`) the value is decoded *before* the record is
  taken, so that one the registry cannot answer for is not taken at all (`unavailable`: the loop's
  registry wait holds it back); a key over `MAX_KEY_BYTES` is not even decoded (it is dead-lettered unread).
- `take(work, admission, answer_now)`: the record becomes a ticket with its deadline (`intake.py`), or a dead
  letter; a ticket whose deadline passed already is answered `expired_on_arrival`, one its source cannot wait
  for is answered at once (`answer_now`), any other waits for the model (`dispatch_queue.py`).
- `serve(wait_s)`: the model's answers (and the cascade's escalations, `model_stage.py`), tickets whose
  deadline passed while they waited (`overloaded`), dispatch, the side topics.
- An answer is written as the ticket's triage record (`outputs.py`), unless the model process died under it
  (`Classification.process_died`, not a model that raised) and its source gives it another try
  (`seams.HandBack`: queue mode releases it while it has deliveries left, and dead-letters it on its last).

Whatever a library raises on a record is a dead letter (`internal_error`): no record may stop the worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from worker.classification import Classification
from worker.decoding import DecodeError, RegistryUnavailable
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.dead_letters import DELIVERY_COUNT_EXCEEDED
from worker.messages import FallbackReason, TicketEvent
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.seams import HandBack, Record
from worker.pipeline.side_topics.side_topic import ResultWatcher
from worker.pipeline.triage.dispatch_queue import DispatchQueue
from worker.pipeline.triage.intake import MAX_KEY_BYTES, Intake, TicketDecoding
from worker.pipeline.triage.model_stage import ModelStage
from worker.pipeline.triage.outputs import Outputs
from worker.pipeline.triage.requests import ModelRequests
from worker.pipeline.work import Work


@dataclass(frozen=True, slots=True)
class TicketAdmission:
    """What `admit` made of a record: decoded by the registry-aware decoder (`decoded`; None: plain JSON,
    decoded on take), or not now (`unavailable`: why the registry cannot answer)."""

    decoded: TicketEvent | DecodeError | None = None
    unavailable: RegistryUnavailable | None = None


class TriageStage:
    """Between the source and the settlement for tickets (see the module docstring). `model` answers
    through `answered` (built by the assembly with this stage's queue and requests); `hand_back` is the
    source's."""

    def __init__(
        self,
        intake: Intake,
        decoder: TicketDecoding | None,
        queue: DispatchQueue,
        requests: ModelRequests,
        outputs: Outputs,
        side_topics: Sequence[ResultWatcher],
        hand_back: Callable[[Work], HandBack],
        metrics: PipelineMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._intake, self._decoder = intake, decoder
        self._queue, self._requests = queue, requests
        self._outputs = outputs
        self._side_topics = side_topics
        self._hand_back = hand_back
        self._metrics = metrics
        self._clock = clock
        self._model: ModelStage | None = None

    def attach(self, model: ModelStage) -> None:
        """The model stage, built with `answered` as its writer."""
        self._model = model

    @property
    def model(self) -> ModelStage:
        assert self._model is not None  # attached by the assembly
        return self._model

    # -- seams.Stage ----------------------------------------------------------------------------------------

    def admit(self, record: Record) -> TicketAdmission:
        if self._decoder is None or (record.key is not None and len(record.key) > MAX_KEY_BYTES):
            return TicketAdmission()
        try:
            return TicketAdmission(self._decoder.decode(record.value, record.topic))
        except DecodeError as problem:
            return TicketAdmission(problem)  # the registry answered (or was not needed): a dead letter
        except RegistryUnavailable as unavailable:
            return TicketAdmission(unavailable=unavailable)

    def take(self, work: Work, record: Record, admission: TicketAdmission) -> None:
        now = work.polled_at
        work.trace.begin("decode")
        rejected = record.rejected or self._intake.ticket(work, admission.decoded, now, time.time())
        work.trace.end("decode")
        if rejected is not None:
            self._outputs.dead_letter(work, *rejected)
            return
        if work.deadline <= now:  # the producer's deadline_at passed already: no model time, not `overloaded`
            self._outputs.result(work, self.model.fallback_for(work, "expired_on_arrival"))
            return
        if record.answer_now is not None:
            self._outputs.result(work, self.model.fallback_for(work, record.answer_now))
            return
        self._queue.wait(work)

    def cannot_hold(self, work: Work, unavailable: RegistryUnavailable) -> None:
        self._last_delivery_dead_letter(work, f"the Schema Registry gave no answer about it ({unavailable})")

    def answer_now(self, works: Collection[Work], reason: FallbackReason) -> None:
        self.model.answer_now(works, reason)

    def serve(self, wait_s: float) -> None:
        model = self.model
        if self._requests:
            model.collect(wait_s)
        # Tickets whose deadline passed while they waited for the model get `overloaded`, without it.
        for work in self._queue.expired(self._clock()):
            self._outputs.result(work, model.fallback_for(work, "overloaded"))
        model.dispatch()
        for side in self._side_topics:
            side.serve()

    @property
    def busy(self) -> bool:
        return len(self._requests) > 0

    def room(self) -> int:
        return self.model.room()

    def __len__(self) -> int:
        return len(self.model) - self._requests.orphans

    @property
    def orphans(self) -> int:
        return self._requests.orphans

    def first(self, keys: set[TopicPartitionKey]) -> None:
        self._queue.first_to_model(keys)

    def pending(self, keys: set[TopicPartitionKey]) -> int:
        return self.model.pending(keys)

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        self.model.give_up(keys)

    def close(self, flush_s: float) -> None:
        deadline = self._clock() + flush_s
        for side in self._side_topics:
            side.close(max(0.0, deadline - self._clock()))

    def described(self) -> dict[str, object]:
        return self.model.described()

    def where(self) -> list[int]:
        return [len(self._queue), self._requests.at_model, self._requests.at_escalation]

    # -- answers --------------------------------------------------------------------------------------------

    def answered(self, work: Work, answer: Classification, made_at: str) -> None:
        """The model stage's answer for `work`: written, unless its model process died under it
        (`process_died`) and its source gives it another try, or dead-letters it on its last. A model that
        raised (`model_error` without a death) is answered `model_error` in every door: another try would
        raise again."""
        if answer.fallback and answer.fallback_reason == "model_error" and answer.process_died:
            outcome = self._hand_back(work)
            if outcome is HandBack.RELEASED:
                work.trace.outcome("given_up", "the model process died under it: released for another try")
                work.trace.finish()
                return
            if outcome is HandBack.DEAD_LETTER:
                self._last_delivery_dead_letter(work, "the model process died under it")
                return
        self._outputs.result(work, answer, made_at)

    def _last_delivery_dead_letter(self, work: Work, why: str) -> None:
        """A record on its last delivery that cannot be answered: dead-lettered rather than archived by the
        broker without a trace (`triage-worker replay` brings it back)."""
        if self._metrics.queue is not None:
            self._metrics.queue.delivery_count_exceeded += 1
        self._outputs.dead_letter(work, DELIVERY_COUNT_EXCEEDED, f"{why} on its last delivery")
