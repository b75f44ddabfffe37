"""New-intent discovery: tickets no intent covers, grouped into proposed intents named from their own words.

`taxonomy discover` (worker/cli/taxonomy_command.py) hands this module the sentence embeddings of the
tickets answered "none of these" (or of every ticket, on day 0) and their texts, already redacted; it
returns the proposed intents. numpy only, so an installed worker discovers without the `train` extra:

1. How many groups: spherical K-means (greedy k-means++ seeding) for each K of a geometric grid, scored
   by the cosine silhouette on a seeded sample (the mean of `runs_per_k` seedings); the scores smoothed
   over log K, the smallest K within `tolerance` of the best smoothed score, then the best unsmoothed
   score near it (`estimate_k`). One run's silhouette on short tickets moves more from seeding to seeding
   than from one K to the next: the mean and the smoothing make the choice stable.
2. The groups: K-means at that K, the best of `restarts` seedings.
3. What stays unassigned: a group with fewer than `min_size` members or a mean similarity to its centre
   under `min_cohesion` (incoherent leftovers), and a ticket further from its centre than its group's
   Tukey fence (third quartile plus 1.5 interquartile ranges) and than `max_distance` (one-off tickets).
4. Names: the terms of each group scored by class-based TF-IDF (a term frequent in the group and rare in the
   others, as BERTopic's c-TF-IDF), the best one or two as a snake_case name, unique among the taxonomy's
   intents and the other proposals; the description lists the top terms; the examples are the members
   nearest the centre.
5. Flags: a group whose centre is within `duplicate_similarity` of an existing intent's centre (the
   out-of-scope threshold may be the thing to move, not the taxonomy), and pairs of groups within
   `overlap_similarity` of each other (one intent split in two, or two that a person should tell apart).

Every random choice comes from one `numpy.random.Generator` seeded by `DiscoverySettings.seed`: the same
tickets give the same proposals.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]
# Progress of the long part (the K scan): (done, total).
Progress = Callable[[int, int], None]
UNASSIGNED = -1
SNAKE_CASE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# Words too common in support tickets to name anything (English function words and ticket boilerplate).
_STOP_WORDS = (
    "a about above after again against all am an and any are aren as at be because been before being "
    "below between both but by can cannot could did didn do does doesn doing don down during each "
    "few for from further get got had has have having he her here hers herself him himself his how i "
    "if in into is isn it its itself just let me might more most much must my myself need no nor not "
    "now of off on once only or other ought our ours ourselves out over own please same she should "
    "so some still such than thank thanks that the their theirs them themselves then there these "
    "they this those through to too under until up upon us very was wasn we were weren what when "
    "where which while who whom why will with won would you your yours yourself yourselves hi hello "
    "hey help want know like also im ive id dont cant isnt wont ok okay yes one two way really "
    "already even yet since many lot something anything someone tell"
)
STOP_WORDS = frozenset(_STOP_WORDS.split())
_WORD = re.compile(r"[a-z][a-z0-9]+")
# Redaction placeholders (`[email]`, `[card ••••1234]`): the kind of data is a word of the ticket no more.
_PLACEHOLDER = re.compile(r"\[[^\]]*\]")
NAME_TERMS = 2
DESCRIPTION_TERMS = 5
EXAMPLES = 5


@dataclasses.dataclass(frozen=True)
class DiscoverySettings:
    """The knobs. The K scan's (`grid` .. `refine`) were chosen on BANKING77 train subsets (40 tickets per
    intent, 25/50/75 % and none of the 77 intents known, two seeds; scanned with single-draw seeding,
    before the greedy one): mean |K error| 19 %, where one run per K and no smoothing gave 27-39 %.
    tools/bench_discover.py measures them on test.csv."""

    seed: int = 0
    # The K grid: `grid` values from `min_k` to the smaller of `max_k` and the tickets over `per_group`.
    min_k: int = 2
    max_k: int = 200
    per_group: int = 5
    grid: int = 40
    runs_per_k: int = 2
    window: float = 2.0
    tolerance: float = 0.01
    refine: float = 1.2
    silhouette_sample: int = 2000
    restarts: int = 4
    iterations: int = 60
    min_size: int = 3
    # The shipped encoder on BANKING77 train: an intent's tickets are 0.83-0.91 alike to its centre on
    # average, 99.9 % of them within distance 0.41 of it; two halves of one intent's tickets have centres
    # 0.985-0.996 alike, the nearest other intent's centre 0.91 (median) to 0.96 (the closest pair).
    min_cohesion: float = 0.75
    max_distance: float = 0.4
    duplicate_similarity: float = 0.97
    overlap_similarity: float = 0.97


@dataclasses.dataclass(frozen=True)
class ProposedIntent:
    """One group: its name, one-line description, the members (row indices) nearest its centre first."""

    name: str
    description: str
    terms: tuple[str, ...]
    members: tuple[int, ...]
    examples: tuple[int, ...]
    cohesion: float
    # The existing intent whose centre is this close (cosine), when past `duplicate_similarity`.
    duplicate_of: str | None = None
    duplicate_similarity: float | None = None


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Two proposals whose centres are within `overlap_similarity` (cosine)."""

    first: str
    second: str
    similarity: float


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What `discover` found: the proposals, each ticket's group (index into `intents`, or `UNASSIGNED`),
    its nearest proposal (unassigned tickets too) and its cosine distance to that proposal's centre, the
    overlaps and the K scan's silhouettes."""

    intents: tuple[ProposedIntent, ...]
    assignment: IntArray
    nearest: IntArray
    distance: FloatArray
    overlaps: tuple[Overlap, ...]
    silhouettes: dict[int, float]

    @property
    def estimated_k(self) -> int:
        return len(self.intents)


