"""Does the out-of-scope detector keep its promise on tickets it never saw? BANKING77-built taxonomies.

    python -m tools.bench_scope_promise --out results       # results/scope-promise.md and .json

`model train --in-scope-loss 2 %` promises at most 2 % of new in-scope tickets flagged, with 90 % confidence.
Per taxonomy (bank-desk's 12 coarse intents, BANKING77's 77, and BANKING77 open-intent splits with a seeded
25, 50 or 75 % of the intents known), the encoder stage is fitted on train.csv exactly as `model train` fits
it (`compose.split_rows`, `encoder_stage.fit_encoder_stage`); then both operating points for the same score
(the distance plus the weighted doubt, the weight chosen on stand-ins as before):

- **validation** (before): the threshold from the validation part's scores alone, as folders were fitted
  before the cross-fit;
- **cross-fit** (after, what `model train` now writes): from the out-of-fold scores of every training and
  validation ticket (worker/learning/out_of_scope.py, `cross_fitted_scores`).

For each: the figure the card gives (the share of the rows that chose it flagged), and the share of
test.csv's in-scope tickets flagged, which nothing was fitted or chosen on; with out-of-scope recall on the
open-intent splits (what the change costs or gains in catching the unknown). The embeddings come from
bench_open_intent's cache (`--cache`; a first run embeds train.csv and test.csv once).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tools import REPO
from tools.bench_open_intent import BANKING77, VectorLookup, cached_embeddings, fit_as_train, known_taxonomy
from worker.cache import cache_root
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.learning import encoder_stage
from worker.learning.evaluation import read_examples
from worker.learning.out_of_scope import ASSURANCE, DEFAULT_IN_SCOPE_LOSS, threshold_for

TAXONOMIES = REPO / "taxonomies"
CASES = ("bank-desk", "banking77", "25% known", "50% known", "75% known")
POINTS = ("validation", "cross-fit")
Row = tuple[str, str]


def regrouped(rows: Sequence[Row]) -> list[Row]:
    """BANKING77 rows relabelled with bank-desk's coarse intents (taxonomies/bank-desk.banking77.csv)."""
    with (TAXONOMIES / "bank-desk.banking77.csv").open(encoding="utf-8", newline="") as handle:
        mapping = {row["banking77_intent"]: row["bank_desk_intent"] for row in csv.DictReader(handle)}
    return [(text, mapping[intent]) for text, intent in rows]


def case_data(
    case: str, train: Sequence[Row], test: Sequence[Row], seed: int
) -> tuple[Taxonomy, list[Row], list[Row]]:
    """(taxonomy, its training rows, every test row labelled in its terms) for `case`."""
    banking77 = load_taxonomy(TAXONOMIES / "banking77.toml")
    if case == "bank-desk":
        return load_taxonomy(TAXONOMIES / "bank-desk.toml"), regrouped(train), regrouped(test)
    if case == "banking77":
        return banking77, list(train), list(test)
    known = known_taxonomy(banking77, float(case.split("%")[0]) / 100, seed)
    labels = set(known.labels)
    return known, [row for row in train if row[1] in labels], list(test)


def one_fit(
    taxonomy: Taxonomy,
    rows: Sequence[Row],
    test: Sequence[Row],
    embedder: VectorLookup,
    in_scope_loss: float,
    seed: int,
) -> dict[str, Any]:
    """Fit as `model train` does; both operating points' card figure and test figures."""
    fitted = fit_as_train(rows, taxonomy, embedder, seed, in_scope_loss)
    train, validation, head, report, seconds = (
        fitted.train,
        fitted.validation,
        fitted.head,
        fitted.report,
        fitted.seconds,
    )
    detector, scope = head.out_of_scope, report.out_of_scope
    assert detector is not None and scope is not None
    known = set(taxonomy.labels)
    in_scope = np.array([intent in known for _, intent in test])

    def scores(texts: Sequence[str]) -> Any:
        x = embedder.embed_batch(texts)[0]
        return detector.scores(x, head.probabilities(x).max(axis=1))

    validation_scores = scores([text for text, _ in validation])
    test_scores = scores([text for text, _ in test])
    thresholds = {
        "validation": threshold_for(validation_scores, in_scope_loss),
        "cross-fit": detector.threshold,
    }
    card = {
        "validation": float((validation_scores > thresholds["validation"]).mean()),
        "cross-fit": scope.in_scope_flagged,
    }
    points = {}
    for point, threshold in thresholds.items():
        flagged = test_scores > threshold
        points[point] = {
            "threshold": threshold,
            "chosen_on": len(validation_scores) if point == "validation" else scope.held_out,
            "card_in_scope_flagged": card[point],
            "validation_in_scope_flagged": float((validation_scores > threshold).mean()),
            "test_in_scope_flagged": float(flagged[in_scope].mean()),
            "test_out_of_scope_recall": float(flagged[~in_scope].mean()) if (~in_scope).any() else None,
        }
    return {
        "seed": seed,
        "intents": len(known),
        "train_tickets": len(train),
        "validation_tickets": len(validation),
        "test_in_scope": int(in_scope.sum()),
        "test_out_of_scope": int((~in_scope).sum()),
        "doubt_weight": detector.doubt_weight,
        "fit_seconds": round(seconds, 1),
        **points,
    }


