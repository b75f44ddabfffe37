"""Out of scope ("none of these", issue #46): the encoder stage's detector, fitted and served for real (the
shipped encoder, onnxruntime + tokenizers, BANKING77 tickets; no fakes)."""

from __future__ import annotations

import functools
import random
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
from encoder_stages import banking77_rows, serve_stage

from tools import REPO
from worker.errors import UserError
from worker.inference.encoder import MANIFEST, SentenceEmbedder, read_manifest
from worker.inference.out_of_scope import OUT_OF_SCOPE_FILE, OutOfScopeDetector, nearest_distance
from worker.inference.taxonomy import load_taxonomy, parse_taxonomy
from worker.learning import compose, encoder_stage
from worker.learning.out_of_scope import OutOfScopeReport, allowed_flags, fit_out_of_scope, threshold_for
from worker.settings import DEFAULT_ESCALATION_DIR

BANKING77 = REPO / "taxonomies" / "banking77.toml"
OUT_OF_DOMAIN = REPO / "data" / "out-of-domain" / "tickets.txt"
Row = tuple[str, str]


@functools.cache
def _embedder() -> SentenceEmbedder:
    return encoder_stage.open_embedder(threads=2)


def test_tickets_of_intents_it_was_not_fitted_on_are_flagged_far_more_than_by_the_confidence() -> None:
    """12 intents known (a seeded draw; 25 train.csv tickets each, fitted as `model train` fits them), then
    test.csv tickets of the 65 others and tickets of other domains arrive. Each detector's threshold is
    chosen on the same validation part for a 2 % in-scope loss: the detector flags several times as many."""
    taxonomy = load_taxonomy(BANKING77)
    drawn = sorted(random.Random(1).sample(range(len(taxonomy.intents)), 12))
    known_taxonomy = msgspec.structs.replace(taxonomy, intents=tuple(taxonomy.intents[i] for i in drawn))
    known = set(known_taxonomy.labels)
    by_intent: dict[str, list[Row]] = {intent: [] for intent in known}
    for row in banking77_rows("train"):
        if row[1] in known and len(by_intent[row[1]]) < 25:
            by_intent[row[1]].append(row)
    train, validation, kind = compose.split_rows([row for rows in by_intent.values() for row in rows], 77)
    assert kind == "full"
    head, report = encoder_stage.fit_encoder_stage(
        train, validation, known_taxonomy, _embedder(), max_seconds=600, in_scope_loss=0.02
    )
    detector = head.out_of_scope
    assert detector is not None and report.out_of_scope is not None
    validation_x = encoder_stage.embed(_embedder(), [text for text, _ in validation])
    doubt_threshold = threshold_for(1.0 - head.probabilities(validation_x).max(axis=1), 0.02)

    def recalls(texts: list[str]) -> tuple[float, float]:
        x = encoder_stage.embed(_embedder(), texts)
        by_confidence = (1.0 - head.probabilities(x).max(axis=1) > doubt_threshold).mean()
        scores = detector.scores(x, head.probabilities(x).max(axis=1))
        return float(detector.flags(scores).mean()), float(by_confidence)

    unknown_intents = recalls([text for text, intent in banking77_rows("test") if intent not in known][::16])
    other_domains = recalls([line for line in OUT_OF_DOMAIN.read_text(encoding="utf-8").splitlines() if line])
    # Measured: 25.8 % against 4.3 % of the unknown intents' 163 test tickets, 90.0 % against 6.2 % of the 80
    # tickets of other domains.
    assert unknown_intents[0] >= 2 * unknown_intents[1], unknown_intents
    assert other_domains[0] >= 0.8 and other_domains[0] >= 3 * other_domains[1], other_domains


def test_the_shipped_stage_keeps_to_its_in_scope_loss_on_held_out_tickets_and_says_none_of_these() -> None:
    """test.csv tickets (never fitted on, nor used to choose the threshold): about 2 % flagged; tickets of
    other domains: answered with the fallback intent, out of scope, the head's answer kept as the nearest."""
    in_scope = [text for text, _ in banking77_rows("test")][::16]
    answers = serve_stage(DEFAULT_ESCALATION_DIR, in_scope)
    flagged = sum(answer.out_of_scope for answer in answers) / len(answers)
    assert flagged <= 0.05, flagged  # target 2 % on validation; measured 2.0 % of all 3,080
    assert all(answer.out_of_scope_score is not None for answer in answers)

    other_domains = [line.strip() for line in OUT_OF_DOMAIN.read_text(encoding="utf-8").splitlines()]
    answers = serve_stage(DEFAULT_ESCALATION_DIR, [text for text in other_domains if text])
    out = [answer for answer in answers if answer.out_of_scope]
    assert len(out) >= 0.85 * len(answers), len(out)  # measured 73 of 80 (confidence: 29)
    taxonomy = load_taxonomy(BANKING77)
    for answer in out:
        assert (answer.intent, answer.priority) == (taxonomy.fallback_intent, taxonomy.fallback_priority)
        assert answer.confidence == 0.0 and not answer.fallback
        assert answer.nearest_intent in taxonomy.labels and answer.nearest_confidence is not None
        assert answer.out_of_scope_score is not None and answer.out_of_scope_score > 0.0


