"""Fitting the out-of-scope detector of an encoder stage (worker/inference/out_of_scope.py serves it).

The statistics are the embeddings the head learnt from (its training tickets and the taxonomy's texts, so
that an intent without tickets is not out of scope by construction). The threshold is the operating point:
the smallest score that flags at most `in_scope_loss` of new in-scope tickets with `ASSURANCE` confidence,
judged on in-scope tickets held out from the statistics. Where there is a validation part it is chosen by
cross-fitting (`cross_fitted_scores`): the training and validation tickets pooled in `CROSS_FIT_FOLDS`
folds, each fold scored by statistics and a doubt's head fitted on the other folds, the threshold from all
those out-of-fold scores; else each training ticket against all the others (leave-one-out). Then, as a
measured figure for the model card, the same fit with a quarter of the intents held out as stand-ins for the
unknown: the share of their tickets it flags (`stand_in_recall`). No stand-in chooses the threshold; they
choose how much the stage's doubt (1 - its winning probability) adds to the distance, among `DOUBT_WEIGHTS`,
with a head fitted without them (a validation part is needed: a few-shot folder's training tickets are not
held out from its head, so it scores the distance alone). A zero-shot folder has no ticket: its statistics
are the intents' prototypes and its held-out rows the taxonomy's example phrases (`fit_prototype_detector`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from worker.errors import UserError
from worker.inference.out_of_scope import FloatArray, OutOfScopeDetector, nearest_distance

# The share of in-scope tickets the detector may flag: `model train --in-scope-loss` overrides it.
DEFAULT_IN_SCOPE_LOSS = 0.02
# The confidence that the operating point flags at most the in-scope loss of new in-scope tickets. The
# held-out share is an estimate from a sample: a threshold flagging exactly the loss of the held-out tickets
# flags more than that of new ones about half the time (BANKING77 open-intent, 2 % aimed at on validation
# parts of 224-784 tickets: 2.1-3.2 % of test tickets flagged on average over 5 seeds, up to 5.7 %; with this
# assurance 1.4-1.6 %, up to 3.0 %).
ASSURANCE = 0.9
DISTANCE_ALONE = "cosine distance to the nearest training ticket"
PROTOTYPE_DISTANCE = "cosine distance to the nearest intent's prototype (the mean of its taxonomy texts)"
METHOD = f"{DISTANCE_ALONE} + weight x (1 - the stage's winning probability)"
# The weights of the head's doubt tried on the stand-ins (BANKING77 open-intent splits of train.csv, 5 seeds:
# the weight so chosen caught 26.5 -> 38.7 % of the unknown intents' tickets with 75 % of the intents known,
# 44.6 -> 46.1 % with 50 %, 60.3 -> 59.5 % with 25 %, at the same 2 % in-scope loss).
DOUBT_WEIGHTS = (0.0, 0.05, 0.1, 0.2, 0.4)
# Embeddings -> the head's doubt of each (1 - its winning probability); rows and intents -> such a function
# of a head fitted on them.
Doubt = Callable[[FloatArray], FloatArray]
DoubtFitter = Callable[[FloatArray, Sequence[int]], Doubt]
# Intents held out as stand-ins for the unknown when measuring the detector at training.
STAND_IN_SHARE = 0.25
# Reviewers' "none of these" tickets that choose the doubt's weight instead of the stand-ins: real unknowns
# beat imitated ones once each moves the recall by 5 points at most.
REVIEWED_TO_CHOOSE = 20
# Folds of the cross-fit choosing a full folder's threshold. The validation part alone (a tenth of the
# tickets: 224-1,003 on BANKING77-built taxonomies) made the threshold its 2nd to 14th largest score, and
# the test tickets flagged at a 2 % promise ranged 0-3.0 % (results/open-intent.md); the pooled out-of-fold
# scores of every ticket choose it from ten times as many (results/scope-promise.md).
CROSS_FIT_FOLDS = 5
# Rows per product when scoring each training ticket against the others (memory: rows x training tickets).
_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class OutOfScopeReport:
    """How the operating point was chosen and what it measured on held-out tickets."""

    method: str
    threshold: float
    doubt_weight: float  # of the head's 1 - winning probability, added to the distance
    in_scope_loss_target: float
    assurance: float  # the confidence that new in-scope tickets are flagged at most the target share
    in_scope_flagged: float  # share of the held-out in-scope tickets flagged at `threshold`
    held_out: int
    # "cross-fit, k folds" (of the training and validation tickets), "validation" (a folder written before
    # the cross-fit), "leave-one-out" or (zero-shot) "leave-one-out examples".
    held_out_from: str
    reference_rows: int
    stand_in_intents: int  # intents held out as stand-ins for the unknown (0: too few intents)
    stand_in_recall: float | None  # share of their tickets flagged, the rest fitted the same way
    stand_in_in_scope_flagged: float | None
    stand_in_recall_distance_alone: float | None  # the same with weight 0
    # What chose the doubt's weight: "stand-ins", "reviewed tickets" or "none" (weight 0).
    doubt_weight_chosen_on: str = "none"
    # Tickets reviewers said fit none of the intents, and the share of them the detector flags.
    reviewed_out_of_scope: int = 0
    reviewed_out_of_scope_flagged: float | None = None
    # Cross-fitted: the share of the validation part's tickets flagged by the served statistics at the
    # threshold (the figure the card gave before the cross-fit; None without a validation part).
    validation_in_scope_flagged: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_in_scope_loss(value: float) -> float:
    if not 0.0 < value < 0.5:
        raise UserError(f"the in-scope loss must be a share between 0 and 0.5 (0.02 is 2 %), got {value}")
    return value


def allowed_flags(held_out: int, in_scope_loss: float, assurance: float = ASSURANCE) -> int:
    """The most of `held_out` in-scope tickets a threshold may flag for the share of all in-scope tickets it
    flags to be at most `in_scope_loss` with `assurance` (the one-sided Clopper-Pearson bound: flagging that
    few would have a binomial probability of at most 1 - `assurance` were the true share the loss); 0 when
    even none cannot assure it (fewer than 114 held-out tickets for 2 % at 90 %)."""
    log_p, log_q = math.log(in_scope_loss), math.log1p(-in_scope_loss)
    cumulative = 0.0
    for flagged in range(held_out + 1):
        cumulative += math.exp(
            math.lgamma(held_out + 1)
            - math.lgamma(flagged + 1)
            - math.lgamma(held_out - flagged + 1)
            + flagged * log_p
            + (held_out - flagged) * log_q
        )
        if cumulative > 1.0 - assurance:
            return max(0, flagged - 1)
    return held_out


def threshold_for(held_out_scores: FloatArray, in_scope_loss: float) -> float:
    """The smallest of `held_out_scores` that at most `allowed_flags` of them exceed: the operating point
    for `in_scope_loss` on new in-scope tickets, with `ASSURANCE`."""
    ordered = np.sort(held_out_scores)
    allowed = allowed_flags(len(ordered), in_scope_loss)
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


def cross_fit_folds(intents: Sequence[int], folds: int, seed: int) -> list[int]:
    """Each row's fold, stratified: every intent's rows shuffled (seeded) and dealt round the folds from a
    random start, so that no fold lacks an intent the others have many of."""
    rng = random.Random(seed)
    fold_of = [0] * len(intents)
    by_intent: dict[int, list[int]] = {}
    for row, intent in enumerate(intents):
        by_intent.setdefault(int(intent), []).append(row)
    for intent in sorted(by_intent):
        rows = by_intent[intent]
        rng.shuffle(rows)
        start = rng.randrange(folds)
        for position, row in enumerate(rows):
            fold_of[row] = (start + position) % folds
    return fold_of


def cross_fitted_scores(
    tickets: FloatArray,
    intents: Sequence[int],
    texts: FloatArray,
    text_intents: Sequence[int],
    *,
    weight: float,
    fit_doubt: DoubtFitter | None,
    seed: int,
    folds: int = CROSS_FIT_FOLDS,
) -> FloatArray:
    """Every ticket's score from statistics that never saw it: `tickets` (normalised, each of `intents`)
    dealt in `folds`, each fold scored against the other folds' tickets and the taxonomy's `texts` (always
    in: the served statistics hold them), plus `weight` x the doubt of a head `fit_doubt` fits on those
    same rows. The threshold from these scores is judged on rows in no role of their own statistics, as a
    new ticket is: not the rows that fitted the head or the reference, nor only the validation tenth."""
    fold_of = np.asarray(cross_fit_folds(intents, folds, seed))
    owners = np.asarray(intents)
    scores = np.zeros(len(tickets), dtype=np.float32)
    for fold in range(folds):
        held = fold_of == fold
        if not held.any():
            continue
        reference = np.concatenate([tickets[~held], texts])
        scores[held] = nearest_distance(reference, tickets[held])
        if weight:
            assert fit_doubt is not None
            doubt = fit_doubt(reference, [*owners[~held].tolist(), *text_intents])
            scores[held] += weight * doubt(tickets[held])
    return scores


def fit_out_of_scope(
    reference: FloatArray,
    reference_intents: Sequence[int],
    reference_tickets: Sequence[bool],
    held: FloatArray,
    held_intents: Sequence[int],
    *,
    in_scope_loss: float,
    seed: int,
    doubt: Doubt | None = None,
    fit_doubt: DoubtFitter | None = None,
    reviewed: FloatArray | None = None,
    cross_fit: bool = True,
) -> tuple[OutOfScopeDetector, OutOfScopeReport]:
    """The detector over `reference` (normalised embeddings, `reference_intents` each row's intent,
    `reference_tickets` whether it is a ticket: a taxonomy text is never held out), its threshold from the
    out-of-fold scores of the reference tickets and `held` (the validation part) pooled
    (`cross_fitted_scores`), or, when `held` is empty, leave-one-out over the reference tickets; and the
    stand-in measurement. The report's `in_scope_flagged` is on the rows that chose the threshold,
    `validation_in_scope_flagged` on `held` as served.

    With a validation part, `doubt` (the head's 1 - winning probability) and `fit_doubt` (the same head
    fitted on other rows), the score adds the doubt times the weight of `DOUBT_WEIGHTS` that catches most
    stand-ins at the loss target; otherwise the distance alone (weight 0). `reviewed`: tickets reviewers
    said fit none of the intents (normalised embeddings); at least `REVIEWED_TO_CHOOSE` of them choose the
    weight instead of the stand-ins, and the report says how many of them the detector flags. Not
    `cross_fit` (an encoder fine-tuned on the reference tickets: their out-of-fold scores would still be
    too small), `held` alone chooses the threshold."""
    check_in_scope_loss(in_scope_loss)
    owners = np.asarray(reference_intents)
    is_ticket = np.asarray(reference_tickets, dtype=bool)
    held_owners = np.asarray(held_intents)
    tickets = [int(row) for row in np.flatnonzero(is_ticket)]
    if len(held):
        held_distances, held_out_from = nearest_distance(reference, held), "validation"
    elif len(tickets) >= 2:
        held_distances, held_out_from = leave_one_out_distances(reference, tickets), "leave-one-out"
    else:
        raise UserError("the out-of-scope detector needs 2 labelled tickets at least")
    weighs_doubt = bool(len(held)) and doubt is not None and fit_doubt is not None
    intents = sorted({int(i) for i in owners[tickets]} | {int(i) for i in held_owners})
    stand_ins = max(1, round(STAND_IN_SHARE * len(intents))) if len(intents) >= 4 else 0
    recalls: dict[float, tuple[float, float]] = {}
    if stand_ins:
        unknown = list(random.Random(seed).sample(intents, stand_ins))
        is_unknown = np.isin(owners, unknown)
        known_reference = reference[~is_unknown]
        unknown_rows = np.concatenate(
            [reference[is_unknown & is_ticket], held[np.isin(held_owners, unknown)]]
        )
        unknown_distances = nearest_distance(known_reference, unknown_rows)
        if len(held):
            known_held = held[~np.isin(held_owners, unknown)]
            known_distances = nearest_distance(known_reference, known_held)
        else:
            kept = np.flatnonzero(~is_unknown)
            known_rows = [int(k) for k, row in enumerate(kept) if is_ticket[row]]
            known_distances = leave_one_out_distances(known_reference, known_rows)
        known_doubt = unknown_doubt = np.zeros(0, dtype=np.float32)
        if weighs_doubt:
            assert fit_doubt is not None
            stand_in_doubt = fit_doubt(known_reference, owners[~is_unknown].tolist())
            known_doubt, unknown_doubt = stand_in_doubt(known_held), stand_in_doubt(unknown_rows)
        for weight in DOUBT_WEIGHTS if weighs_doubt else (0.0,):
            known_scores = known_distances + weight * known_doubt if weight else known_distances
            unknown_scores = unknown_distances + weight * unknown_doubt if weight else unknown_distances
            stand_in_threshold = threshold_for(known_scores, in_scope_loss)
            recalls[weight] = (
                float((unknown_scores > stand_in_threshold).mean()),
                float((known_scores > stand_in_threshold).mean()),
            )
    reviewed_x = np.zeros((0, reference.shape[1]), dtype=np.float32) if reviewed is None else reviewed
    reviewed_distances = nearest_distance(reference, reviewed_x)

    @functools.cache
    def doubts() -> tuple[FloatArray, FloatArray]:
        """The (held-out, reviewed) tickets' doubt, once: every weight tried reads it."""
        assert doubt is not None
        return doubt(held), doubt(reviewed_x)

    def scored(weight: float) -> tuple[FloatArray, FloatArray]:
        """(held-out, reviewed) scores with `weight` x the doubt."""
        if not weight:
            return held_distances, reviewed_distances
        held_doubt, reviewed_doubt = doubts()
        return held_distances + weight * held_doubt, reviewed_distances + weight * reviewed_doubt

    def reviewed_recall(weight: float) -> float:
        held_scores, reviewed_scores = scored(weight)
        return float((reviewed_scores > threshold_for(held_scores, in_scope_loss)).mean())

    # The weight catching most of the reviewers' "none of these" tickets, else of the stand-ins (the smallest
    # of equals); 0 with neither to choose it on.
    weight, chosen_on = 0.0, "none"
    if weighs_doubt and len(reviewed_x) >= REVIEWED_TO_CHOOSE:
        weight = max(DOUBT_WEIGHTS, key=lambda w: (reviewed_recall(w), -w))
        chosen_on = "reviewed tickets"
    elif recalls and weighs_doubt:
        weight, chosen_on = max(recalls, key=lambda w: (recalls[w][0], -w)), "stand-ins"
    held_scores, reviewed_scores = scored(weight)
    chosen_from, chosen_on_rows = held_scores, held_out_from
    if len(held) and cross_fit:
        pooled = np.concatenate([reference[tickets], held])
        chosen_from = cross_fitted_scores(
            pooled,
            [*owners[tickets].tolist(), *held_owners.tolist()],
            reference[~is_ticket],
            owners[~is_ticket].tolist(),
            weight=weight,
            fit_doubt=fit_doubt,
            seed=seed,
        )
        chosen_on_rows = f"cross-fit, {CROSS_FIT_FOLDS} folds"
    threshold = threshold_for(chosen_from, in_scope_loss)
    detector = OutOfScopeDetector(reference, threshold, in_scope_loss, weight)
    report = OutOfScopeReport(
        method=METHOD if weight else DISTANCE_ALONE,
        threshold=threshold,
        doubt_weight=weight,
        in_scope_loss_target=in_scope_loss,
        assurance=ASSURANCE,
        in_scope_flagged=float((chosen_from > threshold).mean()),
        held_out=len(chosen_from),
        held_out_from=chosen_on_rows,
        reference_rows=len(reference),
        stand_in_intents=stand_ins,
        stand_in_recall=recalls[weight][0] if recalls else None,
        stand_in_in_scope_flagged=recalls[weight][1] if recalls else None,
        stand_in_recall_distance_alone=recalls[0.0][0] if recalls else None,
        doubt_weight_chosen_on=chosen_on,
        reviewed_out_of_scope=len(reviewed_x),
        reviewed_out_of_scope_flagged=float((reviewed_scores > threshold).mean())
        if len(reviewed_x)
        else None,
        validation_in_scope_flagged=float((held_scores > threshold).mean())
        if chosen_from is not held_scores
        else None,
    )
    return detector, report


