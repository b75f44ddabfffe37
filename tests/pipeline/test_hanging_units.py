"""The hanging-transaction rule (worker/pipeline/hanging.py) on generated readings: a partition whose last
stable offset stays behind its end past the limit is named once, within a round of the limit; one whose
stable offset keeps moving or catches up is never named; a named one is cleared once its offset moves."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.pipeline.hanging import (
    STABLE_OFFSET_STUCK,
    WATCH_INTERVAL_S,
    HangDetector,
    Reading,
    suspect_after_s,
)

KEY = ("triage.out", 3)
LIMIT = suspect_after_s(10_000)

rounds = st.lists(st.floats(min_value=0.5, max_value=WATCH_INTERVAL_S), min_size=1, max_size=60)


def test_the_limit_is_under_a_minute_with_the_workers_transaction_timeout() -> None:
    # Twice the 10 s timeout (a dead producer's transaction lasts until the broker's sweep aborts it) + 10 s.
    assert LIMIT == 30.0
    assert LIMIT + 2 * WATCH_INTERVAL_S < 60.0


@settings(max_examples=100, deadline=None)
@given(steps=rounds, start=st.integers(0, 10**6), gaps=st.lists(st.integers(0, 50), min_size=60, max_size=60))
def test_a_stable_offset_that_moves_or_catches_up_is_never_a_suspect(
    steps: list[float], start: int, gaps: list[int]
) -> None:
    detector = HangDetector(LIMIT)
    now, stable = 0.0, start
    for index, step in enumerate(steps):
        now += step * 10  # rounds far apart: still nothing, as long as the offset moves each time
        stable += 1
        high = stable + gaps[index]  # behind by any amount, or caught up (gap 0)
        new, cleared = detector.observe(now, {KEY: Reading(stable, high)})
        assert new == [] and cleared == []
    assert detector.suspected == frozenset()


@settings(max_examples=100, deadline=None)
@given(steps=rounds, stable=st.integers(0, 10**6), behind=st.integers(1, 1000))
def test_a_stable_offset_held_behind_the_end_is_named_once_within_a_round_of_the_limit(
    steps: list[float], stable: int, behind: int
) -> None:
    detector = HangDetector(LIMIT)
    now, first_seen, named_at = 0.0, 0.0, []
    for step in itertools.chain([0.0], itertools.cycle(steps)):
        now += step
        new, cleared = detector.observe(now, {KEY: Reading(stable, stable + behind + int(now))})
        assert cleared == []
        for suspect in new:
            assert (suspect.key, suspect.reason, suspect.stable) == (KEY, STABLE_OFFSET_STUCK, stable)
            assert suspect.held_s >= LIMIT
            named_at.append(now)
        if now - first_seen >= LIMIT + WATCH_INTERVAL_S:
            break
    assert len(named_at) == 1, "named exactly once"
    assert named_at[0] - first_seen < LIMIT + WATCH_INTERVAL_S
    assert detector.suspected == {KEY}


@settings(max_examples=100, deadline=None)
@given(held_for=st.floats(LIMIT, 10 * LIMIT), moved_by=st.integers(1, 100), caught_up=st.booleans())
def test_a_suspect_is_cleared_when_its_stable_offset_moves(
    held_for: float, moved_by: int, caught_up: bool
) -> None:
    detector = HangDetector(LIMIT)
    detector.observe(0.0, {KEY: Reading(100, 500)})
    new, _ = detector.observe(held_for, {KEY: Reading(100, 500)})
    assert [s.key for s in new] == [KEY]

    after = Reading(500, 500) if caught_up else Reading(100 + moved_by, 600)
    new, cleared = detector.observe(held_for + 1, {KEY: after})
    assert (new, cleared) == ([], [KEY])
    assert detector.suspected == frozenset()


def test_a_partition_no_longer_read_is_forgotten() -> None:
    """A revoked partition is not named, nor remembered when it comes back later."""
    detector = HangDetector(LIMIT)
    detector.observe(0.0, {KEY: Reading(1, 9)})
    detector.observe(LIMIT / 2, {})
    assert detector.observe(LIMIT, {KEY: Reading(1, 9)}) == ([], [])
    assert detector.suspected == frozenset()