def _folder_copy(tmp_path: Path, with_detector: bool) -> Path:
    folder = tmp_path / "stage"
    shutil.copytree(DEFAULT_ESCALATION_DIR, folder, symlinks=True)
    manifest = read_manifest(folder)
    if not with_detector:
        (folder / OUT_OF_SCOPE_FILE).unlink()
        manifest = msgspec.structs.replace(manifest, out_of_scope=None)
    (folder / MANIFEST).write_bytes(msgspec.json.encode(manifest))
    return folder


def test_a_folder_without_out_of_scope_statistics_answers_every_ticket_with_an_intent(tmp_path: Path) -> None:
    folder = _folder_copy(tmp_path, with_detector=False)
    answers = serve_stage(folder, ["the printer on the third floor keeps jamming", "my card was stolen"])
    labels = load_taxonomy(BANKING77).labels
    for answer in answers:
        assert answer.intent in labels and answer.confidence > 0.0
        assert not answer.out_of_scope and answer.out_of_scope_score is None and answer.nearest_intent is None
    assert answers[1].intent == "lost_or_stolen_card"


def test_the_taxonomy_names_what_none_of_these_is_called(tmp_path: Path) -> None:
    folder = _folder_copy(tmp_path, with_detector=True)
    text = (folder / "taxonomy.toml").read_text(encoding="utf-8")
    (folder / "taxonomy.toml").write_text('out_of_scope_intent = "not_banking"\n' + text, encoding="utf-8")
    answer = serve_stage(folder, ["the printer on the third floor keeps jamming"])[0]
    assert answer.out_of_scope and answer.intent == "not_banking"
    assert answer.priority == load_taxonomy(BANKING77).fallback_priority


def test_an_out_of_scope_intent_that_is_one_of_the_intents_is_refused() -> None:
    data = {
        "name": "t",
        "out_of_scope_intent": "billing",
        "intents": [{"name": "billing", "description": "d", "priority": "Low"}],
    }
    with pytest.raises(UserError, match=r"out_of_scope_intent.*not one of the intents"):
        parse_taxonomy(data, "t.toml")


def test_the_operating_point_flags_at_most_the_in_scope_loss_of_the_held_out_scores() -> None:
    scores = np.linspace(0.0, 1.0, 1000, dtype=np.float32)
    for loss in (0.01, 0.02, 0.1):
        threshold = threshold_for(scores, loss)
        assert (scores > threshold).mean() <= loss
        # the smallest threshold flagging as many as the assurance allows
        assert (scores >= threshold).sum() == allowed_flags(len(scores), loss) + 1


def test_new_in_scope_tickets_are_flagged_at_most_the_in_scope_loss_nine_times_in_ten() -> None:
    """The threshold comes from a sample of held-out tickets; what a user is promised is about the tickets
    that arrive next. Drawn 400 times (1,000 held-out scores from one distribution, whose true share above
    any threshold is known): the share of new tickets flagged exceeds the 2 % loss in about a tenth of the
    draws (a threshold flagging exactly 2 % of the sample exceeds it in about half)."""
    rng = np.random.default_rng(46)
    exceeded = 0
    for _ in range(400):
        sample = rng.uniform(size=1000).astype(np.float32)
        true_share_flagged = 1.0 - threshold_for(sample, 0.02)  # uniform scores: P(score > t) = 1 - t
        exceeded += true_share_flagged > 0.02
    assert 0.05 * 400 <= exceeded <= 0.13 * 400, exceeded


def test_too_few_held_out_tickets_to_assure_the_loss_flag_none_of_them() -> None:
    assert allowed_flags(100, 0.02) == 0
    assert allowed_flags(1003, 0.02) == 13  # the shipped stage's validation part: 1.3 %, not 2 %


