"""`make bench-open-intent`: BANKING77's open-intent protocol, the out-of-scope detector against confidence.

    python -m tools.bench_open_intent --out results          # results/open-intent.md and .json

The literature's protocol (e.g. Zhang et al. 2021, "Deep Open Intent Classification with Adaptive Decision
Boundary"): a seeded random 25, 50 or 75 % of the 77 intents are known; the encoder stage is trained on the
known intents' tickets of train.csv exactly as `model train` trains it (`compose.split_rows`: a stratified
10 % validation part; `encoder_stage.fit_encoder_stage`: the head, its temperature and the out-of-scope
detector, whose threshold flags `--in-scope-loss` of the validation tickets). Then every ticket of test.csv
arrives: those of known intents are in scope, those of the other intents are out of scope (none of them
was seen in training). Two detectors, each with a threshold chosen on the same validation part for the same
in-scope loss: the detector (cosine distance to the nearest training ticket plus the head's weighted doubt,
the weight chosen on stand-in intents within the training data) and the head's confidence alone (the winning
probability; a ticket under the threshold is flagged). test.csv chooses nothing.

Per detector: out-of-scope recall and precision, in-scope accuracy (right and not flagged), the in-scope
tickets flagged (the loss, aimed at on validation), and AUROC; the mean and the range over the seeds.

The tickets are embedded once with the shipped encoder and kept in `--cache` (a .npy per file, named by the
encoder's sha256 and the texts'): every split reuses the vectors, and a second run embeds nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np

from tools import REPO
from worker.cache import cache_root
from worker.inference.encoder import FloatArray, SentenceEmbedder, read_manifest
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.learning import compose, encoder_stage
from worker.learning.evaluation import read_examples
from worker.learning.out_of_scope import (
    ASSURANCE,
    DEFAULT_IN_SCOPE_LOSS,
    open_set_figures,
    threshold_for,
)
from worker.settings import DEFAULT_ESCALATION_DIR

BANKING77 = REPO / "data" / "banking77"
KNOWN_SHARES = (0.25, 0.5, 0.75)
SEEDS = (1, 2, 3, 4, 5)
DETECTORS = ("out-of-scope detector", "confidence")
FIGURES = ("out_of_scope_recall", "out_of_scope_precision", "in_scope_accuracy", "in_scope_flagged", "auroc")
Row = tuple[str, str]


class VectorLookup:
    """An embedder that looks every text up among vectors computed before (`fit_encoder_stage` takes it)."""

    def __init__(self, vectors: dict[str, FloatArray], dimensions: int) -> None:
        self._vectors = vectors
        self.dimensions = dimensions

    def embed_batch(self, texts: Sequence[str]) -> tuple[FloatArray, list[bool]]:
        return np.stack([self._vectors[text] for text in texts]), [False] * len(texts)


def cached_embeddings(texts: Sequence[str], cache: Path) -> FloatArray:
    """The shipped encoder's embeddings of `texts`, from `cache` when an earlier run computed them."""
    encoder = read_manifest(DEFAULT_ESCALATION_DIR).encoder_sha256 or ""
    digest = hashlib.sha256("\n".join([encoder, *texts]).encode("utf-8")).hexdigest()[:20]
    path = cache / f"{digest}.npy"
    if path.is_file():
        vectors: FloatArray = np.load(path)
        return vectors
    embedder = encoder_stage.open_embedder()
    started = time.monotonic()
    vectors = encoder_stage.embed(embedder, texts)
    print(f"embedded {len(texts)} tickets in {time.monotonic() - started:.0f} s", file=sys.stderr)
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, vectors)
    return vectors


def known_taxonomy(taxonomy: Taxonomy, share: float, seed: int) -> Taxonomy:
    """`taxonomy` with a seeded random `share` of its intents (in file order)."""
    count = round(share * len(taxonomy.intents))
    known = set(random.Random(seed).sample(range(len(taxonomy.intents)), count))
    intents = tuple(intent for i, intent in enumerate(taxonomy.intents) if i in known)
    return msgspec.structs.replace(taxonomy, intents=intents)


@dataclasses.dataclass(frozen=True)
class Fitted:
    """An encoder stage fitted as `model train` fits it: the rows of each part, the head, its report, and
    how long the fit took."""

    train: list[Row]
    validation: list[Row]
    head: encoder_stage.LinearHead
    report: encoder_stage.EncoderStageReport
    seconds: float


