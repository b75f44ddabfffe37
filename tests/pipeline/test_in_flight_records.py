"""Where each taken record is: waiting for the model (DispatchQueue), at the model (ModelRequests), at the
producer or held for order (Deliveries, the guarantee's); and what happens to it when its partition leaves."""

from __future__ import annotations

import pytest

from worker.classification import FallbackLabel, fallback_answer
from worker.messages import TicketEvent
from worker.pipeline.seams import Settlement
from worker.pipeline.settlements.deliveries import Deliveries
from worker.pipeline.settlements.in_order import InOrder
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.triage.dispatch_queue import DispatchQueue
from worker.pipeline.triage.requests import ModelRequests
from worker.pipeline.work import Output, Work
from worker.settings import Scheduling

A, B = ("tickets", 0), ("tickets", 1)


def _work(key: tuple[str, int], offset: int, deadline: float = 100.0) -> Work:
    return Work(
        state=PartitionOffsets(key),
        topic=key[0],
        partition=key[1],
        offset=offset,
        key=None,
        headers=None,
        polled_at=0.0,
        deadline=deadline,
        event=TicketEvent(ticket_id=f"T-{offset}", body="where is my card?"),
    )


def test_a_record_goes_from_waiting_to_the_model_to_the_broker_and_out() -> None:
    queue, requests, deliveries = DispatchQueue(), ModelRequests(), Deliveries()
    work = _work(A, 0)
    queue.wait(work)
    assert queue.pending({A}) == 1 and len(queue) == 1
    assert queue.next() is work and len(queue) == 0
    request_id = requests.to_model(work)
    assert requests.at_model == 1 and requests.pending({A}) == 1
    assert requests.answered(request_id) is work
    assert requests.answered(request_id) is None  # an answer counts once
    delivery_id = deliveries.to_broker(work)
    assert deliveries.pending({A}) == 1 and len(deliveries) == 1
    assert deliveries.delivered(delivery_id) is work
    assert len(deliveries) == 0 and deliveries.pending({A}) == 0 and len(requests) == 0


def test_an_escalated_ticket_keeps_the_first_answer_until_the_escalation_answers() -> None:
    requests = ModelRequests()
    work = _work(A, 0)
    first_id = requests.to_model(work)
    assert requests.answered(first_id) is work
    first = fallback_answer("model_error", FallbackLabel("other", "Medium"), "first-stage", 5.0)
    escalation_id = requests.to_escalation(work, first)
    assert work.first is first and requests.at_escalation == 1 and requests.pending({A}) == 1
    assert requests.escalation_answered(escalation_id) is work and len(requests) == 0


def test_waiting_records_go_to_the_model_earliest_deadline_first_ties_in_arrival_order() -> None:
    queue = DispatchQueue()
    loose, tight, tie_1, tie_2 = (_work(A, i, deadline) for i, deadline in enumerate((9.0, 1.0, 5.0, 5.0)))
    for work in (loose, tight, tie_1, tie_2):
        queue.wait(work)
    assert [queue.next() for _ in range(5)] == [tight, tie_1, tie_2, loose, None]


def test_fifo_scheduling_keeps_arrival_order_whatever_the_deadlines() -> None:
    queue = DispatchQueue("fifo")
    works = [_work(A, i, deadline) for i, deadline in enumerate((9.0, 1.0, 5.0))]
    for work in works:
        queue.wait(work)
    assert [queue.next() for _ in works] == works


@pytest.mark.parametrize("scheduling", ["edf", "fifo"])
def test_expired_takes_out_late_records_earliest_first_and_keeps_the_rest(scheduling: Scheduling) -> None:
    queue = DispatchQueue(scheduling)
    late_2, on_time, late_1 = _work(A, 0, deadline=2.0), _work(A, 1, deadline=9.0), _work(B, 5, deadline=1.0)
    for work in (late_2, on_time, late_1):
        queue.wait(work)
    assert queue.expired(now=0.5) == []
    assert queue.expired(now=5.0) == [late_1, late_2]
    assert len(queue) == 1 and queue.pending({B}) == 0
    assert queue.next() is on_time and queue.next() is None
    assert queue.expired(now=10.0) == []  # served records never expire later


def test_every_waiting_record_comes_out_once_served_or_expired() -> None:
    queue = DispatchQueue()
    out: list[Work | None] = []
    for i in range(10_000):
        queue.wait(_work(A, i, deadline=float(i % 7)))
        if i % 3 == 0:
            out.append(queue.next())
        out += queue.expired(now=float(i % 5))
    while (work := queue.next()) is not None:
        out.append(work)
    assert sorted(work.offset for work in out if work is not None) == list(range(10_000))
    assert len(queue) == 0 and queue.expired(now=100.0) == []


def test_records_of_a_revoked_partition_go_to_the_model_first() -> None:
    queue = DispatchQueue()
    works = [_work(A, 0), _work(B, 0), _work(A, 1), _work(B, 1)]
    for work in works:
        queue.wait(work)
    queue.first_to_model({B})
    assert [queue.next() for _ in works] == [works[1], works[3], works[0], works[2]]


def test_a_revoked_partition_goes_first_even_before_earlier_deadlines_and_after_a_later_arrival() -> None:
    queue = DispatchQueue()
    urgent, leaving = _work(A, 0, deadline=1.0), _work(B, 0, deadline=50.0)
    queue.wait(urgent)
    queue.wait(leaving)
    queue.first_to_model({B})
    later = _work(A, 1, deadline=0.5)  # taken after the revoke began: its partition is staying
    queue.wait(later)
    assert [queue.next() for _ in range(3)] == [leaving, later, urgent]


