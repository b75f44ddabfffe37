"""`make bench-train`: how well `model train` learns a team's taxonomy, from its names alone to every ticket.

Two taxonomies, both from BANKING77 (CC-BY-4.0): `bank-desk`, its 77 intents regrouped into the 12 categories
a bank's desk would use (taxonomies/bank-desk.banking77.csv), and BANKING77's own 77. For each, four amounts
of data, the way `model train` takes them: zero-shot (the taxonomy's names, descriptions and examples), 5
and 20 tickets per intent (seeded random draws from train.csv), and every ticket. Each row measures on
BANKING77's test split (3,080 tickets, never trained on):

- the encoder stage as `model train` fits it (`worker.learning.encoder_stage`: same split rule, same
  calibration), its accuracy and expected calibration error (ECE), and its fit time;
- a TF-IDF word 1-2-gram logistic regression trained on the same rows (the taxonomy's texts as its rows at
  zero-shot), the baseline of the same run;
- tickets that fit no intent (data/out-of-domain/tickets.txt, 80 from other domains): the share answered
  under each review threshold, beside the share of the banking test tickets under it (the review load).

The tickets are embedded once with the shipped encoder and the rows reuse the vectors (`embedding` in the
output gives that time and tickets/s: the encoder stage's cost per ticket, training and serving alike).

Both stages as `model train` writes them (`worker.learning.compose.train_model_folder`, the encoder stage
embedding every ticket itself, and the ORT GenAI first stage in what is left of `--first-stage-minutes`),
for three of the rows (`FOLDER_ROWS`, minutes each rather than seconds): each stage served from the folder
on the same test split (the first stage as the engine serves it in score mode, one thread; the encoder stage
as its engine does, batches of 64), and the cascade at the threshold the folder chose, its training minutes
per stage and each stage's tickets/s. `--first-stage-minutes 0` leaves them out.

Then BANKING77's open-intent protocol (tools/bench_open_intent.py: the out-of-scope detector against the
confidence threshold, results/open-intent.md and .json).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from rich.console import Console

from tools import bench_open_intent
from worker.classification import ClassifyRequest
from worker.inference.encoder import EncoderEngine, SentenceEmbedder
from worker.inference.loading import resolve_taxonomy
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.learning import compose, encoder_stage
from worker.learning.evaluation import baselines, read_examples
from worker.settings import InferenceSettings

REPO = Path(__file__).resolve().parent.parent
BANKING77 = REPO / "data" / "banking77"
OUT_OF_DOMAIN = REPO / "data" / "out-of-domain" / "tickets.txt"
TAXONOMIES = REPO / "taxonomies"
AMOUNTS: tuple[int | str, ...] = ("zero-shot", 5, 20, "all")
REVIEW_THRESHOLDS = (0.5, 0.7)
# (taxonomy, amount) rows measured with both stages, trained by `model train`'s own code in a time bound.
FOLDER_ROWS: tuple[tuple[str, int | str], ...] = (
    ("bank-desk", "all"),
    ("banking77", 5),
    ("banking77", "all"),
)
Row = tuple[str, str]


class CachedEmbedder:
    """The shipped embedder behind a cache of every text it has embedded: the rows reuse the vectors."""

    def __init__(self, embedder: SentenceEmbedder) -> None:
        self._embedder = embedder
        self.dimensions = embedder.dimensions
        self._vectors: dict[str, Any] = {}

    def embed_batch(self, texts: Sequence[str]) -> tuple[Any, list[bool]]:
        missing = [text for text in dict.fromkeys(texts) if text not in self._vectors]
        if missing:
            vectors, _ = self._embedder.embed_batch(missing)
            self._vectors.update(zip(missing, vectors, strict=True))
        return np.stack([self._vectors[text] for text in texts]), [False] * len(texts)


def _regrouped(rows: Sequence[Row]) -> list[Row]:
    with (TAXONOMIES / "bank-desk.banking77.csv").open(encoding="utf-8", newline="") as handle:
        mapping = {row["banking77_intent"]: row["bank_desk_intent"] for row in csv.DictReader(handle)}
    return [(text, mapping[intent]) for text, intent in rows]


def _per_intent(rows: Sequence[Row], amount: int | str, seed: int) -> list[Row]:
    if amount == "all":
        return list(rows)
    by_intent: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_intent[row[1]].append(row)
    rng = random.Random(seed)
    drawn = [row for intent in sorted(by_intent) for row in rng.sample(by_intent[intent], int(amount))]
    rng.shuffle(drawn)
    return drawn


def _tfidf_accuracy(train: Sequence[Row], test: Sequence[Row]) -> float:
    model = baselines()["TF-IDF word 1-2-grams + logistic regression"]()
    model.fit([text for text, _ in train], [intent for _, intent in train])
    predicted = model.predict([text for text, _ in test])
    return float(np.mean([p == intent for p, (_, intent) in zip(predicted, test, strict=True)]))


def _row(
    taxonomy: Taxonomy,
    amount: int | str,
    train_rows: Sequence[Row],
    test_rows: Sequence[Row],
    ood: Sequence[str],
    embedder: SentenceEmbedder,
    seed: int,
) -> dict[str, Any]:
    started = time.monotonic()
    if amount == "zero-shot":
        head, report = encoder_stage.zero_shot_encoder_stage(taxonomy, embedder)
        texts = encoder_stage.intent_texts(taxonomy)
        baseline_rows = [
            (text, label) for label, group in zip(taxonomy.labels, texts, strict=True) for text in group
        ]
        kind, trained_on = "zero-shot", 0
    else:
        rows = _per_intent(train_rows, amount, seed)
        train, validation, kind = compose.split_rows(rows, seed)
        head, report = encoder_stage.fit_encoder_stage(
            train,
            validation,
            taxonomy,
            embedder,
            max_seconds=3600,
            seed=seed,
        )
        baseline_rows, trained_on = train, len(train)
    fit_seconds = time.monotonic() - started
    truth = [taxonomy.labels.index(intent) for _, intent in test_rows]
    test_x = embedder.embed_batch([text for text, _ in test_rows])[0]
    probabilities = head.probabilities(test_x)
    accuracy, ece = encoder_stage.measure(probabilities, truth)
    in_domain = probabilities.max(axis=1)
    out_of_domain = head.probabilities(embedder.embed_batch(list(ood))[0]).max(axis=1)
    return {
        "taxonomy": taxonomy.name,
        "intents": len(taxonomy.labels),
        "amount": amount,
        "kind": kind,
        "trained_on": trained_on,
        "encoder_stage": {
            "accuracy": accuracy,
            "ece": ece,
            "fit_seconds": fit_seconds,
            "calibration": report.calibration,
            "temperature": report.temperature,
        },
        "tfidf_logistic_regression": {"accuracy": _tfidf_accuracy(baseline_rows, test_rows)},
        "under_review_threshold": {
            str(threshold): {
                "out_of_domain": float(np.mean(out_of_domain < threshold)),
                "in_domain": float(np.mean(in_domain < threshold)),
            }
            for threshold in REVIEW_THRESHOLDS
        },
    }


def _folder_row(
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    amount: int | str,
    train_rows: Sequence[Row],
    test_rows: Sequence[Row],
    embedder: SentenceEmbedder,
    minutes: float,
    seed: int,
) -> dict[str, Any]:
    """Both stages trained as `model train` trains them, each served from the folder on `test_rows`, and
    the cascade at the folder's own threshold."""
    from worker.learning.first_stage import served_answers

    rows = _per_intent(train_rows, amount, seed)
    texts, truth = [text for text, _ in test_rows], [intent for _, intent in test_rows]
    with tempfile.TemporaryDirectory(prefix="bench-train-") as scratch:
        out = Path(scratch) / "model"
        console = Console(stderr=True)
        data = {"file": f"BANKING77 train.csv ({amount} per intent)"}
        outcome = compose.train_model_folder(
            rows, taxonomy, taxonomy_path, out, data=data, max_seconds=minutes * 60, seed=seed,
            console=console, embedder=embedder,
        )  # fmt: skip
        record = json.loads((out / compose.TRAINING_FILE).read_text(encoding="utf-8"))
        threshold = float(record["cascade"]["escalate_below"])
        started = time.monotonic()
        first = served_answers(out, texts) if outcome.first_stage is not None else []
        first_seconds = time.monotonic() - started
        settings = InferenceSettings(
            model=str(out / compose.ENCODER_DIR), taxonomy=str(out / "taxonomy.toml")
        )
        engine = EncoderEngine(settings, *resolve_taxonomy(settings))
        started = time.monotonic()
        encoder: list[str] = []
        for start in range(0, len(texts), 64):
            requests = [
                ClassifyRequest(start + i, text, time.monotonic() + 3600.0)
                for i, text in enumerate(texts[start : start + 64])
            ]
            encoder += [answer.intent for answer in engine.classify_batch(requests)]
        encoder_seconds = time.monotonic() - started
    first_stage = None
    served = encoder
    if first and outcome.first_stage is not None:
        served = [
            e if confidence < threshold else f for (f, confidence), e in zip(first, encoder, strict=True)
        ]
        first_stage = {
            "accuracy": float(np.mean([f == t for (f, _), t in zip(first, truth, strict=True)])),
            "seconds": outcome.first_stage.seconds,
            "tickets_per_second": len(texts) / first_seconds,
            "parameters": outcome.first_stage.parameters,
        }
    return {
        "taxonomy": taxonomy.name,
        "intents": len(taxonomy.labels),
        "amount": amount,
        "kind": outcome.kind,
        "minutes_bound": minutes,
        "encoder_stage": {
            "accuracy": float(np.mean([e == t for e, t in zip(encoder, truth, strict=True)])),
            "seconds": outcome.encoder.seconds,
            "tickets_per_second": len(texts) / encoder_seconds,
        },
        "first_stage": first_stage,
        "first_stage_missing": outcome.first_stage_missing,
        "cascade": {
            "escalate_below": threshold,
            "accuracy": float(np.mean([s == t for s, t in zip(served, truth, strict=True)])),
            "escalated": float(np.mean([c < threshold for _, c in first])) if first else 1.0,
        },
        "total_seconds": outcome.seconds,
        # Other work on the machine slows a time-bounded trainer into fewer steps: say how busy it was.
        "load_average_after": os.getloadavg()[0],
    }