def fit_as_train(
    rows: Sequence[Row],
    taxonomy: Taxonomy,
    embedder: object,
    seed: int,
    in_scope_loss: float = DEFAULT_IN_SCOPE_LOSS,
) -> Fitted:
    """`rows` split (a stratified tenth held out) and the stage fitted on them as `model train` does, with
    no time limit that matters here (the benches that share this). `embedder`: a `SentenceEmbedder` or a
    lookup of vectors computed before, which embeds the same way."""
    train, validation, _ = compose.split_rows(rows, seed)
    started = time.monotonic()
    head, report = encoder_stage.fit_encoder_stage(
        train,
        validation,
        taxonomy,
        cast(SentenceEmbedder, embedder),
        max_seconds=3600.0,
        seed=seed,
        in_scope_loss=in_scope_loss,
    )
    return Fitted(train, validation, head, report, time.monotonic() - started)


def one_split(
    taxonomy: Taxonomy,
    train_rows: Sequence[Row],
    test_rows: Sequence[Row],
    embedder: VectorLookup,
    test_x: FloatArray,
    in_scope_loss: float,
    seed: int,
) -> dict[str, Any]:
    """Train on the known intents' tickets as `model train` does; both detectors' figures on test.csv."""
    known = set(taxonomy.labels)
    rows = [row for row in train_rows if row[1] in known]
    fitted = fit_as_train(rows, taxonomy, embedder, seed, in_scope_loss)
    train, validation, head, report, seconds = (
        fitted.train,
        fitted.validation,
        fitted.head,
        fitted.report,
        fitted.seconds,
    )
    assert head.out_of_scope is not None and report.out_of_scope is not None
    validation_x = embedder.embed_batch([text for text, _ in validation])[0]
    in_scope = np.array([intent in known for _, intent in test_rows])
    probabilities = head.probabilities(test_x)
    predicted = [taxonomy.labels[i] for i in probabilities.argmax(axis=1)]
    right = [p == intent for p, (_, intent) in zip(predicted, test_rows, strict=True) if intent in known]
    head_alone = dataclasses.replace(head, vote=None).probabilities(test_x).argmax(axis=1)
    right_head_alone = [
        taxonomy.labels[p] == intent
        for p, (_, intent) in zip(head_alone, test_rows, strict=True)
        if intent in known
    ]
    # Both as "higher is further out": the distance, and one minus the winning probability.
    distance = head.out_of_scope.scores(test_x, probabilities.max(axis=1))
    doubt = 1.0 - probabilities.max(axis=1)
    doubt_threshold = threshold_for(1.0 - head.probabilities(validation_x).max(axis=1), in_scope_loss)
    return {
        "seed": seed,
        "known_intents": len(known),
        "train_tickets": len(train),
        "validation_tickets": len(validation),
        "test_in_scope": int(in_scope.sum()),
        "test_out_of_scope": int((~in_scope).sum()),
        "fit_seconds": round(seconds, 1),
        "in_scope_accuracy_without_detection": float(np.mean(right)),
        "in_scope_accuracy_head_alone": float(np.mean(right_head_alone)),
        "out-of-scope detector": {
            "threshold": head.out_of_scope.threshold,
            "doubt_weight": head.out_of_scope.doubt_weight,
            "stand_in_recall": report.out_of_scope.stand_in_recall,
            **open_set_figures(right, distance[in_scope], distance[~in_scope], head.out_of_scope.threshold),
        },
        "confidence": {
            "threshold": 1.0 - doubt_threshold,
            **open_set_figures(right, doubt[in_scope], doubt[~in_scope], doubt_threshold),
        },
    }


