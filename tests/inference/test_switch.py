"""The switching classifier's routing across a hot reload, with fake pools that answer when told to."""

from __future__ import annotations

import time

from worker.classification import Classification, ClassifyRequest
from worker.inference.pool import ClassifierPool, Result
from worker.inference.switch import SwitchingClassifier


class FakePool(ClassifierPool):
    """Answers a request only when the test says so."""

    def __init__(self, model_id: str) -> None:
        self.model_id, self.size = model_id, 1
        self.submitted: list[int] = []
        self.ready: list[Result] = []
        self.closed = False

    def answer(self, request_id: int) -> None:
        self.ready.append((request_id, _answer(self.model_id)))

    def submit(self, request: ClassifyRequest) -> None:
        self.submitted.append(request.request_id)

    def poll(self, timeout: float) -> list[Result]:
        ready, self.ready = self.ready, []
        return ready

    def close(self) -> None:
        self.closed = True


def _answer(model_id: str) -> Classification:
    return Classification(
        intent="card_arrival", priority="Low", confidence=1.0, scores={}, model=model_id, latency_ms=1.0,
        truncated=False,
    )  # fmt: skip


def _request(request_id: int) -> ClassifyRequest:
    return ClassifyRequest(request_id, "Where is my card?", time.monotonic() + 30.0)


def _switch(pool: ClassifierPool) -> tuple[SwitchingClassifier, list[ClassifierPool]]:
    closed: list[ClassifierPool] = []
    return SwitchingClassifier(pool, closer=closed.append), closed


def test_new_tickets_go_to_the_new_pool_while_the_old_one_finishes_its_own() -> None:
    old, new = FakePool("a"), FakePool("b")
    switch, closed = _switch(old)
    switch.submit(_request(1))
    switch.submit(_request(2))
    switch.stage(new)
    assert old.submitted == [1, 2] and not new.submitted  # nothing moves until the loop comes by
    switch.submit(_request(3))
    assert switch.model_id == "b"
    assert new.submitted == [3] and old.submitted == [1, 2]
    old.answer(1)
    new.answer(3)
    assert sorted((i, a.model) for i, a in switch.poll(0.0)) == [(1, "a"), (3, "b")]
    assert closed == []  # request 2 is still at the old pool
    old.answer(2)
    assert [(i, a.model) for i, a in switch.poll(0.0)] == [(2, "a")]
    assert closed == [old]
    assert switch.poll(0.0) == [] and closed == [old]  # closed once, and no longer polled


def test_an_idle_old_pool_is_closed_at_the_switch() -> None:
    old, new = FakePool("a"), FakePool("b")
    switch, closed = _switch(old)
    switch.stage(new)
    assert closed == []
    assert switch.model_id == "b"
    assert closed == [old]


def test_a_pool_staged_over_an_unused_one_closes_that_one() -> None:
    old, first, second = FakePool("a"), FakePool("b"), FakePool("c")
    switch, closed = _switch(old)
    switch.stage(first)
    switch.stage(second)
    assert closed == [first]
    assert switch.model_id == "c"
    assert closed == [first, old]


def test_close_closes_every_pool_and_any_staged_later() -> None:
    old, new, late = FakePool("a"), FakePool("b"), FakePool("c")
    switch, closed = _switch(old)
    switch.submit(_request(1))
    switch.stage(new)
    switch.submit(_request(2))  # old retired, still owes request 1
    switch.close()
    assert old.closed and new.closed
    switch.stage(late)
    assert closed == [late]
