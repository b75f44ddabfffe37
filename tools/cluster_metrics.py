"""Clustering figures of the new-intent discovery literature: NMI, ARI and ACC (Hungarian matching).

No scipy in the project's dependencies, so the assignment problem is solved here (the shortest augmenting
path form of the Hungarian method, O(n³) on the contingency table: 77 intents take milliseconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def contingency(truth: Sequence[object], found: Sequence[object]) -> npt.NDArray[np.int64]:
    """Counts of (true class, found cluster), rows and columns in sorted order of their values."""
    classes = {c: i for i, c in enumerate(sorted(set(map(str, truth))))}
    clusters = {c: i for i, c in enumerate(sorted(set(map(str, found))))}
    table = np.zeros((len(classes), len(clusters)), dtype=np.int64)
    for t, f in zip(truth, found, strict=True):
        table[classes[str(t)], clusters[str(f)]] += 1
    return table


def hungarian(cost: npt.NDArray[np.floating]) -> list[tuple[int, int]]:
    """Row-column pairs of least total cost, one per row of a rows <= columns matrix (transposed first
    otherwise)."""
    matrix = np.asarray(cost, dtype=np.float64)
    if matrix.shape[0] > matrix.shape[1]:
        return [(r, c) for c, r in hungarian(matrix.T)]
    rows, columns = matrix.shape
    u = np.zeros(rows + 1)
    v = np.zeros(columns + 1)
    owner = np.zeros(columns + 1, dtype=np.int64)  # owner[j]: the row (1-based) matched to column j
    way = np.zeros(columns + 1, dtype=np.int64)
    for row in range(1, rows + 1):
        owner[0] = row
        column = 0
        least = np.full(columns + 1, np.inf)
        used = np.zeros(columns + 1, dtype=bool)
        while True:
            used[column] = True
            current = owner[column]
            reduced = matrix[current - 1] - u[current] - v[1:]
            free = ~used[1:]
            better = free & (reduced < least[1:])
            least[1:][better] = reduced[better]
            way[1:][better] = column
            candidates = np.where(free, least[1:], np.inf)
            step_column = int(candidates.argmin()) + 1
            delta = candidates[step_column - 1]
            u[owner[used]] += delta
            v[used] -= delta
            least[1:][free] -= delta
            column = step_column
            if owner[column] == 0:
                break
        while column:
            previous = way[column]
            owner[column] = owner[previous]
            column = previous
    return [(int(owner[j]) - 1, j - 1) for j in range(1, columns + 1) if owner[j]]


def accuracy(truth: Sequence[object], found: Sequence[object]) -> float:
    """ACC: the share of tickets right once each cluster is matched to at most one class (Hungarian)."""
    table = contingency(truth, found)
    matched = sum(int(table[r, c]) for r, c in hungarian(-table.astype(np.float64)))
    return matched / max(len(truth), 1)


def nmi(truth: Sequence[object], found: Sequence[object]) -> float:
    """Normalised mutual information, arithmetic-mean normalisation (scikit-learn's default)."""
    table = contingency(truth, found).astype(np.float64)
    total = table.sum()
    rows, columns = table.sum(axis=1) / total, table.sum(axis=0) / total
    joint = table / total
    nonzero = joint > 0
    mutual = float((joint[nonzero] * np.log(joint[nonzero] / np.outer(rows, columns)[nonzero])).sum())

    def entropy(p: npt.NDArray[np.float64]) -> float:
        return float(-(p[p > 0] * np.log(p[p > 0])).sum())

    denominator = (entropy(rows) + entropy(columns)) / 2
    return mutual / denominator if denominator > 0 else 1.0


def ari(truth: Sequence[object], found: Sequence[object]) -> float:
    """Adjusted Rand index."""
    table = contingency(truth, found)

    def pairs(counts: npt.NDArray[np.int64]) -> float:
        return float(sum(math.comb(int(c), 2) for c in counts.ravel()))

    index = pairs(table)
    rows, columns = pairs(table.sum(axis=1)), pairs(table.sum(axis=0))
    expected = rows * columns / max(math.comb(int(table.sum()), 2), 1)
    top = (rows + columns) / 2
    return (index - expected) / (top - expected) if top != expected else 1.0
