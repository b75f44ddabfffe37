"""The ledger's bookkeeping: where each taken record is, and what happens to it when its partition leaves."""

from __future__ import annotations

import pytest

from worker.config import Scheduling
from worker.messages import TicketEvent
from worker.pipeline.ledger import Ledger, Output, Work
from worker.pipeline.offsets import PartitionOffsets

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
    ledger = Ledger()
    work = _work(A, 0)
    ledger.wait(work)
    assert ledger.pending({A}) == 1 and ledger.waiting == 1
    assert ledger.next_waiting() is work
    request_id = ledger.to_model(work)
    assert ledger.at_model == 1
    assert ledger.answered(request_id) is work
    assert ledger.answered(request_id) is None  # an answer counts once
    delivery_id = ledger.to_broker(work)
    assert ledger.pending({A}) == 1 and not ledger.is_empty()
    assert ledger.delivered(delivery_id) is work
    assert ledger.is_empty() and ledger.pending({A}) == 0


def test_waiting_records_go_to_the_model_earliest_deadline_first_ties_in_arrival_order() -> None:
    ledger = Ledger()
    loose, tight, tie_1, tie_2 = (_work(A, i, deadline) for i, deadline in enumerate((9.0, 1.0, 5.0, 5.0)))
    for work in (loose, tight, tie_1, tie_2):
        ledger.wait(work)
    assert [ledger.next_waiting() for _ in range(5)] == [tight, tie_1, tie_2, loose, None]


def test_fifo_scheduling_keeps_arrival_order_whatever_the_deadlines() -> None:
    ledger = Ledger("fifo")
    works = [_work(A, i, deadline) for i, deadline in enumerate((9.0, 1.0, 5.0))]
    for work in works:
        ledger.wait(work)
    assert [ledger.next_waiting() for _ in works] == works


@pytest.mark.parametrize("scheduling", ["edf", "fifo"])
def test_expired_takes_out_late_records_earliest_first_and_keeps_the_rest(scheduling: Scheduling) -> None:
    ledger = Ledger(scheduling)
    late_2, on_time, late_1 = _work(A, 0, deadline=2.0), _work(A, 1, deadline=9.0), _work(B, 5, deadline=1.0)
    for work in (late_2, on_time, late_1):
        ledger.wait(work)
    assert ledger.expired(now=0.5) == []
    assert ledger.expired(now=5.0) == [late_1, late_2]
    assert ledger.waiting == 1 and ledger.pending({B}) == 0
    assert ledger.next_waiting() is on_time and ledger.next_waiting() is None
    assert ledger.expired(now=10.0) == []  # served records never expire later


def test_every_waiting_record_comes_out_once_served_or_expired() -> None:
    ledger = Ledger()
    out: list[Work | None] = []
    for i in range(10_000):
        ledger.wait(_work(A, i, deadline=float(i % 7)))
        if i % 3 == 0:
            out.append(ledger.next_waiting())
        out += ledger.expired(now=float(i % 5))
    while (work := ledger.next_waiting()) is not None:
        out.append(work)
    assert sorted(work.offset for work in out if work is not None) == list(range(10_000))
    assert ledger.is_empty() and ledger.expired(now=100.0) == []


def test_records_of_a_revoked_partition_go_to_the_model_first() -> None:
    ledger = Ledger()
    works = [_work(A, 0), _work(B, 0), _work(A, 1), _work(B, 1)]
    for work in works:
        ledger.wait(work)
    ledger.first_to_model({B})
    assert [ledger.next_waiting() for _ in works] == [works[1], works[3], works[0], works[2]]


def test_a_revoked_partition_goes_first_even_before_earlier_deadlines_and_after_a_later_arrival() -> None:
    ledger = Ledger()
    urgent, leaving = _work(A, 0, deadline=1.0), _work(B, 0, deadline=50.0)
    ledger.wait(urgent)
    ledger.wait(leaving)
    ledger.first_to_model({B})
    later = _work(A, 1, deadline=0.5)  # taken after the revoke began: its partition is staying
    ledger.wait(later)
    assert [ledger.next_waiting() for _ in range(3)] == [leaving, later, urgent]


def test_giving_up_a_partition_drops_waiting_records_and_orphans_the_rest_until_they_come_back() -> None:
    ledger = Ledger()
    waiting, at_model, at_broker, other = _work(A, 2), _work(A, 0), _work(A, 1), _work(B, 0)
    request_id = ledger.to_model(at_model)
    delivery_id = ledger.to_broker(at_broker)
    ledger.wait(waiting)
    ledger.wait(other)
    assert ledger.give_up({A}) == 1  # the waiting one: the next owner reads it again
    assert ledger.orphans == 2 and at_model.orphan and at_broker.orphan and not other.orphan
    assert ledger.pending({A}) == 0 and ledger.pending({B}) == 1
    assert ledger.answered(request_id) is at_model and ledger.orphans == 1
    assert ledger.delivered(delivery_id) is at_broker and ledger.orphans == 0
    assert ledger.give_up({A}) == 0  # nothing left of A; B untouched
    assert ledger.next_waiting() is other


def _taken(ledger: Ledger, state: PartitionOffsets, offsets: range) -> list[Work]:
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
    ledger = Ledger(in_order=True)
    a, b = PartitionOffsets(A), PartitionOffsets(B)
    first, second, third = _taken(ledger, a, range(3))
    [other] = _taken(ledger, b, range(1))
    ledger.hold(third, _output(2))
    ledger.hold(second, _output(1))
    ledger.hold(other, _output(0))
    # Partition B's only record goes at once; A's wait for offset 0, which is still at the model.
    assert ledger.release() == [other]
    assert ledger.held == 2 and ledger.pending({A}) == 2 and not ledger.is_empty()
    ledger.hold(first, _output(0))
    assert ledger.release() == [first, second, third]
    assert ledger.held == 0 and ledger.release() == []


def test_in_order_giving_up_a_partition_drops_its_held_outputs() -> None:
    ledger = Ledger(in_order=True)
    a, b = PartitionOffsets(A), PartitionOffsets(B)
    head, held = _taken(ledger, a, range(2))
    [other] = _taken(ledger, b, range(1))
    ledger.hold(held, _output(1))
    ledger.hold(other, _output(0))
    assert ledger.give_up({A}) == 1  # the held output; its next owner redoes it
    assert ledger.pending({A}) == 0 and ledger.held == 1
    assert ledger.release() == [other]
    assert head.output is None and ledger.is_empty()


def test_without_order_nothing_is_held_back() -> None:
    ledger = Ledger()
    state = PartitionOffsets(A)
    _taken(ledger, state, range(2))
    assert ledger.release() == [] and ledger.is_empty()


def test_in_order_release_of_one_partition_leaves_the_others_held() -> None:
    ledger = Ledger(in_order=True)
    a, b = PartitionOffsets(A), PartitionOffsets(B)
    [on_a] = _taken(ledger, a, range(1))
    [on_b] = _taken(ledger, b, range(1))
    ledger.hold(on_a, _output(0))
    ledger.hold(on_b, _output(0))
    assert ledger.release(b) == [on_b]
    assert ledger.held == 1 and ledger.release(a) == [on_a]
