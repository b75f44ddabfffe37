"""Out of scope ("none of these"): a ticket far from every ticket the encoder stage learnt from fits none.

The head always picks one of the taxonomy's intents, and its probability is a poor judge of "none of these":
a ticket of a kind nobody labelled can sit confidently on one side of a decision boundary. What the encoder
knows beyond that probability is where the ticket lies among the training tickets: the score here is the
cosine distance to the nearest one (kNN with k = 1 in the encoder's normalised embedding space), plus the
head's doubt (1 - its winning probability) times a weight chosen at training (0 when it could not be), and
a ticket is out of scope when the score exceeds a threshold chosen at training for a stated in-scope loss
(the share of held-out in-scope tickets it flags; worker/learning/out_of_scope.py fits both).

The distance was chosen over a Mahalanobis distance to the intents' means (a shared, shrunk covariance) on
BANKING77 open-intent splits of train.csv (25/50/75 % of the intents known, two seeds each, threshold at 2 %
in-scope loss): out-of-scope recall 27-70 % for the nearest ticket, 17-39 % for Mahalanobis (Ledoit-Wolf
shrinkage; at most 53 % with any shrinkage tried), 19-41 % for the head's probability alone; AUROC
0.89-0.96, 0.76-0.93 and 0.88-0.92.

The statistics are the training tickets' embeddings (float16: the same flags as float32 on those splits),
the doubt's weight and the threshold, in `out_of_scope.npz` beside the head; `encoder.json` names the file.
The same rows, with each one's intent, serve the neighbour vote (worker/inference/neighbours.py), whose
probabilities are then the ones the doubt reads.
Scoring a ticket is one product with them (9,000 x 384 for BANKING77's full data), on the embedding and the
probabilities the encoder stage computes anyway.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worker.errors import UserError
from worker.inference.neighbours import NeighbourVote

OUT_OF_SCOPE_FILE = "out_of_scope.npz"

FloatArray = npt.NDArray[np.float32]


@dataclasses.dataclass(frozen=True)
class OutOfScopeDetector:
    """`reference`: normalised training embeddings (N x D); a ticket whose `scores` exceeds `threshold` is
    out of scope; `in_scope_loss`: the share of held-out in-scope tickets the threshold was chosen to flag
    (recorded for the model card); `doubt_weight`: how much the head's doubt adds to the distance."""

    reference: FloatArray
    threshold: float
    in_scope_loss: float
    doubt_weight: float

    def scores(self, embeddings: FloatArray, confidences: FloatArray) -> FloatArray:
        """Each normalised embedding's (B x D) cosine distance to its nearest reference embedding, plus
        `doubt_weight` x (1 - its served winning probability, `confidences`: the head's, blended with the
        neighbour vote where the folder has one)."""
        return self.scores_from_similarities(embeddings @ self.reference.T, confidences)

    def scores_from_similarities(self, similarities: FloatArray, confidences: FloatArray) -> FloatArray:
        """`scores` from the tickets' cosine similarities with the reference rows (B x N), for a caller that
        has them already (the encoder engine's neighbour vote reads the same product)."""
        distances = nearest_distance_from(similarities)
        if not self.doubt_weight:
            return distances
        scores: FloatArray = (distances + self.doubt_weight * (1.0 - confidences)).astype(np.float32)
        return scores

    def flags(self, scores: FloatArray) -> npt.NDArray[np.bool_]:
        flagged: npt.NDArray[np.bool_] = scores > self.threshold
        return flagged


def nearest_distance(reference: FloatArray, embeddings: FloatArray) -> FloatArray:
    """1 - the largest cosine similarity of each row of `embeddings` with a row of `reference` (both
    normalised): 0 for a ticket the reference holds, up to 2."""
    return nearest_distance_from(embeddings @ reference.T)


def nearest_distance_from(similarities: FloatArray) -> FloatArray:
    """`nearest_distance` from the cosine similarities of each ticket with every reference row (B x N)."""
    if len(similarities) == 0:
        return np.zeros(0, dtype=np.float32)
    distances: FloatArray = (1.0 - similarities.max(axis=1)).astype(np.float32)
    return distances


def write_statistics(path: Path, detector: OutOfScopeDetector, vote: NeighbourVote | None = None) -> None:
    """`detector` into `path`, with each reference row's intent and the vote's settings when `vote` reads
    the same rows (worker/inference/neighbours.py)."""
    arrays: dict[str, Any] = {  # Any: numpy's stubs match **arrays against savez's other keywords
        "reference": detector.reference.astype(np.float16),
        "threshold": np.float32(detector.threshold),
        "in_scope_loss": np.float32(detector.in_scope_loss),
        "doubt_weight": np.float32(detector.doubt_weight),
    }
    if vote is not None:
        assert vote.reference is detector.reference, "the vote reads the detector's reference rows"
        arrays |= {
            "intents": vote.intents.astype(np.int32),
            "vote_weight": np.float32(vote.weight),
            "vote_neighbours": np.int32(vote.neighbours),
            "vote_temperature": np.float32(vote.temperature),
        }
    np.savez(path, **arrays)


def read_statistics(
    path: Path, dimensions: int, labels: int
) -> tuple[OutOfScopeDetector, NeighbourVote | None]:
    """The detector of `path` and its neighbour vote (None in a folder written before the vote); a
    UserError when it cannot be read or does not fit a `dimensions`-wide encoder and a head of `labels`
    rows."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            reference = np.asarray(stored["reference"], dtype=np.float32)
            threshold = float(stored["threshold"])
            in_scope_loss = float(stored["in_scope_loss"])
            doubt_weight = float(stored["doubt_weight"])
            voting = "intents" in stored.files
            if voting:
                intents = np.asarray(stored["intents"], dtype=np.int32)
                weight = float(stored["vote_weight"])
                neighbours = int(stored["vote_neighbours"])
                temperature = float(stored["vote_temperature"])
    except (OSError, KeyError, ValueError) as error:
        raise UserError(f"cannot read the out-of-scope statistics {path}: {error}") from None
    if reference.ndim != 2 or reference.shape[1] != dimensions or len(reference) == 0:
        raise UserError(
            f"{path}: its reference embeddings {reference.shape} do not fit a {dimensions}-wide encoder"
        )
    detector = OutOfScopeDetector(reference, threshold, in_scope_loss, doubt_weight)
    if not voting:
        return detector, None
    if intents.shape != (len(reference),) or intents.min() < 0 or intents.max() >= labels:
        raise UserError(f"{path}: its rows' intents do not fit a head of {labels} labels")
    if not (0.0 <= weight <= 1.0 and neighbours >= 1 and temperature > 0.0):
        raise UserError(f"{path}: its neighbour vote's settings are out of range")
    return detector, NeighbourVote(reference, intents, labels, weight, neighbours, temperature)
