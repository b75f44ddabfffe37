"""`make bench-llm-topk LLM=DIR`: does an LLM deciding among the encoder stage's top candidates
(worker/inference/candidates.py) beat the encoder stage's own answer? (issue #45)

On a seeded sample of BANKING77's test split (`--tickets`, never trained on), for BANKING77's 77 intents and
bank-desk's 12 (the same tickets regrouped, taxonomies/bank-desk.banking77.csv), with encoder stages fitted
the way `model train` fits them (zero-shot from the taxonomy's texts, 5 tickets per intent; and for
BANKING77 the shipped full stage, models/triage-encoder), each served one ticket at a time on one thread:

- the encoder stage alone: accuracy and tickets/s;
- the LLM over its top k (`--ks`), as the stage serves it (the LLM's probabilities times the encoder's,
  renormalised over the k), the LLM's own choice among the k (`llm_alone_accuracy`), how often the right
  intent is among the k at all (the ceiling of any choice among them) and the share the LLM decided (the
  rest keep the encoder's answer: out of scope, no time);
- the first stage (the shipped triage-mini, BANKING77 only: it knows no other labels) and the served
  cascade: the first answer stands at a confidence of `ESCALATE_BELOW` or more, else the stage answers;
  its tickets/s counts the first stage on every ticket and the stage on the escalated ones. (A zero-shot or
  few-shot folder's own first stage is not calibrated: `model train` sets its threshold to 1.0, so there
  every ticket reaches the stage and the cascade's accuracy is the stage's.)

Writes results/llm-topk.json and .md. The LLM is any ORT GenAI folder (e.g. SmolLM2-135M-Instruct int4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tools.bench_train import Row, _per_intent, _regrouped
from worker.classification import Classification, ClassifyRequest
from worker.inference.candidates import CandidatesEngine
from worker.inference.encoder import EncoderEngine
from worker.inference.engine import GenAIEngine
from worker.inference.loading import model_id, resolve_taxonomy
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.learning import compose, encoder_stage
from worker.learning.evaluation import read_examples
from worker.settings import DEFAULT_ESCALATION_DIR, DEFAULT_MODEL_DIR, InferenceSettings

REPO = Path(__file__).resolve().parent.parent
BANKING77 = REPO / "data" / "banking77"
TAXONOMIES = REPO / "taxonomies"
# The shipped first stage's cascade threshold (docs/model.md#the-cascade).
ESCALATE_BELOW = 0.8
FEW_SHOT = 5


def _encoder_folder(
    out: Path, taxonomy: Taxonomy, taxonomy_path: Path, amount: int | str, train: Sequence[Row], seed: int
) -> Path:
    """An encoder stage fitted as `model train` fits it, written to `out`; the shipped one for "all"."""
    if amount == "all":
        return DEFAULT_ESCALATION_DIR
    embedder = encoder_stage.open_embedder(echo=lambda line: print(line, file=sys.stderr))
    if amount == "zero-shot":
        head, _ = encoder_stage.zero_shot_encoder_stage(taxonomy, embedder)
    else:
        rows, validation, _ = compose.split_rows(_per_intent(train, amount, seed), seed)
        head, _ = encoder_stage.fit_encoder_stage(
            rows, validation, taxonomy, embedder, max_seconds=3600, seed=seed
        )
    return encoder_stage.write_encoder_stage(
        out, head, taxonomy, taxonomy_path, f"{amount} (bench)", copy_encoder=False
    )


def _served(classify: Any, texts: Sequence[str]) -> tuple[list[Classification], list[float]]:
    """Each answer and its seconds, one ticket at a time, as a stage's context serves them."""
    answers, seconds = [], []
    for index, text in enumerate(texts):
        started = time.monotonic()
        answers.append(classify(ClassifyRequest(index, text, math.inf)))
        seconds.append(time.monotonic() - started)
    return answers, seconds


def _accuracy(intents: Sequence[str], truth: Sequence[str]) -> float:
    return float(np.mean([i == t for i, t in zip(intents, truth, strict=True)]))


def _llm_alone(encoder: Classification, served: Classification, k: int) -> str:
    """The candidate the LLM alone would choose: the served probabilities of the encoder's top `k` are the
    LLM's times the encoder's (sharing the encoder's mass on them), so dividing by the encoder's gives the
    LLM's back (up to a common factor); the other labels' are the encoder's own."""
    candidates = list(encoder.scores)[:k]
    return max(candidates, key=lambda label: served.scores[label] / encoder.scores[label])