def normalised(vectors: npt.NDArray[np.floating]) -> FloatArray:
    """Rows scaled to unit length (cosine similarity is then a dot product)."""
    rows = np.asarray(vectors, dtype=np.float32)
    result: FloatArray = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return result


def _centres(x: FloatArray, labels: IntArray, k: int) -> FloatArray:
    """Each group's normalised mean (a zero row for an empty group)."""
    one_hot = np.zeros((k, len(x)), dtype=np.float32)
    one_hot[labels, np.arange(len(x))] = 1.0
    return normalised(one_hot @ x)


def _seed_centres(x: FloatArray, k: int, rng: np.random.Generator) -> FloatArray:
    """Greedy k-means++ seeding on cosine distance (as scikit-learn's): each new centre is the best, by the
    summed squared distances left, of 2 + log(k) tickets drawn with probability proportional to their
    squared distance to the nearest centre so far. One draw per step leaves two groups under one seed
    often enough to move the silhouette of the true K below its neighbours'."""
    trials = 2 + int(math.log(k))
    chosen = [int(rng.integers(len(x)))]
    nearest = np.maximum(1.0 - x @ x[chosen[0]], 0.0)
    for _ in range(1, k):
        weights = nearest.astype(np.float64) ** 2
        total = weights.sum()
        if total <= 0:
            picks = rng.integers(len(x), size=trials)
        else:
            picks = rng.choice(len(x), size=trials, p=weights / total)
        distances = np.minimum(nearest[None, :], np.maximum(1.0 - x[picks] @ x.T, 0.0))
        best = int((distances.astype(np.float64) ** 2).sum(axis=1).argmin())
        chosen.append(int(picks[best]))
        nearest = distances[best]
    return x[chosen].copy()