def test_giving_up_a_partition_drops_waiting_records_and_orphans_the_rest_until_they_come_back() -> None:
    queue, requests, deliveries = DispatchQueue(), ModelRequests(), Deliveries()
    waiting, at_model, at_broker, other = _work(A, 2), _work(A, 0), _work(A, 1), _work(B, 0)
    request_id = requests.to_model(at_model)
    delivery_id = deliveries.to_broker(at_broker)
    queue.wait(waiting)
    queue.wait(other)
    assert queue.give_up({A}) == 1  # the waiting one: the next owner reads it again
    requests.give_up({A})
    assert deliveries.give_up({A}) == 0  # nothing held: nothing dropped, the produced one is an orphan
    assert requests.orphans == 1 and deliveries.orphans == 1
    assert at_model.orphan and at_broker.orphan and not other.orphan
    assert requests.pending({A}) + deliveries.pending({A}) + queue.pending({A}) == 0
    assert queue.pending({B}) == 1
    assert requests.answered(request_id) is at_model and requests.orphans == 0
    assert deliveries.delivered(delivery_id) is at_broker and deliveries.orphans == 0
    assert queue.give_up({A}) == 0  # nothing left of A; B untouched
    assert queue.next() is other


def test_a_replaced_producer_forgets_its_reports_and_their_orphans() -> None:
    deliveries = Deliveries()
    orphan, kept = _work(A, 0), _work(B, 0)
    deliveries.to_broker(orphan)
    deliveries.to_broker(kept)
    deliveries.give_up({A})
    deliveries.forget_produced()
    assert len(deliveries) == 0 and deliveries.orphans == 0


def _taken(ledger: Deliveries | Settlement, state: PartitionOffsets, offsets: range) -> list[Work]:
    works = []
    for offset in offsets:
        work = _work(state.key, offset)
        work.state = state
        ledger.taken(work)
        works.append(work)
    return works


def _output(offset: int) -> Output:
    return Output("tickets.triaged", None, f"result {offset}".encode(), None)


def test_in_order_an_output_waits_for_every_earlier_record_of_its_partition() -> None:
    """Exactly-once: a transaction may only hold outputs whose offsets it commits."""
    ledger = Deliveries(in_order=True)
    a, b = PartitionOffsets(A), PartitionOffsets(B)
    first, second, third = _taken(ledger, a, range(3))
    [other] = _taken(ledger, b, range(1))
    ledger.hold(third, _output(2))
    ledger.hold(second, _output(1))
    ledger.hold(other, _output(0))
    # Partition B's only record goes at once; A's wait for offset 0, which is still at the model.
    assert ledger.release() == [other]
    assert ledger.held == 2 and ledger.pending({A}) == 2 and len(ledger) == 2
    ledger.hold(first, _output(0))
    assert ledger.release() == [first, second, third]
    assert ledger.held == 0 and ledger.release() == []


def test_in_order_giving_up_a_partition_drops_its_held_outputs() -> None:
    ledger = Deliveries(in_order=True)
    a, b = PartitionOffsets(A), PartitionOffsets(B)
    head, held = _taken(ledger, a, range(2))
    [other] = _taken(ledger, b, range(1))
    ledger.hold(held, _output(1))
    ledger.hold(other, _output(0))
    assert ledger.give_up({A}) == 1  # the held output; its next owner redoes it
    assert ledger.pending({A}) == 0 and ledger.held == 1
    assert ledger.release() == [other]
    assert head.output is None and len(ledger) == 0


def test_without_order_nothing_is_held_back() -> None:
    ledger = Deliveries()
    state = PartitionOffsets(A)
    _taken(ledger, state, range(2))
    assert ledger.release() == [] and len(ledger) == 0


def test_in_order_release_of_one_partition_leaves_the_others_held() -> None:
    ledger = Deliveries(in_order=True)
    a, b = PartitionOffsets(A), PartitionOffsets(B)
    [on_a] = _taken(ledger, a, range(1))
    [on_b] = _taken(ledger, b, range(1))
    ledger.hold(on_a, _output(0))
    ledger.hold(on_b, _output(0))
    assert ledger.release(b) == [on_b]
    assert ledger.held == 1 and ledger.release(a) == [on_a]


def test_in_order_a_record_that_needs_no_output_holds_its_partition_back_no_longer() -> None:
    """Exactly-once replay: a dead letter passed over (filtered out) writes nothing; the republished ones
    after it must still go out."""
    ledger = Deliveries(in_order=True)
    passed_over, republished = _taken(ledger, PartitionOffsets(A), range(2))
    ledger.hold(republished, _output(1))
    assert ledger.release() == []  # behind offset 0, whose outcome is not known yet
    ledger.without_output(passed_over)
    assert ledger.release() == [republished] and ledger.held == 0


def test_in_input_order_a_record_that_needs_no_output_lets_the_outputs_behind_it_out() -> None:
    """A replay's dry run settles through InOrder: what it passes over is done, and its position moves."""
    delivered: list[int] = []
    settlement = InOrder(lambda work, _output: delivered.append(work.offset))
    state = PartitionOffsets(A)
    passed_over, listed = _taken(settlement, state, range(2))
    for work in (passed_over, listed):
        state.track(work.offset)
    settlement.write(listed, _output(1))
    assert delivered == [] and settlement.held == 2
    settlement.done(passed_over)
    assert delivered == [1] and settlement.held == 0
    assert state.position == 2  # both count as done, as acknowledged outputs would
