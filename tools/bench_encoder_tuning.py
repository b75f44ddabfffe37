"""`make bench-encoder-tuning`: what fine-tuning the encoder before the head gives (`model train`, full data).

    python -m tools.bench_encoder_tuning --out results      # results/encoder-tuning.md and .json
    python -m tools.bench_encoder_tuning --per-intent 5 --passes 10 --seed 1 --seed 2 --known 0
                                                            # results/encoder-tuning-5-per-intent.md, .json

For bank-desk (BANKING77 regrouped into 12 intents) and BANKING77's own 77, every train.csv ticket, split as
`model train` splits it (`compose.split_rows`: a stratified 10 % validation part): the encoder stage fitted
as `model train` fits it (`encoder_stage.fit_encoder_stage`: head, temperature, out-of-scope detector) on the
shipped encoder as it is, and on the encoder fine-tuned on the training part first
(`encoder_tuning.tune_encoder`, in `--minutes`, the share of `model train`'s default 20 minutes it gets).
Measured on BANKING77's test split (3,080 tickets, never trained on): accuracy and ECE; the out-of-scope
detector's flags on the in-scope test tickets (its in-scope loss) and on data/out-of-domain/tickets.txt
(80 tickets from other domains). Then BANKING77's open-intent protocol for one split (`--known` of the
intents known, as tools/bench_open_intent.py runs it): out-of-scope recall at the 2 % operating point, both
encoders. Each row is a ratio against the shipped encoder in the same run.

`--per-intent N` measures few-shot folders instead: N tickets per intent drawn from train.csv for each
`--seed` (as `make bench-train` draws them), every one trained on (`compose.split_rows`: few-shot, the head
calibrated by cross-validation), the encoder tuned for `--passes` passes over them; beside the test split, a
selection set of other train.csv tickets (`SELECTION_ROWS` in all, at least 10 per intent) on which settings
are chosen, so that the test split only measures. The cross-validation figures of a tuned encoder are
optimistic: it was tuned on every fold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
from rich.console import Console

from tools import REPO, bench_open_intent
from tools.bench_train import OUT_OF_DOMAIN, TAXONOMIES, CachedEmbedder, _per_intent, _regrouped
from worker.inference.encoder import SentenceEmbedder
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.learning import compose, encoder_stage, encoder_tuning
from worker.learning.evaluation import read_examples
from worker.learning.out_of_scope import DEFAULT_IN_SCOPE_LOSS

BANKING77 = REPO / "data" / "banking77"
# Few-shot runs: other train.csv tickets to choose settings on (720: 10 per intent of BANKING77's 77, 60 per
# intent of bank-desk's 12).
SELECTION_ROWS = 720
Row = tuple[str, str]


def _embedded(embedder: SentenceEmbedder, texts: Sequence[str]) -> bench_open_intent.VectorLookup:
    """`embedder` behind a cache, `texts` embedded into it now (the taxonomies' own texts come later)."""
    cached = CachedEmbedder(embedder)
    encoder_stage.embed(cast(SentenceEmbedder, cached), list(texts))
    return cast(bench_open_intent.VectorLookup, cached)


def _tuned(
    taxonomy: Taxonomy, train: Sequence[Row], minutes: float, seed: int, folder: Path, passes: int = 1
) -> tuple[SentenceEmbedder, encoder_tuning.TuningReport]:
    """The encoder fine-tuned as `model train` tunes it (`compose.fine_tune_encoder`), as an embedder."""
    out = folder / f"{taxonomy.name}-{len(taxonomy.labels)}-{seed}.onnx"
    report = compose.fine_tune_encoder(
        train, taxonomy, out, minutes * 60, seed, Console(stderr=True), passes=passes
    )
    return encoder_stage.open_embedder(encoder=out), report


def _stage(
    taxonomy: Taxonomy,
    train: Sequence[Row],
    validation: Sequence[Row],
    test: Sequence[Row],
    ood: Sequence[str],
    lookup: bench_open_intent.VectorLookup,
    seed: int,
    selection: Sequence[Row] = (),
) -> dict[str, Any]:
    """The encoder stage fitted as `model train` fits it over `lookup`'s vectors; its test figures, and its
    accuracy and ECE on the `selection` rows if any."""
    head, report = encoder_stage.fit_encoder_stage(
        train, validation, taxonomy, cast(SentenceEmbedder, lookup), max_seconds=3600.0, seed=seed
    )
    test_x = lookup.embed_batch([text for text, _ in test])[0]
    ood_x = lookup.embed_batch(list(ood))[0]
    probabilities = head.probabilities(test_x)
    truth = [taxonomy.labels.index(intent) for _, intent in test]
    accuracy, ece = encoder_stage.measure(probabilities, truth)
    figures: dict[str, Any] = {
        "accuracy": accuracy,
        "ece": ece,
        "validation_accuracy": report.validation_accuracy,
    }
    if selection:
        selection_x = lookup.embed_batch([text for text, _ in selection])[0]
        figures["selection_accuracy"], figures["selection_ece"] = encoder_stage.measure(
            head.probabilities(selection_x), [taxonomy.labels.index(intent) for _, intent in selection]
        )
    if head.out_of_scope is not None:
        detector = head.out_of_scope
        ood_probabilities = head.probabilities(ood_x)
        figures["in_scope_flagged"] = float(
            detector.flags(detector.scores(test_x, probabilities.max(axis=1))).mean()
        )
        figures["out_of_domain_flagged"] = float(
            detector.flags(detector.scores(ood_x, ood_probabilities.max(axis=1))).mean()
        )
    return figures


def _open_intent(
    banking77: Taxonomy,
    train77: Sequence[Row],
    test77: Sequence[Row],
    known_share: float,
    minutes: float,
    seed: int,
    folder: Path,
    shipped: SentenceEmbedder,
) -> dict[str, Any]:
    """One open-intent split (tools/bench_open_intent.py), the shipped encoder against one tuned on the
    known intents' training part."""
    known = bench_open_intent.known_taxonomy(banking77, known_share, seed)
    labels = set(known.labels)
    train, _, _ = compose.split_rows([row for row in train77 if row[1] in labels], seed)
    texts = list(dict.fromkeys([*(t for t, _ in train77), *(t for t, _ in test77)]))
    tuned, report = _tuned(known, train, minutes, seed, folder)
    out: dict[str, Any] = {"known_intents": len(labels), "tuning": report.as_dict()}
    for name, embedder in (("shipped", shipped), ("tuned", tuned)):
        lookup = _embedded(embedder, texts)
        test_x = lookup.embed_batch([text for text, _ in test77])[0]
        split = bench_open_intent.one_split(
            known, train77, test77, lookup, test_x, DEFAULT_IN_SCOPE_LOSS, seed
        )
        out[name] = {detector: split[detector] for detector in bench_open_intent.DETECTORS} | {
            "in_scope_accuracy_without_detection": split["in_scope_accuracy_without_detection"]
        }
    return out


def _markdown(record: dict[str, Any]) -> str:
    per_intent = record.get("per_intent")
    data = (
        f"{per_intent} train.csv tickets per intent for each seed, every one trained on (few-shot: "
        "validation accuracy is out of fold, optimistic for a tuned encoder, tuned on every fold); "
        "selection: other train.csv tickets, on which settings are chosen"
        if per_intent
        else "Every train.csv ticket, split as `model train` splits it"
    )
    lines = [
        "# Fine-tuning the encoder before the head (`make bench-encoder-tuning`)",
        "",
        f"`{record['command']}` on {record['machine']}, {record['measured_at']}; load average "
        f"{record['load_average']}. {data}; measured on BANKING77's test split "
        f"({record['test_tickets']} tickets) and {record['out_of_domain_tickets']} out-of-domain tickets. "
        "tuned / shipped: the ratio in the same run.",
        "",
        "| taxonomy | seed | encoder | test accuracy | ECE | validation accuracy | selection accuracy | "
        "in-scope flagged | out-of-domain flagged | tuning |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        for name in ("shipped", "tuned"):
            stage = row[name]
            tuning = row["tuning"]
            how = (
                f"{tuning['steps']}/{tuning['planned_steps']} steps, {tuning['seconds'] / 60:.1f} min"
                if name == "tuned"
                else "—"
            )
            selection = stage.get("selection_accuracy")
            lines.append(
                f"| {row['taxonomy']} ({row['intents']}) | {row['seed']} | {name} | "
                f"{stage['accuracy']:.1%} | {stage['ece']:.3f} | {stage['validation_accuracy']:.1%} | "
                f"{'—' if selection is None else f'{selection:.1%}'} | "
                f"{stage.get('in_scope_flagged', float('nan')):.1%} | "
                f"{stage.get('out_of_domain_flagged', float('nan')):.1%} | {how} |"
            )
        ratio = row["tuned"]["accuracy"] / row["shipped"]["accuracy"]
        lines.append(
            f"| {row['taxonomy']} ({row['intents']}) | {row['seed']} | tuned / shipped | {ratio:.3f}x "
            "| | | | | | |"
        )
    split = record.get("open_intent")
    if split:
        lines += [
            "",
            f"Open intent, BANKING77, {split['known_intents']} of 77 intents known "
            f"(seed {record['seed'][0]}), threshold at 2 % in-scope loss chosen on the validation part:",
            "",
            "| encoder | detector | out-of-scope recall | precision | in-scope accuracy | in-scope flagged | "
            "AUROC |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in ("shipped", "tuned"):
            for detector in bench_open_intent.DETECTORS:
                f = split[name][detector]
                lines.append(
                    f"| {name} | {detector} | {f['out_of_scope_recall']:.1%} | "
                    f"{f['out_of_scope_precision']:.1%} | {f['in_scope_accuracy']:.1%} | "
                    f"{f['in_scope_flagged']:.1%} | {f['auroc']:.3f} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_encoder_tuning", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=REPO / "results")
    parser.add_argument(
        "--seed", type=int, action="append", help="repeatable (default 77); open intent takes the first"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=20 * compose.TUNING_SHARE,
        help="each fine-tune's time bound (default: its share of model train's 20 minutes)",
    )
    parser.add_argument(
        "--known", type=float, default=0.5, help="open-intent split: share of intents known (0: skip)"
    )
    parser.add_argument(
        "--per-intent",
        type=int,
        default=0,
        help="few-shot: train on this many train.csv tickets per intent (default 0: every ticket)",
    )
    parser.add_argument("--passes", type=int, default=1, help="the fine-tune's passes over the tickets")
    parser.add_argument(
        "--taxonomy",
        choices=("bank-desk", "banking77"),
        action="append",
        help="measure this taxonomy only (repeatable; default both)",
    )
    args = parser.parse_args(argv)
    missing = encoder_tuning.missing_modules()
    if missing:
        print(f"needs {', '.join(missing)}: pip install -e '.[train]'", file=sys.stderr)
        return 2
    banking77 = load_taxonomy(TAXONOMIES / "banking77.toml")
    train77 = [(e.text, e.intent) for e in read_examples(BANKING77 / "train.csv", banking77)]
    test77 = [(e.text, e.intent) for e in read_examples(BANKING77 / "test.csv", banking77)]
    ood = [line.strip() for line in OUT_OF_DOMAIN.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = list(dict.fromkeys([*(t for t, _ in train77), *(t for t, _ in test77), *ood]))
    shipped = encoder_stage.open_embedder(echo=lambda line: print(line, file=sys.stderr))
    # Few-shot rows read a few hundred train.csv tickets each, not all 10,000: each row embeds its own.
    shipped_lookup = _embedded(shipped, [*(t for t, _ in test77), *ood] if args.per_intent else texts)
    plans = [
        (load_taxonomy(TAXONOMIES / "bank-desk.toml"), _regrouped(train77), _regrouped(test77)),
        (banking77, train77, test77),
    ]
    plans = [plan for plan in plans if args.taxonomy is None or plan[0].name in args.taxonomy]
    seeds = args.seed or [77]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-encoder-tuning-") as scratch:
        for seed, (taxonomy, train_rows, test_rows) in ((s, plan) for s in seeds for plan in plans):
            labelled, selection = train_rows, []
            if args.per_intent:
                labelled = _per_intent(train_rows, args.per_intent, seed)
                drawn = set(labelled)
                selection = _per_intent(
                    [row for row in train_rows if row not in drawn],
                    max(10, SELECTION_ROWS // len(taxonomy.labels)),
                    seed + 1000,
                )
            train, validation, _ = compose.split_rows(labelled, seed)
            row_texts = texts
            if args.per_intent:
                row_texts = list(dict.fromkeys([*(t for t, _ in [*train, *selection, *test_rows]), *ood]))
                encoder_stage.embed(cast(SentenceEmbedder, shipped_lookup), row_texts)
            tuned, report = _tuned(taxonomy, train, args.minutes, seed, Path(scratch), args.passes)
            row = {
                "taxonomy": taxonomy.name,
                "intents": len(taxonomy.labels),
                "seed": seed,
                "tuning": report.as_dict(),
                "shipped": _stage(
                    taxonomy, train, validation, test_rows, ood, shipped_lookup, seed, selection
                ),
                "tuned": _stage(
                    taxonomy, train, validation, test_rows, ood, _embedded(tuned, row_texts), seed, selection
                ),
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
        split = None
        if args.known > 0:
            split = _open_intent(
                banking77, train77, test77, args.known, args.minutes, seeds[0], Path(scratch), shipped
            )
    record = {
        "command": "python -m tools.bench_encoder_tuning " + " ".join(argv or sys.argv[1:]),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "seed": seeds,
        "per_intent": args.per_intent or None,
        "passes": args.passes,
        "test_tickets": len(test77),
        "out_of_domain_tickets": len(ood),
        "rows": rows,
        "open_intent": split,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"encoder-tuning-{args.per_intent}-per-intent" if args.per_intent else "encoder-tuning"
    (args.out / f"{stem}.json").write_bytes(msgspec.json.format(msgspec.json.encode(record)) + b"\n")
    (args.out / f"{stem}.md").write_text(_markdown(record), encoding="utf-8")
    print(f"wrote {args.out / stem}.md and {stem}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