def _folder_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Both stages, as `model train` writes them",
        "",
        "Each folder trained by `model train`'s own code in the time bound given (the encoder stage embeds "
        "every ticket itself here), then served from the folder on the same test split: the first stage as "
        "the engine serves it (score mode, one thread), the encoder stage as its engine does (batches of "
        "64), the cascade at the threshold the folder chose on its validation part (escalated tickets take "
        "the encoder stage's answer). load: the machine's 1-minute load average when the folder was done "
        "(other work slows a time-bounded trainer into fewer steps).",
        "",
        "| taxonomy | data | bound (min) | first stage | encoder stage | served cascade | threshold "
        "| escalated | minutes: encoder / first / total | tickets/s: first / encoder | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        amount = row["amount"] if isinstance(row["amount"], str) else f"{row['amount']} per intent"
        first, encoder, cascade = row["first_stage"], row["encoder_stage"], row["cascade"]
        first_accuracy = "not trained" if first is None else f"{first['accuracy']:.1%}"
        first_minutes = "—" if first is None else f"{first['seconds'] / 60:.1f}"
        first_speed = "—" if first is None else f"{first['tickets_per_second']:.0f}"
        lines.append(
            f"| {row['taxonomy']} ({row['intents']}) | {amount} | {row['minutes_bound']:g} | "
            f"{first_accuracy} | {encoder['accuracy']:.1%} | {cascade['accuracy']:.1%} | "
            f"{cascade['escalate_below']} | "
            f"{cascade['escalated']:.0%} | {encoder['seconds'] / 60:.1f} / {first_minutes} / "
            f"{row['total_seconds'] / 60:.1f} | {first_speed} / {encoder['tickets_per_second']:.0f} | "
            f"{row['load_average_after']:.1f} |"
        )
    return lines