def summary(fits: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per operating point and figure: mean, min and max over the seeds."""
    result: dict[str, Any] = {}
    for point in POINTS:
        result[point] = {}
        for figure, value in fits[0][point].items():
            if value is None or figure == "threshold":
                continue
            values = [fit[point][figure] for fit in fits]
            result[point][figure] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return result


def _cell(value: dict[str, float], as_share: bool = True) -> str:
    if as_share:
        return f"{value['mean']:.2%} ({value['min']:.2%}-{value['max']:.2%})"
    return f"{value['mean']:.0f}"


def markdown(record: dict[str, Any]) -> str:
    loss = record["in_scope_loss"]
    lines = [
        "# The out-of-scope detector's promise on new tickets (BANKING77-built taxonomies)",
        "",
        f"`{record['command']}` on {record['machine']}, {record['date']}. Promise: at most {loss:.0%} of new "
        f"in-scope tickets flagged, with {ASSURANCE:.0%} confidence. Each taxonomy's encoder stage is fitted "
        "on train.csv as `model train` fits it; its threshold chosen two ways for the same score: on the "
        "validation part alone (before) and by cross-fitting every training and validation ticket (after, "
        "what `model train` now writes). *Card*: the share of the rows that chose it flagged (what the "
        "folder's README says); *test*: test.csv's in-scope tickets flagged (nothing fitted or chosen on "
        f"them). Seeds {', '.join(str(s) for s in record['seeds'])}: mean (min-max).",
        "",
        "| taxonomy | operating point | chosen on (rows) | card: flagged | test: in-scope flagged "
        "| test: out-of-scope caught |",
        "|---|---|---|---|---|---|",
    ]
    for case, result in record["results"].items():
        for point in POINTS:
            figures = result["summary"][point]
            caught = figures.get("test_out_of_scope_recall")
            lines.append(
                f"| {case} ({result['fits'][0]['intents']} intents) | {point} "
                f"| {_cell(figures['chosen_on'], as_share=False)} "
                f"| {_cell(figures['card_in_scope_flagged'])} "
                f"| {_cell(figures['test_in_scope_flagged'])} | {'-' if caught is None else _cell(caught)} |"
            )
    over = record["over_promise"]
    lines += [
        "",
        f"Fits whose test figure exceeds the promise ({loss:.0%}): "
        + ", ".join(f"{point} {over[point]['count']} of {over[point]['fits']}" for point in POINTS)
        + f" (the promise allows about {1 - ASSURANCE:.0%}); whose test figure exceeds the card's by more "
        "than half the promise: "
        + ", ".join(f"{point} {over[point]['card_off']}" for point in POINTS)
        + ". `scope-promise.json` has every fit.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_scope_promise", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "results", help="folder for scope-promise.md/.json"
    )
    parser.add_argument("--data", type=Path, default=BANKING77, help="BANKING77 folder (train.csv, test.csv)")
    parser.add_argument("--in-scope-loss", type=float, default=DEFAULT_IN_SCOPE_LOSS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="the seeds of each taxonomy's fit")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--cache", type=Path, default=cache_root() / "open-intent", help="embedding cache")
    args = parser.parse_args(argv)
    banking77 = load_taxonomy(TAXONOMIES / "banking77.toml")
    train = [(e.text, e.intent) for e in read_examples(args.data / "train.csv", banking77)]
    test = [(e.text, e.intent) for e in read_examples(args.data / "test.csv", banking77)]
    desk = load_taxonomy(TAXONOMIES / "bank-desk.toml")
    batches = [
        [text for text, _ in train],
        [text for text, _ in test],
        [text for own in encoder_stage.intent_texts(banking77) for text in own],
        [text for own in encoder_stage.intent_texts(desk) for text in own],
    ]
    vectors = {
        text: vector
        for batch in batches
        for text, vector in zip(batch, cached_embeddings(batch, args.cache), strict=True)
    }
    embedder = VectorLookup(vectors, len(next(iter(vectors.values()))))
    seeds: list[int] = args.seeds
    results: dict[str, Any] = {}
    for case in args.cases:
        fits = []
        for seed in seeds:
            taxonomy, rows, labelled_test = case_data(case, train, test, seed)
            fit = one_fit(taxonomy, rows, labelled_test, embedder, args.in_scope_loss, seed)
            fits.append(fit)
            print(
                f"{case}, seed {seed} ({fit['fit_seconds']:.0f} s): test in-scope flagged "
                + ", ".join(f"{point} {fit[point]['test_in_scope_flagged']:.2%}" for point in POINTS),
                file=sys.stderr,
            )
        results[case] = {"summary": summary(fits), "fits": fits}
    every = [fit for result in results.values() for fit in result["fits"]]
    over_promise = {
        point: {
            "fits": len(every),
            "count": sum(fit[point]["test_in_scope_flagged"] > args.in_scope_loss for fit in every),
            "card_off": sum(
                fit[point]["test_in_scope_flagged"] - fit[point]["card_in_scope_flagged"]
                > args.in_scope_loss / 2
                for fit in every
            ),
        }
        for point in POINTS
    }
    record = {
        "command": shlex.join(["python", "-m", "tools.bench_scope_promise", *(argv or sys.argv[1:])]),
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "in_scope_loss": args.in_scope_loss,
        "assurance": ASSURANCE,
        "seeds": seeds,
        "results": results,
        "over_promise": over_promise,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scope-promise.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (args.out / "scope-promise.md").write_text(markdown(record), encoding="utf-8")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
