"""New-intent discovery (worker/learning/discovery.py) on generated tickets: seeded gaussian groups on the
unit sphere, each group's texts built from its own words, so that what a team would see is checkable: how many
intents were proposed, their names, which tickets were left out, and the flags."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.inference.taxonomy import INTENT_NAME
from worker.learning.discovery import (
    SNAKE_CASE,
    UNASSIGNED,
    DiscoverySettings,
    discover,
    name_from_terms,
    normalised,
    terms_of,
)

DIMENSIONS = 48
TOPICS = [
    ("parcel", "delivery"),
    ("refund", "request"),
    ("password", "reset"),
    ("invoice", "copy"),
    ("account", "closure"),
    ("voucher", "expired"),
    ("coupon", "code"),
]


def blobs(
    groups: int, per_group: int, spread: float, seed: int
) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
    """(vectors, texts, true group of each row, the groups' centres): group g's texts name TOPICS[g]."""
    rng = np.random.default_rng(seed)
    centres = normalised(rng.normal(size=(groups, DIMENSIONS)))
    rows, texts, truth = [], [], []
    for g in range(groups):
        first, second = TOPICS[g]
        for j in range(per_group):
            rows.append(centres[g] + rng.normal(scale=spread, size=DIMENSIONS))
            texts.append(f"hello, my {first} {second} is not working, ticket {j} of mine")
            truth.append(g)
    return normalised(np.array(rows)), texts, np.array(truth), centres


def test_recovers_the_number_of_intents_and_groups_them_purely() -> None:
    vectors, texts, truth, _ = blobs(6, 30, 0.05, seed=1)
    found = discover(vectors, texts, settings=DiscoverySettings(seed=3))
    assert found.estimated_k == 6
    for intent in found.intents:
        assert len({int(truth[i]) for i in intent.members}) == 1
    assert np.all(found.assignment != UNASSIGNED)


def test_names_come_from_the_tickets_words_and_are_unique_valid_snake_case() -> None:
    vectors, texts, truth, _ = blobs(6, 30, 0.05, seed=2)
    found = discover(vectors, texts, known={"parcel_delivery_late": np.ones(DIMENSIONS)})
    names = [intent.name for intent in found.intents]
    assert len(set(names)) == len(names)
    assert "parcel_delivery_late" not in names
    for intent in found.intents:
        assert SNAKE_CASE.match(intent.name) and INTENT_NAME.match(intent.name)
        first, second = TOPICS[int(truth[intent.members[0]])]
        assert intent.name == f"{first}_{second}"
        assert first in intent.description and "\n" not in intent.description
        assert len(intent.examples) == 5 and set(intent.examples) <= set(intent.members)


def test_one_off_tickets_and_tiny_groups_stay_unassigned() -> None:
    vectors, texts, _, _ = blobs(6, 30, 0.05, seed=4)
    rng = np.random.default_rng(9)
    strays = normalised(rng.normal(size=(4, DIMENSIONS)))
    all_vectors = np.concatenate([vectors, strays])
    all_texts = texts + [f"something else entirely {i}" for i in range(4)]
    found = discover(all_vectors, all_texts)
    assert found.estimated_k == 6
    assert np.all(found.assignment[-4:] == UNASSIGNED)
    assert np.all(found.assignment[:-4] != UNASSIGNED)
    assert np.all(found.distance[-4:] > found.distance[:-4].max())


def test_a_group_like_an_existing_intent_is_flagged_as_its_duplicate() -> None:
    vectors, texts, truth, centres = blobs(6, 30, 0.05, seed=5)
    found = discover(vectors, texts, known={"where_is_my_parcel": centres[0], "elsewhere": -centres[0]})
    flagged = [intent for intent in found.intents if intent.duplicate_of is not None]
    assert len(flagged) == 1
    assert flagged[0].duplicate_of == "where_is_my_parcel"
    assert {int(truth[i]) for i in flagged[0].members} == {0}


def test_two_groups_almost_alike_are_reported_as_overlapping() -> None:
    vectors, texts, _, centres = blobs(5, 40, 0.02, seed=6)
    offset = normalised(np.random.default_rng(1).normal(size=(1, DIMENSIONS)))
    twin = normalised(centres[0] + 1.0 * offset)
    near = normalised(twin + np.random.default_rng(2).normal(scale=0.02, size=(40, DIMENSIONS)))
    found = discover(
        np.concatenate([vectors, near]),
        texts + [f"my coupon code is not working, ticket {j}" for j in range(40)],
        settings=DiscoverySettings(overlap_similarity=0.65),
    )
    assert found.estimated_k == 6
    assert [sorted((o.first, o.second)) for o in found.overlaps] == [["coupon_code", "parcel_delivery"]]


def test_the_same_tickets_and_seed_give_the_same_proposals() -> None:
    vectors, texts, _, _ = blobs(6, 25, 0.15, seed=7)
    first = discover(vectors, texts, settings=DiscoverySettings(seed=11))
    second = discover(vectors, texts, settings=DiscoverySettings(seed=11))
    assert first.intents == second.intents
    assert np.array_equal(first.assignment, second.assignment)


def test_too_few_tickets_propose_nothing() -> None:
    vectors, texts, _, _ = blobs(1, 2, 0.05, seed=8)
    found = discover(vectors, texts)
    assert found.intents == () and np.all(found.assignment == UNASSIGNED)


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.text(max_size=60), max_size=6),
    taken=st.sets(st.from_regex(r"[a-z]{1,6}(_[a-z]{1,6})?", fullmatch=True), max_size=8),
)
def test_any_words_give_a_valid_name_not_taken(texts: list[str], taken: set[str]) -> None:
    terms = [term for text in texts for term in terms_of(text)]
    name = name_from_terms(terms, taken)
    assert SNAKE_CASE.match(name) and name not in taken