def _markdown(record: dict[str, Any]) -> str:
    embedding = record["embedding"]
    lines = [
        "# Your taxonomy: what `model train` learns from how much (`make bench-train`)",
        "",
        f"Measured {record['measured_at']} on {record['machine']}; BANKING77 test split "
        f"({record['test_tickets']} tickets) for every row; {record['out_of_domain_tickets']} out-of-domain "
        "tickets (data/out-of-domain/tickets.txt). Encoder stage = the shipped bge-small encoder + the head "
        "`model train` fits; TF-IDF = word 1-2-gram logistic regression on the same rows (the taxonomy's "
        "texts at zero-shot).",
        "",
        f"Embedding (the encoder stage's cost per ticket): {embedding['texts']} texts in "
        f"{embedding['seconds']:.0f} s, {embedding['texts_per_second']:.0f} texts/s on "
        f"{embedding['threads']} threads.",
        "",
        "| taxonomy | data | trained on | encoder stage | ECE | fit (s) | TF-IDF | ratio | "
        + " | ".join(f"under {t}: out-of-domain / banking" for t in REVIEW_THRESHOLDS)
        + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(REVIEW_THRESHOLDS),
    ]
    for row in record["rows"]:
        stage, tfidf = row["encoder_stage"], row["tfidf_logistic_regression"]["accuracy"]
        amount = row["amount"] if isinstance(row["amount"], str) else f"{row['amount']} per intent"
        under = " | ".join(
            f"{row['under_review_threshold'][str(t)]['out_of_domain']:.0%} / "
            f"{row['under_review_threshold'][str(t)]['in_domain']:.0%}"
            for t in REVIEW_THRESHOLDS
        )
        lines.append(
            f"| {row['taxonomy']} ({row['intents']}) | {amount} | {row['trained_on']} | "
            f"{stage['accuracy']:.1%} | {stage['ece']:.3f} | {stage['fit_seconds']:.1f} | {tfidf:.1%} | "
            f"{stage['accuracy'] / max(tfidf, 1e-9):.2f}x | {under} |"
        )
    lines += [
        "",
        "ratio: encoder stage accuracy / TF-IDF accuracy, same rows, same run. At zero-shot and 5 per intent",
        "the temperature is fitted on the taxonomy's example phrases or by cross-validation, so confidences",
        "stay honest about guesses; review at 1.0 (every record) is the default for zero-shot folders.",
    ]
    if record.get("folders"):
        lines += _folder_lines(record["folders"])
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results", help="folder for bench-train.json/.md")
    parser.add_argument("--seed", type=int, default=77, help="seed of the per-intent draws and the heads")
    parser.add_argument(
        "--first-stage-minutes",
        type=float,
        default=10.0,
        help="time bound of each folder trained with both stages (FOLDER_ROWS); 0 leaves them out",
    )
    args = parser.parse_args(argv)
    banking77 = load_taxonomy(TAXONOMIES / "banking77.toml")
    train77 = [(e.text, e.intent) for e in read_examples(BANKING77 / "train.csv", banking77)]
    test77 = [(e.text, e.intent) for e in read_examples(BANKING77 / "test.csv", banking77)]
    ood = [line.strip() for line in OUT_OF_DOMAIN.read_text(encoding="utf-8").splitlines() if line.strip()]
    shipped = encoder_stage.open_embedder(echo=lambda line: print(line, file=sys.stderr))
    # The embedder's one method the trainers call, behind a cache (duck-typed: no model is loaded twice).
    embedder = cast(SentenceEmbedder, CachedEmbedder(shipped))
    texts = list(dict.fromkeys([*(t for t, _ in train77), *(t for t, _ in test77), *ood]))
    started = time.monotonic()
    chunk = 512
    for start in range(0, len(texts), chunk):
        encoder_stage.embed(embedder, texts[start : start + chunk])
        print(f"embedding {min(start + chunk, len(texts))}/{len(texts)} texts", file=sys.stderr, flush=True)
    embed_seconds = time.monotonic() - started
    plans = [
        (TAXONOMIES / "bank-desk.toml", _regrouped(train77), _regrouped(test77)),
        (TAXONOMIES / "banking77.toml", train77, test77),
    ]
    rows, folders = [], []
    for taxonomy_path, train_rows, test_rows in plans:
        taxonomy = load_taxonomy(taxonomy_path)
        for amount in AMOUNTS:
            row = _row(taxonomy, amount, train_rows, test_rows, ood, embedder, args.seed)
            stage = row["encoder_stage"]
            print(
                f"{taxonomy.name} {amount}: encoder stage {stage['accuracy']:.1%} (ECE {stage['ece']:.3f}, "
                f"{stage['fit_seconds']:.1f} s), TF-IDF {row['tfidf_logistic_regression']['accuracy']:.1%}",
                file=sys.stderr,
                flush=True,
            )
            rows.append(row)
        for amount in [amount for name, amount in FOLDER_ROWS if name == taxonomy.name]:
            if args.first_stage_minutes <= 0:
                break
            folder = _folder_row(
                taxonomy, taxonomy_path, amount, train_rows, test_rows, shipped, args.first_stage_minutes,
                args.seed,
            )  # fmt: skip
            print(f"{taxonomy.name} {amount}, both stages: {json.dumps(folder)}", file=sys.stderr, flush=True)
            folders.append(folder)
    record = {
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "seed": args.seed,
        "test_tickets": len(test77),
        "out_of_domain_tickets": len(ood),
        "embedding": {
            "texts": len(texts),
            "seconds": embed_seconds,
            "texts_per_second": len(texts) / embed_seconds,
            "threads": len(os.sched_getaffinity(0)),
        },
        "rows": rows,
        "folders": folders,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-train.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (args.out / "bench-train.md").write_text(_markdown(record), encoding="utf-8")
    print(f"wrote {args.out / 'bench-train.md'} and bench-train.json")
    # BANKING77's open-intent protocol, the out-of-scope detector against the confidence (its own cache).
    return bench_open_intent.main(["--out", str(args.out)])


if __name__ == "__main__":
    raise SystemExit(main())
