"""`model eval`: measure a model on BANKING77's test split, honestly, next to classical baselines.

One run gives, for the model in each mode (through the real classifier pool, as the worker runs it) and for
two scikit-learn baselines trained on the same train split in the same run: intent top-1 accuracy and
macro-F1, priority accuracy (against the taxonomy's policy priority of the true intent), expected calibration
error of `confidence`, fallback rate and tickets/s. The baselines keep the model's figures in context: a
classifier that does not beat TF-IDF + a linear model is not worth its runtime.

scikit-learn is the `eval` extra, imported only when the baselines run.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import importlib.util
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from worker.classification import ClassifyRequest
from worker.config import Settings
from worker.errors import UserError
from worker.inference.loading import resolve_taxonomy as resolve_taxonomy
from worker.inference.pool import open_pool
from worker.inference.taxonomy import Taxonomy

ECE_BINS = 15
# Figures a reader needs to judge the model: BANKING77's published fine-tuned BERT (Casanueva et al. 2020).
REFERENCE_BERT_ACCURACY = 0.937


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


def figures(name: str, examples: Sequence[Example], predictions: Sequence[Prediction], taxonomy: Taxonomy,
            seconds: float) -> Figures:  # fmt: skip
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
    )


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def evaluate_model(settings: Settings, examples: Sequence[Example], console: Console) -> tuple[Figures, str]:
    """Classify every example through the configured classifier pool (what `run` and `classify` use) and
    score the answers; returns the figures and the model id. Throughput excludes the pool's start-up."""
    mode = settings.inference.mode
    deadline_s = settings.pipeline.deadline_ms / 1000.0
    answers: dict[int, Prediction] = {}
    console.print(f"starting the {mode} pool ...")
    with open_pool(settings.inference, settings.log) as pool, _progress(console) as progress:
        task = progress.add_task(f"model ({mode})", total=len(examples))
        pending = deque(range(len(examples)))
        window = max(2, 2 * pool.size)
        in_flight = 0
        started = time.monotonic()
        while pending or in_flight:
            while pending and in_flight < window:
                index = pending.popleft()
                pool.submit(ClassifyRequest(index, examples[index].text, time.monotonic() + deadline_s))
                in_flight += 1
            for index, answer in pool.poll(0.1):
                in_flight -= 1
                answers[index] = Prediction(
                    answer.intent, answer.priority, answer.confidence, answer.fallback
                )
                progress.advance(task)
        seconds = time.monotonic() - started
        model_id = pool.model_id
    predictions = [answers[i] for i in range(len(examples))]
    return figures(
        f"{model_id} ({mode})", examples, predictions, resolve_taxonomy(settings.inference)[0], seconds
    ), model_id


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


def render_markdown(rows: Sequence[Figures], context: dict[str, Any]) -> str:
    """The results table as Markdown (README-ready), with what was measured and how."""
    lines = [
        f"# Evaluation on BANKING77 test.csv ({context['test_tickets']} tickets)",
        "",
        f"Command: `{context['command']}`  ",
        f"Model: `{context['model']}`; machine: {context['machine']}; {context['date']}.",
        "",
        "| classifier | intent accuracy | macro-F1 | priority accuracy | ECE | fallback rate | tickets/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ece = "n/a" if row.ece is None else f"{row.ece:.3f}"
        lines.append(
            f"| {row.name} | {row.accuracy:.2%} | {row.macro_f1:.4f} | {row.priority_accuracy:.2%} | {ece} "
            f"| {row.fallback_rate:.2%} | {row.tickets_per_s:,.0f} |"
        )
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
        "",
    ]
    return "\n".join(lines)


def write_results(out_dir: Path, rows: Sequence[Figures], context: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown, data = out_dir / "eval.md", out_dir / "eval.json"
    markdown.write_text(render_markdown(rows, context), encoding="utf-8")
    payload = {**context, "results": [dataclasses.asdict(row) for row in rows]}
    data.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return markdown, data