def fit_prototype_detector(
    prototypes: FloatArray, held_out_distances: FloatArray, in_scope_loss: float
) -> tuple[OutOfScopeDetector, OutOfScopeReport]:
    """A zero-shot folder's detector: the score is the cosine distance to the nearest intent's prototype
    (the reference rows are the prototypes, so the served score is the same product), the threshold from
    `held_out_distances`, each example phrase's distance to prototypes built without it. No ticket exists
    to do better with: with fewer than 114 phrases the assurance leaves the largest of them as the threshold
    (bank-desk's 36: 0.6 % of BANKING77 test tickets flagged, 54 of the 80 other-domain tickets)."""
    check_in_scope_loss(in_scope_loss)
    threshold = threshold_for(held_out_distances, in_scope_loss)
    detector = OutOfScopeDetector(prototypes, threshold, in_scope_loss, 0.0)
    report = OutOfScopeReport(
        method=PROTOTYPE_DISTANCE,
        threshold=threshold,
        doubt_weight=0.0,
        in_scope_loss_target=in_scope_loss,
        assurance=ASSURANCE,
        in_scope_flagged=float((held_out_distances > threshold).mean()),
        held_out=len(held_out_distances),
        held_out_from="leave-one-out examples",
        reference_rows=len(prototypes),
        stand_in_intents=0,
        stand_in_recall=None,
        stand_in_in_scope_flagged=None,
        stand_in_recall_distance_alone=None,
    )
    return detector, report


def auroc(in_scope_scores: FloatArray, out_of_scope_scores: FloatArray) -> float:
    """The area under the ROC curve of the score as a detector of out-of-scope tickets (threshold-free):
    the probability that an out-of-scope ticket scores higher than an in-scope one, ties counting half
    (the Mann-Whitney statistic over every pair; numpy alone, so `model eval` needs no extra for it)."""
    inside = np.sort(np.asarray(in_scope_scores, dtype=np.float64))
    outside = np.asarray(out_of_scope_scores, dtype=np.float64)
    below = np.searchsorted(inside, outside, side="left")
    ties = np.searchsorted(inside, outside, side="right") - below
    return float((below + 0.5 * ties).sum() / (len(inside) * len(outside)))


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