def test_enough_tickets_reviewers_said_fit_nothing_choose_the_doubt_s_weight() -> None:
    """Reviewers' "none of these" tickets that lie as near training tickets as in-scope ones do, but where
    the head hesitates: the distance alone cannot catch them, the doubt can; 20 of them choose its weight
    (fewer, and with too few intents for stand-ins, nothing chooses it: the distance alone)."""
    rng = np.random.default_rng(7)

    def around(centre: list[float], count: int, spread: float = 0.05) -> np.ndarray:
        points = np.asarray(centre, dtype=np.float32) + rng.normal(0.0, spread, (count, 3)).astype(np.float32)
        normalised: np.ndarray = points / np.linalg.norm(points, axis=1, keepdims=True)
        return normalised

    between = [1.0, 1.0, 0.0]  # as near intent 0's tickets as intent 1's: the head cannot tell
    reference = np.concatenate([around([1, 0, 0], 40), around([0, 1, 0], 40), around(between, 10)])
    intents = [0] * 40 + [1] * 40 + [0] * 10
    held = np.concatenate([around([1, 0, 0], 150), around([0, 1, 0], 150)])

    def doubt(x: np.ndarray) -> np.ndarray:
        hesitation: np.ndarray = 1.0 - np.abs(x[:, 0] - x[:, 1])
        return hesitation

    def fit(
        reviewed: np.ndarray,
    ) -> tuple[OutOfScopeDetector, OutOfScopeReport]:
        return fit_out_of_scope(
            reference, intents, [True] * len(intents), held, [0] * 150 + [1] * 150,
            in_scope_loss=0.02, seed=1, doubt=doubt, fit_doubt=lambda x, y: doubt, reviewed=reviewed,
        )  # fmt: skip

    _, few = fit(around(between, 19))
    assert (few.doubt_weight, few.doubt_weight_chosen_on) == (0.0, "none")
    assert few.reviewed_out_of_scope == 19 and few.reviewed_out_of_scope_flagged is not None
    _, enough = fit(around(between, 20))
    assert enough.doubt_weight > 0.0 and enough.doubt_weight_chosen_on == "reviewed tickets"
    assert enough.reviewed_out_of_scope_flagged is not None
    assert enough.reviewed_out_of_scope_flagged > few.reviewed_out_of_scope_flagged + 0.5


def _clustered_tickets(rng: np.random.Generator, count: int) -> tuple[np.ndarray, list[int]]:
    """`count` normalised tickets of 6 intents around seeded centres (the same for every call)."""
    centres = np.random.default_rng(59).normal(size=(6, 16)).astype(np.float32)
    intents = [int(i) for i in rng.integers(0, len(centres), count)]
    points = centres[intents] + rng.normal(0.0, 0.6, (count, 16)).astype(np.float32)
    normalised: np.ndarray = points / np.linalg.norm(points, axis=1, keepdims=True)
    return normalised, intents


@functools.cache
def _cross_fitted() -> tuple[np.ndarray, OutOfScopeDetector, OutOfScopeReport]:
    """(reference, detector, report) fitted on 1,800 training and 200 validation tickets."""
    rng = np.random.default_rng(1)
    (reference, intents), (held, held_intents) = _clustered_tickets(rng, 1800), _clustered_tickets(rng, 200)
    detector, report = fit_out_of_scope(
        reference, intents, [True] * len(intents), held, held_intents, in_scope_loss=0.02, seed=3
    )
    return reference, detector, report


def test_the_threshold_is_chosen_on_every_ticket_scored_out_of_fold_and_holds_on_new_ones() -> None:
    """Issue #59: a full folder's validation tenth was too few rows to judge a 2 % loss by (its threshold
    one of its few largest scores). The threshold now comes from every training and validation ticket,
    each scored by statistics fitted without its fold; the card's figure is on all of them, the validation
    part's own beside it, and tickets drawn afresh from the same intents are flagged within the promise."""
    reference, detector, report = _cross_fitted()
    assert report.held_out == 2000 and report.held_out_from == "cross-fit, 5 folds"
    assert report.in_scope_flagged <= 0.02 and report.validation_in_scope_flagged is not None
    fresh, _ = _clustered_tickets(np.random.default_rng(2), 20000)
    flagged_fresh = float(detector.flags(nearest_distance(reference, fresh)).mean())
    assert 0.01 <= flagged_fresh <= 0.02, flagged_fresh


def test_the_card_states_the_promise_how_it_was_measured_and_where_the_worker_watches_it() -> None:
    _, _, report = _cross_fitted()
    card = compose.out_of_scope_paragraph(report.as_dict())
    assert "an in-scope loss of 2% on new tickets with 90% confidence" in card
    assert f"flagged {report.in_scope_flagged:.1%} of its 2000 training and validation tickets" in card
    assert "each scored out of fold by statistics fitted without it (cross-fit, 5 folds)" in card
    assert f"{report.validation_in_scope_flagged:.1%} of the validation part" in card
    assert "`triage_out_of_scope_expected_ratio`" in card


def test_an_encoder_tuned_on_the_training_tickets_leaves_the_threshold_to_the_validation_part() -> None:
    """A fine-tuned encoder saw the training tickets: their out-of-fold scores would still be too small
    for a new ticket's, so only the validation part, which it never saw, chooses the threshold."""
    rng = np.random.default_rng(1)
    (reference, intents), (held, held_intents) = _clustered_tickets(rng, 1800), _clustered_tickets(rng, 200)
    _, report = fit_out_of_scope(
        reference, intents, [True] * len(intents), held, held_intents, in_scope_loss=0.02, seed=3,
        cross_fit=False,
    )  # fmt: skip
    assert (report.held_out, report.held_out_from, report.validation_in_scope_flagged) == (
        200,
        "validation",
        None,
    )
