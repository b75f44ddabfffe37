"""Fitting the out-of-scope detector of an encoder stage (worker/inference/out_of_scope.py serves it).

The statistics are the embeddings the head learnt from (its training tickets and the taxonomy's texts, so
that an intent without tickets is not out of scope by construction). The threshold is the operating point:
the smallest distance that flags at most `in_scope_loss` of in-scope tickets held out from the statistics,
the validation part's tickets where there is one, else each training ticket against all the others
(leave-one-out). Then, as a measured figure for the model card, the same fit with a quarter of the intents
held out as stand-ins for the unknown: the share of their tickets it flags (`stand_in_recall`). No
stand-in tunes anything: the nearest-ticket distance needs no example of the unknown.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from worker.errors import UserError
from worker.inference.out_of_scope import FloatArray, OutOfScopeDetector, nearest_distance

# The share of in-scope tickets the detector may flag: `model train --in-scope-loss` overrides it.
DEFAULT_IN_SCOPE_LOSS = 0.02
METHOD = "cosine distance to the nearest training ticket"
# Intents held out as stand-ins for the unknown when measuring the detector at training.
STAND_IN_SHARE = 0.25
# Rows per product when scoring each training ticket against the others (memory: rows x training tickets).
_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class OutOfScopeReport:
    """How the operating point was chosen and what it measured on held-out tickets."""

    method: str
    threshold: float
    in_scope_loss_target: float
    in_scope_flagged: float  # share of the held-out in-scope tickets flagged at `threshold`
    held_out: int
    held_out_from: str  # "validation" or "leave-one-out"
    reference_rows: int
    stand_in_intents: int  # intents held out as stand-ins for the unknown (0: too few intents)
    stand_in_recall: float | None  # share of their tickets flagged, the rest fitted the same way
    stand_in_in_scope_flagged: float | None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_in_scope_loss(value: float) -> float:
    if not 0.0 < value < 0.5:
        raise UserError(f"the in-scope loss must be a share between 0 and 0.5 (0.02 is 2 %), got {value}")
    return value


def threshold_for(held_out_scores: FloatArray, in_scope_loss: float) -> float:
    """The smallest of `held_out_scores` that at most `in_scope_loss` of them exceed."""
    ordered = np.sort(held_out_scores)
    allowed = int(np.floor(in_scope_loss * len(ordered)))
    return float(ordered[len(ordered) - 1 - allowed])


def leave_one_out_distances(reference: FloatArray, rows: Sequence[int]) -> FloatArray:
    """Each of `rows` of `reference` against every other reference row."""
    distances = np.zeros(len(rows), dtype=np.float32)
    for start in range(0, len(rows), _CHUNK):
        chunk = list(rows[start : start + _CHUNK])
        similarities = reference[chunk] @ reference.T
        similarities[np.arange(len(chunk)), chunk] = -np.inf
        distances[start : start + len(chunk)] = 1.0 - similarities.max(axis=1)
    return distances


def fit_out_of_scope(
    reference: FloatArray,
    reference_intents: Sequence[int],
    reference_tickets: Sequence[bool],
    held: FloatArray,
    held_intents: Sequence[int],
    *,
    in_scope_loss: float,
    seed: int,
) -> tuple[OutOfScopeDetector, OutOfScopeReport]:
    """The detector over `reference` (normalised embeddings, `reference_intents` each row's intent,
    `reference_tickets` whether it is a ticket: a taxonomy text is never held out), its threshold from `held`
    (the validation part) or, when that is empty, leave-one-out over the reference tickets; and the
    stand-in measurement."""
    check_in_scope_loss(in_scope_loss)
    owners = np.asarray(reference_intents)
    is_ticket = np.asarray(reference_tickets, dtype=bool)
    held_owners = np.asarray(held_intents)
    tickets = [int(row) for row in np.flatnonzero(is_ticket)]
    if len(held):
        held_scores, held_out_from = nearest_distance(reference, held), "validation"
    elif len(tickets) >= 2:
        held_scores, held_out_from = leave_one_out_distances(reference, tickets), "leave-one-out"
    else:
        raise UserError("the out-of-scope detector needs 2 labelled tickets at least")
    threshold = threshold_for(held_scores, in_scope_loss)
    intents = sorted({int(i) for i in owners[tickets]} | {int(i) for i in held_owners})
    recall = flagged = None
    stand_ins = max(1, round(STAND_IN_SHARE * len(intents))) if len(intents) >= 4 else 0
    if stand_ins:
        unknown = set(random.Random(seed).sample(intents, stand_ins))
        is_unknown = np.array([int(i) in unknown for i in owners])
        known_reference = reference[~is_unknown]
        if len(held):
            known_held = held[~np.isin(held_owners, list(unknown))]
            known_scores = nearest_distance(known_reference, known_held)
        else:
            kept = np.flatnonzero(~is_unknown)
            known_rows = [int(k) for k, row in enumerate(kept) if is_ticket[row]]
            known_scores = leave_one_out_distances(known_reference, known_rows)
        stand_in_threshold = threshold_for(known_scores, in_scope_loss)
        unknown_rows = np.concatenate(
            [reference[is_unknown & is_ticket], held[np.isin(held_owners, list(unknown))]]
        )
        recall = float((nearest_distance(known_reference, unknown_rows) > stand_in_threshold).mean())
        flagged = float((known_scores > stand_in_threshold).mean())
    detector = OutOfScopeDetector(reference, threshold, in_scope_loss)
    report = OutOfScopeReport(
        method=METHOD,
        threshold=threshold,
        in_scope_loss_target=in_scope_loss,
        in_scope_flagged=float((held_scores > threshold).mean()),
        held_out=len(held_scores),
        held_out_from=held_out_from,
        reference_rows=len(reference),
        stand_in_intents=stand_ins,
        stand_in_recall=recall,
        stand_in_in_scope_flagged=flagged,
    )
    return detector, report


def auroc(in_scope_scores: FloatArray, out_of_scope_scores: FloatArray) -> float:
    """The area under the ROC curve of the score as a detector of out-of-scope tickets (threshold-free):
    the probability that an out-of-scope ticket scores higher than an in-scope one."""
    from sklearn.metrics import roc_auc_score

    truth = np.r_[np.zeros(len(in_scope_scores)), np.ones(len(out_of_scope_scores))]
    return float(roc_auc_score(truth, np.r_[in_scope_scores, out_of_scope_scores]))


def open_set_figures(
    in_scope_right: Sequence[bool],
    in_scope_scores: FloatArray,
    out_of_scope_scores: FloatArray,
    threshold: float,
) -> dict[str, float]:
    """The literature's figures for a score flagging tickets over `threshold` as out of scope, on in-scope
    tickets (`in_scope_right`: whether the head's intent was right) and out-of-scope ones: out-of-scope
    recall and precision, in-scope accuracy (right and not flagged), the in-scope tickets flagged (the loss),
    and AUROC."""
    flagged_in = in_scope_scores > threshold
    flagged_out = out_of_scope_scores > threshold
    flagged = int(flagged_in.sum() + flagged_out.sum())
    return {
        "out_of_scope_recall": float(flagged_out.mean()),
        "out_of_scope_precision": float(flagged_out.sum() / flagged) if flagged else 0.0,
        "in_scope_accuracy": float(np.mean(np.asarray(in_scope_right) & ~flagged_in)),
        "in_scope_flagged": float(flagged_in.mean()),
        "auroc": auroc(in_scope_scores, out_of_scope_scores),
    }