def _row(
    taxonomy_path: Path,
    amount: int | str,
    train: Sequence[Row],
    test: Sequence[Row],
    first: tuple[list[Classification], list[float]] | None,
    llm: Path,
    ks: Sequence[int],
    seed: int,
) -> dict[str, Any]:
    taxonomy = load_taxonomy(taxonomy_path)
    texts, truth = [text for text, _ in test], [intent for _, intent in test]
    with tempfile.TemporaryDirectory(prefix="bench-llm-topk-") as scratch:
        folder = _encoder_folder(Path(scratch) / "encoder", taxonomy, taxonomy_path, amount, train, seed)
        settings = InferenceSettings(
            model=str(folder), taxonomy=str(taxonomy_path), escalation=None, escalation_llm=str(llm)
        )
        stage = EncoderEngine(settings, taxonomy, taxonomy_path).new_context()
        encoder, encoder_s = _served(stage.classify, texts)
        row: dict[str, Any] = {
            "taxonomy": taxonomy.name,
            "intents": len(taxonomy.labels),
            "amount": amount,
            "encoder_stage": _figures([a.intent for a in encoder], truth, encoder_s),
            "llm_over_top_k": {},
        }
        for k in ks:
            top_k = msgspec.structs.replace(settings, escalation_top_k=k)
            engine = CandidatesEngine(top_k, taxonomy, taxonomy_path)
            answers, seconds = _served(engine.new_context().classify, texts)
            in_top_k = [t in list(e.scores)[:k] for e, t in zip(encoder, truth, strict=True)]
            figures = _figures([a.intent for a in answers], truth, seconds)
            decided = [a.model == engine.model_id for a in answers]
            alone = [
                _llm_alone(e, a, k) if by_llm else a.intent
                for e, a, by_llm in zip(encoder, answers, decided, strict=True)
            ]
            figures["llm_alone_accuracy"] = _accuracy(alone, truth)
            figures["truth_in_top_k"] = float(np.mean(in_top_k))
            figures["decided_by_llm"] = float(np.mean(decided))
            row["llm_over_top_k"][str(k)] = figures
            if first is not None:
                row.setdefault("cascade", {})[str(k)] = _cascade(first, answers, seconds, truth)
            print(f"{taxonomy.name} {amount} k={k}: {json.dumps(figures)}", file=sys.stderr, flush=True)
        if first is not None:
            row.setdefault("cascade", {})["encoder"] = _cascade(first, encoder, encoder_s, truth)
    return row


def _figures(intents: Sequence[str], truth: Sequence[str], seconds: Sequence[float]) -> dict[str, Any]:
    return {
        "accuracy": _accuracy(intents, truth),
        "tickets_per_second": len(seconds) / sum(seconds),
        "p95_ms": float(np.percentile(seconds, 95) * 1000.0),
    }


def _cascade(
    first: tuple[list[Classification], list[float]],
    stage: Sequence[Classification],
    stage_seconds: Sequence[float],
    truth: Sequence[str],
) -> dict[str, Any]:
    """The served cascade at `ESCALATE_BELOW`: first answers and their seconds, the stage's for the rest."""
    answers, first_seconds = first
    escalated = [a.confidence < ESCALATE_BELOW and not a.fallback for a in answers]
    served = [s.intent if e else a.intent for a, s, e in zip(answers, stage, escalated, strict=True)]
    seconds = sum(first_seconds) + sum(s for s, e in zip(stage_seconds, escalated, strict=True) if e)
    return {
        "accuracy": _accuracy(served, truth),
        "escalated": float(np.mean(escalated)),
        "tickets_per_second": len(truth) / seconds,
    }