def summary(splits: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean, min and max over the seeds of each detector's figures."""
    result: dict[str, Any] = {}
    for detector in DETECTORS:
        result[detector] = {}
        for figure in FIGURES:
            values = [split[detector][figure] for split in splits]
            result[detector][figure] = {
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
            }
    for figure in ("in_scope_accuracy_without_detection", "in_scope_accuracy_head_alone"):
        result[figure] = statistics.fmean(split[figure] for split in splits)
    return result


def markdown(record: dict[str, Any]) -> str:
    lines = [
        "# Open-intent classification on BANKING77: out-of-scope detector against the confidence threshold",
        "",
        f"`{record['command']}` on {record['machine']}, {record['date']}. Protocol: a seeded random share of "
        "the 77 intents is known; the encoder stage is trained on their train.csv tickets exactly as "
        "`model train` trains it (10 % validation part); every test.csv ticket then arrives, those of the "
        "other intents out of scope. Each detector's threshold is chosen on the validation part for at most "
        f"{record['in_scope_loss']:.0%} of new in-scope tickets flagged with {ASSURANCE:.0%} confidence "
        "(`worker/learning/out_of_scope.py`); test.csv chooses nothing. Seeds "
        f"{', '.join(str(s) for s in record['seeds'])}: mean (min-max).",
        "",
        "| known intents | detector | out-of-scope recall | out-of-scope precision | in-scope accuracy "
        "| in-scope flagged | AUROC |",
        "|---|---|---|---|---|---|---|",
    ]
    for share, result in record["results"].items():
        for detector in DETECTORS:
            cells = []
            for figure in FIGURES:
                value = result["summary"][detector][figure]
                if figure == "auroc":
                    cells.append(f"{value['mean']:.3f} ({value['min']:.3f}-{value['max']:.3f})")
                else:
                    cells.append(f"{value['mean']:.1%} ({value['min']:.1%}-{value['max']:.1%})")
            lines.append(f"| {share} | {detector} | {' | '.join(cells)} |")
    lines += [
        "",
        "In-scope accuracy counts a known intent's ticket right when it is answered its intent and not "
        "flagged; without any detection the stages score "
        + ", ".join(
            f"{result['summary']['in_scope_accuracy_without_detection']:.1%} ({share})"
            for share, result in record["results"].items()
        )
        + " on those tickets (the head alone, without the neighbour vote, in the same run: "
        + ", ".join(
            f"{result['summary']['in_scope_accuracy_head_alone']:.1%}"
            for result in record["results"].values()
        )
        + f"). Embedding: {record['embedding']}. `open-intent.json` has every split.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_open_intent", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=REPO / "results", help="folder for open-intent.md/.json")
    parser.add_argument("--data", type=Path, default=BANKING77, help="BANKING77 folder (train.csv, test.csv)")
    parser.add_argument("--in-scope-loss", type=float, default=DEFAULT_IN_SCOPE_LOSS)
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds per share (1..5)")
    parser.add_argument("--cache", type=Path, default=cache_root() / "open-intent", help="embedding cache")
    args = parser.parse_args(argv)
    taxonomy = load_taxonomy(REPO / "taxonomies" / "banking77.toml")
    train_rows = [(e.text, e.intent) for e in read_examples(args.data / "train.csv", taxonomy)]
    test_rows = [(e.text, e.intent) for e in read_examples(args.data / "test.csv", taxonomy)]
    texts = [text for text, _ in train_rows]
    test_texts = [text for text, _ in test_rows]
    prior = [text for own in encoder_stage.intent_texts(taxonomy) for text in own]
    started = time.monotonic()
    vectors = {
        text: vector
        for batch in (texts, test_texts, prior)
        for text, vector in zip(batch, cached_embeddings(batch, args.cache), strict=True)
    }
    embedding = f"{len(vectors)} texts, cached in {args.cache} ({time.monotonic() - started:.0f} s this run)"
    dimensions = len(next(iter(vectors.values())))
    embedder = VectorLookup(vectors, dimensions)
    test_x = np.stack([vectors[text] for text in test_texts])
    seeds = SEEDS[: args.seeds]
    results: dict[str, Any] = {}
    for share in KNOWN_SHARES:
        splits = []
        for seed in seeds:
            known = known_taxonomy(taxonomy, share, seed)
            split = one_split(known, train_rows, test_rows, embedder, test_x, args.in_scope_loss, seed)
            splits.append(split)
            print(
                f"{share:.0%} known, seed {seed}: out-of-scope recall "
                f"{split['out-of-scope detector']['out_of_scope_recall']:.1%} (confidence "
                f"{split['confidence']['out_of_scope_recall']:.1%})",
                file=sys.stderr,
            )
        results[f"{share:.0%}"] = {"summary": summary(splits), "splits": splits}
    record = {
        "command": shlex.join(["python", "-m", "tools.bench_open_intent", *(argv or sys.argv[1:])]),
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "in_scope_loss": args.in_scope_loss,
        "seeds": list(seeds),
        "embedding": embedding,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "open-intent.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (args.out / "open-intent.md").write_text(markdown(record), encoding="utf-8")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