def kmeans(
    x: FloatArray, k: int, rng: np.random.Generator, iterations: int = 60, restarts: int = 1
) -> tuple[IntArray, FloatArray]:
    """Spherical K-means of the unit rows `x`: (labels, unit centres), the best of `restarts` seedings by
    the sum of cosine distances. An emptied group is reseeded with the ticket furthest from its centre."""
    best: tuple[float, IntArray, FloatArray] | None = None
    for _ in range(restarts):
        centres = _seed_centres(x, k, rng)
        labels = np.full(len(x), -1, dtype=np.int64)
        for _ in range(iterations):
            similarity = x @ centres.T
            new = similarity.argmax(axis=1).astype(np.int64)
            counts = np.bincount(new, minlength=k)
            for empty in np.flatnonzero(counts == 0):
                far = int(similarity[np.arange(len(x)), new].argmin())
                new[far] = empty
                similarity[far, empty] = np.inf
                counts = np.bincount(new, minlength=k)
            if np.array_equal(new, labels):
                break
            labels = new
            centres = _centres(x, labels, k)
        cost = float(np.sum(1.0 - np.einsum("ij,ij->i", x, centres[labels])))
        if best is None or cost < best[0]:
            best = (cost, labels, centres)
    assert best is not None
    return best[1], best[2]


def silhouette(distances: FloatArray, labels: IntArray) -> float:
    """The mean silhouette of the rows whose pairwise distances are `distances` (a member alone in its
    group scores 0, as in scikit-learn)."""
    k = int(labels.max()) + 1
    one_hot = np.zeros((len(labels), k), dtype=np.float32)
    one_hot[np.arange(len(labels)), labels] = 1.0
    counts = one_hot.sum(axis=0)
    sums = distances @ one_hot
    own_count = counts[labels]
    rows = np.arange(len(labels))
    own = sums[rows, labels] / np.maximum(own_count - 1.0, 1.0)
    mean_other = sums / np.maximum(counts, 1.0)
    mean_other[rows, labels] = np.inf
    mean_other[:, counts == 0] = np.inf
    other = mean_other.min(axis=1)
    scores = (other - own) / np.maximum(np.maximum(own, other), 1e-12)
    scores[own_count <= 1] = 0.0
    return float(scores.mean())


