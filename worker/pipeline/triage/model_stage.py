"""The model's part of the loop: waiting tickets go to the model, its answers come back as the answers to
write, and, with a cascade, unsure answers go on to the escalation stage first.

- `dispatch()`: hands waiting tickets to the model earliest deadline first (the `DispatchQueue`'s order), at
  most `window` at a time. While the model is busy, a ticket that cannot finish before its deadline given
  the model's recent latency is answered `overloaded` at once; with nothing at the model it is tried anyway
  (that costs no other ticket model time and keeps the estimate learning).
- `collect(wait_s)`: takes the model's answers (waiting up to `wait_s` for one) and the escalation stage's.
  Each answer for a ticket still owned is handed to `write`; an answer for an orphan (its partition left
  this worker) is discarded: its new owner redoes the ticket.
- With a cascade (`cascade.py`) the gate decides per unsure answer: escalate (the ticket's record waits for
  the escalation stage), or let the first answer stand.
- `fallback_for(work, reason)`: the answer for a ticket the model does not answer; the cascade is told when
  the first stage sheds load.
- `pending(keys)`, `give_up(keys)`: a partition leaving (a revoke, a loss, an exactly-once redo, which the
  guarantee reports through `Redone`): its waiting tickets are dropped, those at a model become orphans.

It never polls Kafka, produces or commits: those are the loop's and the guarantee's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from worker.classification import (
    Classification,
    Classifier,
    ClassifyRequest,
    FallbackLabel,
    fallback_answer,
    ticket_text,
)
from worker.kafka.commits import TopicPartitionKey
from worker.messages import FallbackReason, utc_timestamp
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.settlements.guarantees import Observer
from worker.pipeline.tracing import Attribute
from worker.pipeline.triage.cascade import Cascade
from worker.pipeline.triage.dispatch_queue import DispatchQueue
from worker.pipeline.triage.latency import LatencyEstimate
from worker.pipeline.triage.requests import ModelRequests
from worker.pipeline.work import Work

# Writes a ticket's answer: (the ticket, its answer, when it was made or "" for now).
WriteAnswer = Callable[[Work, Classification, str], None]


class ModelStage:
    """Between the dispatch queue and the records written; see the module docstring."""

    def __init__(
        self,
        classifier: Classifier,
        cascade: Cascade | None,
        window: int,
        fallback: FallbackLabel,
        queue: DispatchQueue,
        requests: ModelRequests,
        metrics: PipelineMetrics,
        clock: Callable[[], float],
        write: WriteAnswer,
    ) -> None:
        self._classifier, self._cascade = classifier, cascade
        self._window = max(1, window)
        self._fallback = fallback
        self._queue, self._requests = queue, requests
        self._metrics = metrics
        self._clock = clock
        self._write = write
        self._latency = LatencyEstimate()

    def described(self) -> dict[str, object]:
        """The stage's settings, for the pipeline's start line in the log."""
        cascade = self._cascade
        return {
            "dispatch_window": self._window,
            "model": self._classifier.model_id,
            "escalation": None if cascade is None else cascade.model_id,
            "escalate_below": None if cascade is None else cascade.escalate_below,
        }

    @property
    def orphans(self) -> int:
        return self._requests.orphans

    def __len__(self) -> int:
        """Tickets without an answer yet: waiting, at the model or at the escalation stage."""
        return len(self._queue) + len(self._requests)

    def room(self) -> int:
        """How many more tickets would go to the model at once."""
        return max(0, self._window - self._requests.at_model - len(self._queue))

    def pending(self, keys: set[TopicPartitionKey]) -> int:
        return self._queue.pending(keys) + self._requests.pending(keys)

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        self._queue.give_up(keys)
        self._requests.give_up(keys)

    def dispatch(self) -> None:
        while self._requests.at_model < self._window and (work := self._queue.next()) is not None:
            event = work.event
            assert event is not None  # only tickets wait for the model
            expected_s = self._latency.expected_s if self._requests.at_model else 0.0
            if self._clock() + expected_s >= work.deadline:
                self._write(work, self.fallback_for(work, "overloaded"), "")
                continue
            self._metrics.queue_wait.observe(self._clock() - work.polled_at, work.trace.trace_ids)
            request_id = self._requests.to_model(work)
            work.trace.begin("model", model=self._classifier.model_id)
            self._classifier.submit(
                ClassifyRequest(request_id, ticket_text(event.subject, event.body), work.deadline)
            )

    def collect(self, wait_s: float) -> None:
        """Take the answers of the model (waiting up to `wait_s` for one) and of the escalation stage."""
        if self._requests.at_model:
            self._take_answers(self._classifier.poll(wait_s))
            wait_s = 0.0
        if self._cascade is not None and self._requests.at_escalation:
            self._take_escalations(self._cascade, self._cascade.poll(wait_s, self._clock))

    def answer_now(self, works: Collection[Work], reason: FallbackReason) -> None:
        """Of `works`, those waiting for the model or at it are answered with the `reason` fallback now (their
        model answers, when they come, are discarded); those at the escalation stage keep their first answer
        (skipped: `deadline`). The others (answered already) are left as they are."""
        for work in self._queue.take_out(works):
            self._write(work, self.fallback_for(work, reason), "")
        at_model, escalated = self._requests.take_out(works)
        for work in at_model:
            work.trace.end("model", fallback=reason)
            self._write(work, self.fallback_for(work, reason), "")
        for work in escalated:
            assert self._cascade is not None and work.first is not None  # only a cascade escalates
            work.trace.end("escalation", fallback=reason)
            self._write(work, self._cascade.first_stands(work.first, "deadline"), "")

    def fallback_for(self, work: Work, reason: FallbackReason) -> Classification:
        self._metrics.fallback[reason] += 1
        if reason == "overloaded" and self._cascade is not None:
            self._cascade.first_stage_shed(self._clock())
        latency_ms = (self._clock() - work.polled_at) * 1000.0
        return fallback_answer(reason, self._fallback, self._classifier.model_id, latency_ms)

    def _take_answers(self, answers: Sequence[tuple[int, Classification]]) -> None:
        made_at = utc_timestamp() if answers else ""  # one clock read per batch, not per record
        for request_id, answer in answers:
            work = self._requests.answered(request_id)
            if work is None:
                continue
            self._metrics.model_latency.observe(answer.latency_ms / 1000.0, work.trace.trace_ids)
            self._latency.observe(answer)
            if work.orphan:
                self._metrics.discarded_after_revoke += 1
                continue
            if answer.fallback:
                self._metrics.fallback[answer.fallback_reason or "unknown"] += 1
            else:
                self._metrics.classified += 1
            written = (
                answer if self._cascade is None else self._escalate_or_stand(self._cascade, work, answer)
            )
            work.trace.end("model", **_answered(answer), escalated=written is None)
            if written is not None:  # None: at the escalation stage, its record waits for that answer
                self._write(work, written, made_at)

    def _escalate_or_stand(
        self, cascade: Cascade, work: Work, first: Classification
    ) -> Classification | None:
        """The cascade's gate for a ticket the first stage answered: the answer to write now, or None when
        the ticket went to the escalation stage (its record waits)."""
        assert work.event is not None
        if not cascade.unsure(first):
            return cascade.first_stands(first)
        now = self._clock()
        pressed = cascade.first_stage_pressed(
            now, len(self._queue), self._queue.earliest_deadline(), self._latency.expected_s
        )
        if (skipped := cascade.gate(work.deadline - now, now, pressed)) is not None:
            return cascade.first_stands(first, skipped)
        request_id = self._requests.to_escalation(work, first)
        work.trace.begin("escalation", model=cascade.model_id)
        cascade.submit(
            ClassifyRequest(request_id, ticket_text(work.event.subject, work.event.body), work.deadline),
            now,
            work.trace.trace_ids,
        )
        return None

    def _take_escalations(self, cascade: Cascade, answers: Sequence[tuple[int, Classification]]) -> None:
        made_at = utc_timestamp() if answers else ""
        for request_id, answer in answers:
            work = self._requests.escalation_answered(request_id)
            if work is None:
                continue
            if work.orphan:
                self._metrics.discarded_after_revoke += 1
                continue
            assert work.first is not None
            work.trace.end("escalation", **_answered(answer))
            self._write(work, cascade.escalated(work.first, answer), made_at)


def _answered(answer: Classification) -> dict[str, Attribute]:
    """What a model step's trace says of its answer: the model that gave it (an escalation stage's encoder
    when its LLM gave none), its confidence (bucketed by the tracer) and, for a fallback, why; never the
    ticket's text."""
    if answer.fallback:
        return {"model": answer.model, "fallback": answer.fallback_reason or "unknown"}
    if answer.out_of_scope:
        return {"model": answer.model, "confidence": answer.confidence, "out_of_scope": True}
    return {"model": answer.model, "confidence": answer.confidence}


class Redone(Observer):
    """An exactly-once redo seeks partitions back: their tickets not answered yet are read again, so none
    of them may be written now. Made before the model stage (the guarantee it reports to comes first)."""

    def __init__(self, queue: DispatchQueue, requests: ModelRequests) -> None:
        self._queue, self._requests = queue, requests

    def redone(self, keys: set[TopicPartitionKey]) -> None:
        self._queue.give_up(keys)
        self._requests.give_up(keys)
