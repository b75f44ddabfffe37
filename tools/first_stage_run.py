"""Measure `worker.learning.first_stage.train_first_stage` on BANKING77 with a real teacher.

    python -m tools.first_stage_run --out /tmp/fs-full                       # all of train.csv
    python -m tools.first_stage_run --out /tmp/fs-5 --per-intent 5           # 5 rows per intent

The validation split is BANKING77's usual one (`worker.learning.evaluation.stratified_split`, seed 77, 10 %),
so the teacher is the shipped encoder stage's head (`models/triage-encoder`), which was fit on exactly the
other 90 %. With `--per-intent N` the first stage sees N rows per intent of that 90 % and is measured on the
same validation rows; its teacher is then a logistic regression fit on the encoder's embeddings of those N
rows per intent (what the encoder stage would learn from them), or with `--teacher tfidf` a TF-IDF + logistic
regression fit on the rows given. Prints the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools import REPO
from worker.inference.encoder import SentenceEmbedder, encoder_file, read_manifest
from worker.inference.taxonomy import load_taxonomy
from worker.learning.evaluation import read_examples, stratified_split
from worker.learning.first_stage import Shape, train_first_stage
from worker.learning.teachers import encoder_stage_teacher

ENCODER = REPO / "models" / "triage-encoder"


def fitted_encoder_teacher(labels: Sequence[str], rows: Sequence[tuple[str, str]]) -> Any:
    """What the encoder stage would learn from `rows`: a logistic regression on its embeddings."""
    from sklearn.linear_model import LogisticRegression

    manifest = read_manifest(ENCODER)
    embedder = SentenceEmbedder(encoder_file(ENCODER, manifest), ENCODER / manifest.tokenizer, 1)
    model = LogisticRegression(C=10, max_iter=3000).fit(
        embedder.embed([t for t, _ in rows]), [i for _, i in rows]
    )
    order = [list(model.classes_).index(label) for label in labels]
    return lambda texts: model.predict_proba(embedder.embed(texts))[:, order]


def tfidf_teacher(labels: Sequence[str], rows: Sequence[tuple[str, str]]) -> Any:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    model = make_pipeline(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True), LogisticRegression(C=10, max_iter=3000)
    ).fit([t for t, _ in rows], [i for _, i in rows])
    order = [list(model.classes_).index(label) for label in labels]
    return lambda texts: model.predict_proba(list(texts))[:, order]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "banking77" / "train.csv")
    parser.add_argument("--taxonomy", type=Path, default=REPO / "taxonomies" / "banking77.toml")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per-intent", type=int, help="train on this many rows per intent only")
    parser.add_argument("--teacher", choices=["encoder", "tfidf", "none"], default="encoder")
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--unlabelled", action="store_true", help="give the unused train rows, unlabelled")
    parser.add_argument("--hidden", type=int, help="model width (default: Shape's)")
    parser.add_argument("--layers", type=int, help="layers (default: Shape's)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    taxonomy = load_taxonomy(args.taxonomy)
    labels = list(taxonomy.labels)
    rows = [(e.text, e.intent) for e in read_examples(args.data, taxonomy)]
    train, validation = stratified_split(rows, lambda row: row[1])
    unlabelled: list[str] = []
    if args.per_intent:
        by_intent: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for row in train:
            by_intent[row[1]].append(row)
        rng = random.Random(77)
        kept = [row for label in labels for row in rng.sample(by_intent[label], args.per_intent)]
        unlabelled = [text for text, _ in set(train) - set(kept)] if args.unlabelled else []
        train = kept
    teacher: Any = None
    if args.teacher == "encoder":
        teacher = (
            fitted_encoder_teacher(labels, train)
            if args.per_intent
            else encoder_stage_teacher(ENCODER, labels)
        )
    elif args.teacher == "tfidf":
        teacher = tfidf_teacher(labels, train)
    teacher_fit = time.monotonic() - started
    shape = Shape()
    if args.hidden:
        heads = max(1, args.hidden // 64)
        shape = Shape(hidden=args.hidden, heads=heads, kv_heads=heads, intermediate=args.hidden * 8 // 3)
    if args.layers:
        shape = Shape(**{**shape.__dict__, "layers": args.layers})

    def progress(done: int, total: int) -> None:
        if done % 50 == 0 or done == total:
            print(f"step {done}/{total} {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    report = train_first_stage(
        train, validation, taxonomy, args.taxonomy, teacher, args.out,
        unlabelled=unlabelled, max_seconds=args.max_minutes * 60, progress=progress, shape=shape,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )  # fmt: skip
    figures = {"teacher_fit_seconds": round(teacher_fit, 1), **report.__dict__}
    figures["command"] = "python -m tools.first_stage_run " + " ".join(argv or sys.argv[1:])
    print(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