def k_grid(count: int, settings: DiscoverySettings) -> list[int]:
    """The K values tried for `count` tickets: `grid` values geometric from `min_k` to the smaller of
    `max_k` and a group per `per_group` tickets (every value where the step is under one)."""
    top = max(settings.min_k, min(settings.max_k, count // max(settings.per_group, 1)))
    values = np.geomspace(settings.min_k, top, settings.grid) if top > settings.min_k else [top]
    return sorted({round(float(v)) for v in values})


def estimate_k(
    x: FloatArray, settings: DiscoverySettings, rng: np.random.Generator, progress: Progress | None = None
) -> tuple[int, dict[int, float]]:
    """(K, the silhouette of each K tried, the mean of `runs_per_k` seedings): the scores smoothed by a
    triangular kernel over log K (zero at a factor `window` away), the smallest K within `tolerance` of
    the best smoothed score, then the K of best unsmoothed score within a factor `refine` of it (a sharp
    peak, as well-separated intents give, is otherwise smoothed away).
    One K-means run's silhouette moves by more than the differences between neighbouring K (measured on
    BANKING77 train subsets): the mean and the smoothing are what make the choice stable."""
    sample = rng.choice(len(x), size=min(len(x), settings.silhouette_sample), replace=False)
    distances = np.maximum(1.0 - x[sample] @ x[sample].T, 0.0).astype(np.float32)
    grid = k_grid(len(x), settings)
    scores: dict[int, float] = {}
    for done, k in enumerate(grid, 1):
        runs = [kmeans(x, k, rng, settings.iterations)[0] for _ in range(settings.runs_per_k)]
        scores[k] = float(np.mean([silhouette(distances, labels[sample]) for labels in runs]))
        if progress is not None:
            progress(done, len(grid))
    values = np.array([scores[k] for k in grid])
    logs = np.log(np.array(grid, dtype=np.float64))
    weights = np.maximum(1.0 - np.abs(logs[:, None] - logs[None, :]) / math.log(settings.window), 0.0)
    smooth = (weights @ values) / weights.sum(axis=1)
    best = float(smooth.max())
    centre = min(k for k, v in zip(grid, smooth, strict=True) if v >= best - settings.tolerance * abs(best))
    near = [k for k in grid if abs(math.log(k / centre)) <= math.log(settings.refine)]
    return max(near, key=lambda k: (scores[k], -k)), scores


def terms_of(text: str) -> list[str]:
    """A ticket's words for naming: lower case, no placeholders, no stop words; and its two-word terms
    (adjacent words left after the stop words are dropped)."""
    words = [w for w in _WORD.findall(_PLACEHOLDER.sub(" ", text.lower())) if w not in STOP_WORDS]
    return words + [f"{a}_{b}" for a, b in itertools.pairwise(words) if a != b]


def group_terms(texts: Sequence[str], groups: Sequence[Sequence[int]]) -> list[list[tuple[str, float]]]:
    """Per group, its terms by class-based TF-IDF, best first: the term's share of the group's terms times
    log(1 + the mean terms per group / the term's count over every group)."""
    counts = [Counter(t for i in members for t in terms_of(texts[i])) for members in groups]
    overall: Counter[str] = Counter()
    for count in counts:
        overall.update(count)
    mean_terms = sum(overall.values()) / max(len(groups), 1)
    ranked = []
    for count in counts:
        total = max(sum(count.values()), 1)
        scored = [(t, (c / total) * math.log(1.0 + mean_terms / overall[t])) for t, c in count.items()]
        # Ties broken by the term itself: the same names whatever order the tickets came in.
        ranked.append(sorted(scored, key=lambda item: (-item[1], item[0])))
    return ranked


def name_from_terms(terms: Sequence[str], taken: set[str]) -> str:
    """A snake_case name from the best terms (`terms`, best first): the best two-word term made of the
    three best words, else the two best words; not in `taken`: longer with the next word, else numbered."""
    words = [t for t in terms if "_" not in t]
    best = set(words[: NAME_TERMS + 1])
    pair = next((t for t in terms if "_" in t and set(t.split("_")) <= best), None)
    base = pair or "_".join(words[:NAME_TERMS]) or "new_intent"
    candidates = [base, *(f"{base}_{t}" for t in terms[1:4] if "_" not in t and t not in base.split("_"))]
    for candidate in candidates:
        if candidate not in taken:
            return candidate
    number = 2
    while f"{base}_{number}" in taken:
        number += 1
    return f"{base}_{number}"


def discover(
    vectors: npt.NDArray[np.floating],
    texts: Sequence[str],
    known: Mapping[str, npt.NDArray[np.floating]] | None = None,
    settings: DiscoverySettings | None = None,
    progress: Progress | None = None,
) -> Discovery:
    """Proposed intents for the tickets embedded as `vectors` (row i is `texts[i]`, already redacted: names
    and descriptions come from them). `known`: each existing intent's centre, for the duplicate flags and
    so that no proposal takes an existing name."""
    settings = settings or DiscoverySettings()
    known = known or {}
    if len(vectors) != len(texts):
        raise ValueError(f"{len(vectors)} vectors for {len(texts)} texts")
    x = normalised(vectors)
    rng = np.random.default_rng(settings.seed)
    if len(x) < max(settings.min_size, settings.min_k):
        nowhere, far = _nearest(x, x[:0])
        return Discovery((), nowhere, nowhere, far, (), {})
    k, scores = estimate_k(x, settings, rng, progress)
    labels, centres = kmeans(x, k, rng, settings.iterations, settings.restarts)
    distance = np.maximum(1.0 - np.einsum("ij,ij->i", x, centres[labels]), 0.0).astype(np.float32)
    kept = _coherent_groups(labels, distance, k, settings)
    assigned = _assigned(labels, distance, kept, settings)
    groups = [np.flatnonzero(assigned == g) for g in kept]
    groups = [members[np.argsort(distance[members], kind="stable")] for members in groups]
    ranked = group_terms(texts, [m.tolist() for m in groups])
    taken = set(known)
    intents = []
    known_names = sorted(known)
    known_centres = normalised(np.stack([known[n] for n in known_names])) if known_names else None
    for g, members, terms in zip(kept, groups, ranked, strict=True):
        name = name_from_terms([t for t, _ in terms], taken)
        taken.add(name)
        top = [t.replace("_", " ") for t, _ in terms[:DESCRIPTION_TERMS]]
        description = f"Tickets about {', '.join(top) or 'no common words'} ({len(members)} found)"
        duplicate, similar = None, None
        if known_centres is not None:
            similarities = known_centres @ centres[g]
            best = int(similarities.argmax())
            if similarities[best] >= settings.duplicate_similarity:
                duplicate, similar = known_names[best], float(similarities[best])
        intents.append(
            ProposedIntent(
                name=name,
                description=description,
                terms=tuple(t for t, _ in terms[:DESCRIPTION_TERMS]),
                members=tuple(int(i) for i in members),
                examples=tuple(int(i) for i in members[:EXAMPLES]),
                cohesion=float(1.0 - distance[members].mean()),
                duplicate_of=duplicate,
                duplicate_similarity=similar,
            )
        )
    renumbered = np.full(len(x), UNASSIGNED, dtype=np.int64)
    for index, members in enumerate(groups):
        renumbered[members] = index
    nearest, nearest_distance = _nearest(x, centres[kept])
    return Discovery(
        intents=tuple(intents),
        assignment=renumbered,
        nearest=nearest,
        distance=nearest_distance,
        overlaps=_overlaps(intents, centres[kept], settings.overlap_similarity),
        silhouettes=scores,
    )


def _coherent_groups(
    labels: IntArray, distance: FloatArray, k: int, settings: DiscoverySettings
) -> list[int]:
    """The groups kept: at least `min_size` members and a mean similarity to the centre of at least
    `min_cohesion`, largest first (ties by group index)."""
    counts = np.bincount(labels, minlength=k)
    kept = []
    for g in range(k):
        members = labels == g
        if counts[g] >= settings.min_size and 1.0 - float(distance[members].mean()) >= settings.min_cohesion:
            kept.append(g)
    return sorted(kept, key=lambda g: (-int(counts[g]), g))


def _assigned(
    labels: IntArray, distance: FloatArray, kept: list[int], settings: DiscoverySettings
) -> IntArray:
    """Each ticket's group, `UNASSIGNED` for a group not kept and for a ticket past both its group's Tukey
    fence and `max_distance`."""
    result = np.full(len(labels), UNASSIGNED, dtype=np.int64)
    for g in kept:
        members = np.flatnonzero(labels == g)
        q1, q3 = np.quantile(distance[members], [0.25, 0.75])
        fence = max(float(q3 + 1.5 * (q3 - q1)), settings.max_distance)
        result[members[distance[members] <= fence]] = g
    return result


def _nearest(x: FloatArray, centres: FloatArray) -> tuple[IntArray, FloatArray]:
    """Each ticket's nearest proposal (index into `centres`) and cosine distance to it; `UNASSIGNED` and
    distance 1 when there is no proposal."""
    if len(centres) == 0:
        return np.full(len(x), UNASSIGNED, dtype=np.int64), np.ones(len(x), dtype=np.float32)
    similarity = x @ centres.T
    nearest = similarity.argmax(axis=1).astype(np.int64)
    distance = np.maximum(1.0 - similarity[np.arange(len(x)), nearest], 0.0).astype(np.float32)
    return nearest, distance


def _overlaps(
    intents: Sequence[ProposedIntent], centres: FloatArray, threshold: float
) -> tuple[Overlap, ...]:
    """Pairs of proposals whose centres are at least `threshold` alike, most alike first."""
    if len(intents) < 2:
        return ()
    similarity = centres @ centres.T
    pairs = [
        Overlap(intents[a].name, intents[b].name, float(similarity[a, b]))
        for a in range(len(intents))
        for b in range(a + 1, len(intents))
        if similarity[a, b] >= threshold
    ]
    return tuple(sorted(pairs, key=lambda o: -o.similarity))