def _findings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per row: the best k against the encoder stage alone, in accuracy and speed."""
    lines = []
    for row in rows:
        stage = row["encoder_stage"]
        k, best = max(row["llm_over_top_k"].items(), key=lambda item: item[1]["accuracy"])
        change = (best["accuracy"] - stage["accuracy"]) * 100.0
        lines.append(
            f"- {row['taxonomy']}, {row['amount']}: the best k ({k}) {_change(change)} the encoder stage "
            "alone "
            f"({best['accuracy']:.1%} against {stage['accuracy']:.1%}; the LLM alone "
            f"{best['llm_alone_accuracy']:.1%}) "
            f"at {stage['tickets_per_second'] / best['tickets_per_second']:.0f}x its time per ticket."
        )
    return lines


def _change(points: float) -> str:
    if abs(points) < 0.05:
        return "matches"
    return f"{'gains' if points > 0 else 'loses'} {abs(points):.1f} points on"


def _markdown(record: dict[str, Any]) -> str:
    lines = [
        "# An LLM deciding among the encoder stage's top candidates",
        "",
        f"`{record['command']}` on {record['machine']}, {record['measured_at']}: {record['tickets']} "
        f"BANKING77 test tickets (seed {record['seed']}), LLM `{record['llm']}`, each stage one ticket at a "
        "time on one thread (tools/bench_llm_topk.py says what each figure is).",
        "",
    ]
    first = record.get("first_stage")
    if first is not None:
        lines += [
            f"First stage ({first['model']}, BANKING77): {first['accuracy']:.1%}, "
            f"{first['tickets_per_second']:.1f} tickets/s; the cascade escalates under {ESCALATE_BELOW}.",
            "",
        ]
    lines += [
        "| taxonomy | encoder stage | stage alone | k | right intent in top k | LLM over top k (served) "
        "| the LLM alone | decided by the LLM | cascade: encoder stage | cascade: LLM over top k |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        stage = row["encoder_stage"]
        cascade = row.get("cascade", {})
        for k, llm in row["llm_over_top_k"].items():
            over, mine = cascade.get("encoder"), cascade.get(k)
            lines.append(
                f"| {row['taxonomy']} ({row['intents']}) | {row['amount']} "
                f"| {stage['accuracy']:.1%}, {stage['tickets_per_second']:.0f}/s | {k} "
                f"| {llm['truth_in_top_k']:.1%} | {llm['accuracy']:.1%}, {llm['tickets_per_second']:.1f}/s "
                f"| {llm['llm_alone_accuracy']:.1%} | {llm['decided_by_llm']:.0%} "
                f"| {_cascade_cell(over)} | {_cascade_cell(mine)} |"
            )
    return "\n".join([*lines, "", *record["findings"], ""])


def _cascade_cell(figures: dict[str, Any] | None) -> str:
    if figures is None:
        return "-"
    return (
        f"{figures['accuracy']:.1%}, {figures['tickets_per_second']:.1f}/s "
        f"({figures['escalated']:.0%} escalated)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_llm_topk", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--llm", type=Path, required=True, help="the ORT GenAI model folder that decides")
    parser.add_argument("--tickets", type=int, default=300, help="test tickets in the sample (default 300)")
    parser.add_argument("--ks", default="2,3,5", help="candidate counts to measure (default 2,3,5)")
    parser.add_argument("--seed", type=int, default=77, help="seed of the sample and the few-shot draws")
    parser.add_argument("--out", type=Path, default=REPO / "results", help="folder for llm-topk.json/.md")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    banking77_path = TAXONOMIES / "banking77.toml"
    banking77 = load_taxonomy(banking77_path)
    train77 = [(e.text, e.intent) for e in read_examples(BANKING77 / "train.csv", banking77)]
    test77 = random.Random(args.seed).sample(
        [(e.text, e.intent) for e in read_examples(BANKING77 / "test.csv", banking77)], args.tickets
    )
    first_settings = InferenceSettings(model=str(DEFAULT_MODEL_DIR), escalation=None)
    first_context = GenAIEngine(first_settings, *resolve_taxonomy(first_settings)).new_context("score")
    first = _served(first_context.classify, [text for text, _ in test77])
    plans: list[tuple[Path, Sequence[Row], Sequence[Row], int | str, bool]] = [
        (banking77_path, train77, test77, "zero-shot", True),
        (banking77_path, train77, test77, FEW_SHOT, True),
        (banking77_path, train77, test77, "all", True),
        (TAXONOMIES / "bank-desk.toml", _regrouped(train77), _regrouped(test77), "zero-shot", False),
        (TAXONOMIES / "bank-desk.toml", _regrouped(train77), _regrouped(test77), FEW_SHOT, False),
    ]
    rows = [
        _row(path, amount, train, test, first if served else None, args.llm, ks, args.seed)
        for path, train, test, amount, served in plans
    ]
    record = {
        "command": f"python -m tools.bench_llm_topk {' '.join(sys.argv[1:] if argv is None else argv)}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores (shared)",
        "llm": model_id(args.llm),
        "tickets": args.tickets,
        "seed": args.seed,
        "first_stage": {
            "model": model_id(DEFAULT_MODEL_DIR),
            **_figures([a.intent for a in first[0]], [t for _, t in test77], first[1]),
        },
        "rows": rows,
    }
    record["findings"] = _findings(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm-topk.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (args.out / "llm-topk.md").write_text(_markdown(record), encoding="utf-8")
    print(f"wrote {args.out / 'llm-topk.md'} and llm-topk.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
