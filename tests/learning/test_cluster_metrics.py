"""The figures `make bench-discover` reports (tools/cluster_metrics.py): ACC's Hungarian matching is the
best one-to-one matching, and NMI and ARI take their textbook values on cases worked by hand."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from tools.cluster_metrics import accuracy, ari, hungarian, nmi


@pytest.mark.parametrize("seed", range(20))
def test_the_matching_is_the_cheapest_of_all_permutations(seed: int) -> None:
    cost = np.random.default_rng(seed).random((5, 6))
    best = min(
        sum(cost[r, c] for r, c in enumerate(columns)) for columns in itertools.permutations(range(6), 5)
    )
    pairs = hungarian(cost)
    assert sorted(r for r, _ in pairs) == list(range(5)) and len({c for _, c in pairs}) == 5
    assert sum(cost[r, c] for r, c in pairs) == pytest.approx(best)


def test_a_renamed_grouping_scores_perfectly_and_a_merged_one_does_not() -> None:
    truth = ["a"] * 10 + ["b"] * 10 + ["c"] * 10
    renamed = [7] * 10 + [3] * 10 + [5] * 10
    assert accuracy(truth, renamed) == nmi(truth, renamed) == ari(truth, renamed) == 1.0
    merged = [0] * 20 + [1] * 10
    assert accuracy(truth, merged) == pytest.approx(20 / 30)
    # NMI by hand: I = log 3 - (2/3) log 2, H(truth) = log 3, H(found) = log 3 - (2/3) log 2.
    information = np.log(3) - (2 / 3) * np.log(2)
    assert nmi(truth, merged) == pytest.approx(information / ((np.log(3) + information) / 2))
    # ARI by hand: index 3 * C(10, 2) = 135, expected 135 * 235 / 435, max (135 + 235) / 2.
    expected = 135 * 235 / 435
    assert ari(truth, merged) == pytest.approx((135 - expected) / (185 - expected))


def test_a_random_grouping_scores_near_zero_ari() -> None:
    rng = random.Random(4)
    truth = [rng.randrange(8) for _ in range(4000)]
    found = [rng.randrange(8) for _ in range(4000)]
    assert abs(ari(truth, found)) < 0.01 and accuracy(truth, found) < 0.2
