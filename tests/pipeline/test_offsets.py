"""The offset tracker never lets a commit pass an unfinished ticket, whatever order tickets finish in."""

from __future__ import annotations

import random

from worker.pipeline.settlements.offsets import OffsetTracker, PartitionOffsets

KEY = ("tickets", 0)


def tracked(*offsets: int) -> PartitionOffsets:
    state = PartitionOffsets(KEY)
    for offset in offsets:
        assert state.track(offset)
    return state


def test_nothing_to_commit_until_the_first_offset_is_done() -> None:
    state = tracked(10, 11, 12)
    state.done(11)
    state.done(12)
    assert state.commit_position() is None
    state.done(10)
    assert state.commit_position() == 13


def test_commit_stops_at_the_first_gap() -> None:
    state = tracked(0, 1, 2, 3, 4)
    for offset in (0, 1, 3, 4):
        state.done(offset)
    assert state.commit_position() == 2
    state.done(2)
    assert state.commit_position() == 5


def test_offsets_with_holes_are_contiguous_in_consume_order() -> None:
    # Compaction and transaction markers leave holes in a partition's offsets.
    state = tracked(3, 7, 8, 20)
    state.done(7)
    state.done(3)
    assert state.commit_position() == 8
    state.done(20)
    assert state.commit_position() == 8  # 8 itself is not done yet
    state.done(8)
    assert state.commit_position() == 21


def test_redelivered_or_older_offsets_are_refused() -> None:
    state = tracked(5, 6)
    assert not state.track(6)
    assert not state.track(2)
    assert state.track(7)
    assert len(state) == 3


def test_failed_delivery_blocks_the_partition_for_good() -> None:
    state = tracked(0, 1, 2)
    state.done(0)
    state.fail(1)
    state.done(2)
    state.done(1)  # a late report for the failed offset does not unblock it
    assert state.commit_position() == 1
    assert state.blocked_at == 1


def test_offsets_are_tracked_until_a_confirmed_commit_passes_them() -> None:
    state = tracked(0, 1, 2, 3)
    for offset in (0, 1, 2):
        state.done(offset)
    assert len(state) == 4
    assert state.uncommitted_done == 3
    state.commit_requested(3)
    assert state.commit_position() is None  # already on its way
    assert state.committed(3) == 3
    assert len(state) == 1
    assert state.uncommitted_done == 0


def test_failed_commit_can_be_retried() -> None:
    state = tracked(0, 1)
    state.done(0)
    state.commit_requested(1)
    assert state.commit_position() is None
    state.commit_failed(1)
    assert state.commit_position() == 1


def test_a_stale_confirmation_releases_only_what_it_covers() -> None:
    state = tracked(0, 1, 2)
    for offset in (0, 1, 2):
        state.done(offset)
    assert state.committed(2) == 2
    assert state.committed(1) == 0
    assert len(state) == 1


def test_random_completion_order_never_commits_past_an_unfinished_offset() -> None:
    rng = random.Random(7)
    for _ in range(200):
        offsets = sorted(rng.sample(range(500), rng.randint(1, 60)))
        state = tracked(*offsets)
        order = offsets[:]
        rng.shuffle(order)
        finished: set[int] = set()
        for offset in order:
            state.done(offset)
            finished.add(offset)
            position = state.commit_position()
            unfinished = [o for o in offsets if o not in finished]
            if position is not None:
                assert all(o >= position for o in unfinished)
                assert position - 1 in finished
                state.commit_requested(position)
                state.committed(position)
            expected_floor = min(unfinished) if unfinished else offsets[-1] + 1
            assert len(state) == sum(1 for o in offsets if o >= expected_floor or o not in finished)
        assert state.position is None or state.position == offsets[-1] + 1


def test_tracker_revoke_forgets_and_reassign_starts_fresh() -> None:
    tracker = OffsetTracker()
    old = tracker.assign(KEY)
    old.track(0)
    old.track(1)
    other = tracker.assign(("tickets", 1))
    other.track(9)
    assert len(tracker) == 3
    assert [state.key for state in tracker.revoke([KEY])] == [KEY]
    assert not tracker.is_current(old)
    assert len(tracker) == 1
    new = tracker.assign(KEY)
    assert tracker.is_current(new)
    old.done(0)  # a late report for the old assignment changes nothing now
    assert tracker.commit_positions() == {}
    new.track(5)
    new.done(5)
    other.done(9)
    assert tracker.commit_positions() == {KEY: 6, ("tickets", 1): 10}
    assert tracker.uncommitted_done() == 2


def test_after_a_seek_back_a_partition_takes_records_again_from_there() -> None:
    """Exactly-once redo: a fresh state from the first uncommitted offset, never before it."""
    tracker = OffsetTracker()
    state = tracker.assign(("t", 0))
    for offset in (5, 6, 7):
        state.track(offset)
    state.done(5)
    assert state.first_uncommitted == 5
    fresh = tracker.restart(("t", 0), 5)
    assert tracker.get(("t", 0)) is fresh and len(fresh) == 0
    assert not fresh.track(4)  # before the seek position
    assert fresh.track(5) and fresh.track(6)
    blocked = tracker.restart(("t", 0), 5, blocked=True)
    assert blocked.blocked_at == 5
