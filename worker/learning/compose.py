"""One model folder with both stages: what `triage-worker model train --data/--zero-shot` writes.

    DIR/               the ORT GenAI first stage (genai_config.json, model.onnx, tokenizer): `--model DIR`
                       (without the `train` extra there is none, and `--model DIR` serves `encoder/` alone)
    DIR/encoder/       the escalation stage: head.npz, tokenizer.json, encoder.json, the encoder's ONNX file
    DIR/taxonomy.toml  the taxonomy both were trained for; DIR/trained_labels.json its labels' record
    DIR/training.json  how it was trained and its figures; DIR/README.md the model card
    DIR/VERSION        "zero-shot" for a zero-shot folder: every record's `model` says `DIR@zero-shot`

Labelled tickets are split into a training part and a stratified validation part (`stratified_split`, 10 %
of each intent) when every intent has `FULL_ROWS_PER_INTENT` rows or more. With fewer (few-shot: a handful per
intent) a validation part would leave almost nothing to learn from, so every row trains and the encoder stage
is calibrated by k-fold cross-validation instead; the first stage then gets no validation part. The encoder
head is fitted first; its probabilities are the first stage's teacher. Zero-shot uses the taxonomy's texts
(names, descriptions, `examples`) for both, and so do intents the tickets do not cover: `model train` names
them (`coverage_warnings`), the figures say they do not measure them, and every ticket goes to the encoder
stage (`cascade_choice`). The folder is built beside DIR and replaces it whole once complete
(worker/learning/folders.py: only a folder model train wrote, never a shipped one).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import random
import re
import statistics
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from worker.inference import escalation
from worker.inference.encoder import SentenceEmbedder
from worker.inference.loading import ZERO_SHOT_VERSION
from worker.inference.pairing import write_trained_labels
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.learning import encoder_stage, encoder_tuning, folders
from worker.learning.evaluation import CASCADE_THRESHOLDS, Prediction, choose_threshold, stratified_split
from worker.learning.out_of_scope import DEFAULT_IN_SCOPE_LOSS
from worker.settings import DEFAULT_ESCALATE_BELOW

Kind = Literal["zero-shot", "few-shot", "full"]
ENCODER_DIR = "encoder"
TRAINING_FILE = escalation.TRAINING_FILE
# Rows per intent from which a validation part is split off (10 % of 20 = 2 held out, 18 to learn from).
FULL_ROWS_PER_INTENT = 20
# Share of the time bound the encoder stage may take when a first stage follows (embedding is most of it).
ENCODER_SHARE = 0.4
# Share of the time bound the encoder's fine-tune may take (a full folder with the `train` extra), before
# the encoder stage's share: one pass over BANKING77's 9,000 training tickets takes about 6 minutes on two
# quiet cores, so a 20-minute bound tunes on most of them and leaves the first stage about half.
TUNING_SHARE = 0.3
FIRST_STAGE_MODULE = "worker.learning.first_stage"
# The thresholds a full folder's cascade is measured at on its validation part (`measured_cascade`): those
# `model eval` measures, and 1.0, which sends every ticket to the encoder stage.
THRESHOLDS = (*CASCADE_THRESHOLDS, 1.0)
# Seconds per validation ticket that measuring the cascade takes (both stages answer each one), reserved
# from the first stage's time: an encoder pass and a first-stage score on 2 cores, with room to spare.
MEASURE_SECONDS_PER_TICKET = 0.015


@dataclasses.dataclass(frozen=True)
class TrainingOutcome:
    """What was written and measured; `first_stage` is None when no first stage could be trained (`why`)."""

    out_dir: Path
    kind: Kind
    encoder: encoder_stage.EncoderStageReport
    first_stage: Any | None
    first_stage_missing: str | None
    seconds: float
    # The encoder's fine-tune (worker/learning/encoder_tuning.py), or None and why not.
    tuning: encoder_tuning.TuningReport | None = None
    tuning_missing: str | None = None


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def step_reporter(progress: Progress, description: str) -> Callable[[int, int], None]:
    task = progress.add_task(description, total=None)

    def report(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return report


def _first_stage_trainer() -> tuple[Callable[..., Any] | None, str | None]:
    """The first-stage trainer, or None and why not (its module, or the packages it needs, are missing)."""
    try:
        module = importlib.import_module(FIRST_STAGE_MODULE)
    except ModuleNotFoundError as error:
        if error.name == FIRST_STAGE_MODULE:
            return None, f"{FIRST_STAGE_MODULE} is not part of this version"
        return None, f"it needs {error.name}: pip install 'triage-worker[train]'"
    # The module imports torch and the rest inside its functions: ask it what this interpreter lacks.
    missing: list[str] = module.missing_modules()
    if missing:
        return None, f"it needs {', '.join(missing)}: pip install 'triage-worker[train]'"
    trainer: Callable[..., Any] = module.train_first_stage
    return trainer, None


def split_rows(
    rows: Sequence[tuple[str, str]], seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], Kind]:
    """(training part, validation part, kind): a stratified 10 % per intent when every intent present has
    `FULL_ROWS_PER_INTENT` rows, else all rows train (few-shot) and the validation part is empty."""
    counts = Counter(intent for _, intent in rows)
    if min(counts.values()) >= FULL_ROWS_PER_INTENT:
        train, validation = stratified_split(list(rows), lambda row: row[1], seed=seed)
        return train, validation, "full"
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    return shuffled, [], "few-shot"


def intent_coverage(rows: Sequence[tuple[str, str]], taxonomy: Taxonomy) -> dict[str, Any]:
    """Labelled tickets per intent (every intent of the taxonomy, in its order), the intents without any, and
    those with fewer than `encoder_stage.BALANCE_BELOW` (training.json's `data.coverage`)."""
    counts = Counter(intent for _, intent in rows)
    per_intent = {label: counts.get(label, 0) for label in taxonomy.labels}
    return {
        "per_intent": per_intent,
        "without_rows": [label for label, count in per_intent.items() if count == 0],
        "too_few_rows": {
            label: count for label, count in per_intent.items() if 0 < count < encoder_stage.BALANCE_BELOW
        },
    }


def _named(names: Sequence[str]) -> str:
    return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


def coverage_warnings(coverage: dict[str, Any]) -> list[str]:
    """One line for the intents without a labelled ticket, one for those with too few: which, and what the
    model does for them."""
    intents = len(coverage["per_intent"])
    without: list[str] = coverage["without_rows"]
    few: dict[str, int] = coverage["too_few_rows"]
    lines = []
    if without:
        lines.append(
            f"warning: {len(without)} of {intents} intents have no labelled ticket: {_named(without)}. The "
            "model answers them from their taxonomy texts alone (name, description, examples), as a "
            "zero-shot model does, weighed as much as each intent with tickets; no figure below measures "
            "them, and every ticket goes to the encoder stage (escalate_below 1.0). Add tickets for them to "
            "learn and measure them."
        )
    if few:
        named = _named([f"{label} ({count})" for label, count in few.items()])
        lines.append(
            f"warning: {len(few)} of {intents} intents have fewer than {encoder_stage.BALANCE_BELOW} "
            f"labelled tickets: {named}. Every intent weighs the same in the encoder stage's fit, so the "
            "others do not outvote them; one with a single ticket is not measured. More tickets for them "
            "make its answers surer."
        )
    return lines


def _texts_for(taxonomy: Taxonomy, intents: Sequence[str]) -> list[tuple[str, str]]:
    """The taxonomy's texts of `intents` as (text, intent) rows: what the zero-shot path learns them from."""
    texts = dict(zip(taxonomy.labels, encoder_stage.intent_texts(taxonomy), strict=True))
    return [(text, intent) for intent in intents for text in texts[intent]]


def train_model_folder(
    rows: Sequence[tuple[str, str]],
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    out_dir: Path,
    *,
    data: dict[str, Any],
    max_seconds: float,
    unlabelled: Sequence[str] = (),
    seed: int = 77,
    console: Console | None = None,
    embedder: SentenceEmbedder | None = None,
    in_scope_loss: float = DEFAULT_IN_SCOPE_LOSS,
    tune_encoder: bool = True,
    reviewed_out_of_scope: Sequence[str] = (),
) -> TrainingOutcome:
    """Train both stages on labelled (text, intent) rows and write `out_dir` (see the module). `data`
    describes the rows for the model card (file, counts); `in_scope_loss` is the out-of-scope detector's
    operating point (worker/learning/out_of_scope.py), `reviewed_out_of_scope` texts reviewers said fit
    none of the intents (never learnt as one; the detector is measured on them). A full folder fine-tunes
    the encoder first (`tune_encoder`, with the `train` extra); `embedder`, the shipped encoder's, serves
    otherwise."""
    folders.check_target(out_dir)  # before minutes of work, not after them
    console = console or Console(stderr=True)
    started = time.monotonic()
    train, validation, kind = split_rows(rows, seed)
    console.print(
        f"{kind}: {len(train)} tickets to learn from, {len(validation)} held out for validation, "
        f"{len(taxonomy.labels)} intents"
    )
    for line in coverage_warnings(intent_coverage(rows, taxonomy)):
        console.print(line, style="yellow", markup=False, highlight=False)
    trainer, missing = _first_stage_trainer()
    encoder_budget = max_seconds * (ENCODER_SHARE if trainer is not None else 1.0)
    with tempfile.TemporaryDirectory(prefix="triage-encoder-tuning-") as scratch:
        tuning_seconds = max_seconds * TUNING_SHARE
        tuned: tuple[Path, encoder_tuning.TuningReport] | None = None
        tuning_missing = _why_not_tuned(kind, tune_encoder, tuning_seconds)
        if tuning_missing is None:
            tuned_file = Path(scratch) / "model.onnx"
            tuning = fine_tune_encoder(train, taxonomy, tuned_file, tuning_seconds, seed, console)
            if tuning.steps:
                tuned = (tuned_file, tuning)
                embedder = encoder_stage.open_embedder(echo=console.print, encoder=tuned_file)
            else:
                tuning_missing = (
                    f"the {tuning_seconds:.0f} s it had ran out before the first step (a busy machine?)"
                )
        embedder = embedder or encoder_stage.open_embedder(echo=console.print)
        with progress_bar(console) as progress:
            head, report = encoder_stage.fit_encoder_stage(
                train,
                validation,
                taxonomy,
                embedder,
                max_seconds=encoder_budget,
                seed=seed,
                progress=step_reporter(progress, "encoder stage: embedding tickets"),
                in_scope_loss=in_scope_loss,
                reviewed_out_of_scope=reviewed_out_of_scope,
                encoder_saw_training=tuned is not None,
            )
        source = f"logistic regression C={encoder_stage.HEAD_C} on {data.get('file', 'labelled tickets')}"
        return _finish(
            out_dir, kind, head, report, source, train, validation, taxonomy, taxonomy_path, embedder,
            trainer, missing, data, max_seconds, unlabelled, seed, started, console, tuned, tuning_missing,
        )  # fmt: skip


def _why_not_tuned(kind: Kind, wanted: bool, seconds: float) -> str | None:
    """Why the encoder is not fine-tuned for this folder in `seconds` (None: it is)."""
    if not wanted:
        return "not asked for (--no-encoder-tuning)"
    if kind != "full":
        return (
            f"{kind}: tuned on full folders only (on 5 tickets per intent it measured no better, "
            "docs/your-taxonomy.md)"
        )
    if seconds - encoder_tuning.EXPORT_SECONDS < encoder_tuning.MIN_STEP_SECONDS:
        return f"the time bound leaves {seconds:.0f} s to tune in (--max-minutes)"
    missing = encoder_tuning.missing_modules()
    if missing:
        return f"it needs {', '.join(missing)}: pip install 'triage-worker[train]'"
    return None


def fine_tune_encoder(
    train: Sequence[tuple[str, str]],
    taxonomy: Taxonomy,
    out_file: Path,
    max_seconds: float,
    seed: int,
    console: Console,
    passes: int = 1,
) -> encoder_tuning.TuningReport:
    """The shipped encoder fine-tuned on (text, intent) `train` rows of `taxonomy` into `out_file` within
    `max_seconds` and `passes` over the rows (learning/encoder_tuning.py), progress on `console`;
    `make bench-encoder-tuning` too."""
    onnx_file, tokenizer = encoder_stage.shipped_encoder_files(console.print)
    index = {label: i for i, label in enumerate(taxonomy.labels)}
    tickets = [(text, index[intent]) for text, intent in train]
    with progress_bar(console) as progress:
        report = encoder_tuning.tune_encoder(
            onnx_file,
            tokenizer,
            tickets,
            encoder_stage.intent_texts(taxonomy),
            out_file,
            max_seconds=max_seconds,
            seed=seed,
            passes=passes,
            progress=step_reporter(progress, "encoder: fine-tuning on the tickets"),
        )
    console.print(
        f"encoder fine-tuned: {report.steps} of {report.planned_steps} steps ({report.tickets_seen} tickets) "
        f"in {report.seconds / 60:.1f} min"
    )
    return report


def train_zero_shot_folder(
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    out_dir: Path,
    *,
    max_seconds: float,
    seed: int = 77,
    console: Console | None = None,
    embedder: SentenceEmbedder | None = None,
    in_scope_loss: float = DEFAULT_IN_SCOPE_LOSS,
) -> TrainingOutcome:
    """Both stages from the taxonomy's texts alone, and `VERSION` = zero-shot (see the module);
    `in_scope_loss`: the out-of-scope detector's operating point, where the taxonomy has example phrases
    to choose it on."""
    folders.check_target(out_dir)
    console = console or Console(stderr=True)
    started = time.monotonic()
    embedder = embedder or encoder_stage.open_embedder(echo=console.print)
    with progress_bar(console) as progress:
        head, report = encoder_stage.zero_shot_encoder_stage(
            taxonomy,
            embedder,
            step_reporter(progress, "encoder stage: embedding the taxonomy"),
            in_scope_loss=in_scope_loss,
        )
    texts = encoder_stage.intent_texts(taxonomy)
    rows = [(text, intent.name) for intent, own in zip(taxonomy.intents, texts, strict=True) for text in own]
    trainer, missing = _first_stage_trainer()
    data = {"file": None, "taxonomy_texts": len(rows)}
    source = "zero-shot: normalised prototypes of each intent's name, description and examples"
    return _finish(
        out_dir, "zero-shot", head, report, source, rows, [], taxonomy, taxonomy_path, embedder,
        trainer, missing, data, max_seconds, (), seed, started, console,
    )  # fmt: skip


def _finish(
    out_dir: Path,
    kind: Kind,
    head: encoder_stage.LinearHead,
    report: encoder_stage.EncoderStageReport,
    head_source: str,
    train: Sequence[tuple[str, str]],
    validation: Sequence[tuple[str, str]],
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    embedder: SentenceEmbedder,
    trainer: Callable[..., Any] | None,
    missing: str | None,
    data: dict[str, Any],
    max_seconds: float,
    unlabelled: Sequence[str],
    seed: int,
    started: float,
    console: Console,
    tuned: tuple[Path, encoder_tuning.TuningReport] | None = None,
    tuning_missing: str | None = None,
) -> TrainingOutcome:
    """Write the encoder stage (with the fine-tuned encoder `tuned`, if any), train the first stage with the
    head as its teacher, then the folder's records (taxonomy, trained labels, VERSION, training.json, model
    card): built beside `out_dir` and swapped in whole once complete (worker/learning/folders.py)."""
    with folders.writing(out_dir) as building:
        taxonomy, taxonomy_path = _served_taxonomy(taxonomy, taxonomy_path, building)
        console.print(_encoder_line(report, len(taxonomy.labels)))
        encoder_stage.write_encoder_stage(
            building / ENCODER_DIR, head, taxonomy, taxonomy_path, head_source, copy_encoder=True,
            tuned_encoder=None if tuned is None else tuned[0],
        )  # fmt: skip

        # The head alone teaches: on its own training tickets the neighbour vote is each ticket's own label
        # (its nearest row is itself), so it would add nothing but a harder target.
        teaching_head = dataclasses.replace(head, vote=None)

        def teacher(texts: Sequence[str]) -> Any:
            return teaching_head.probabilities(encoder_stage.embed(embedder, texts))

        coverage = intent_coverage([*train, *validation], taxonomy)
        first = None
        if trainer is not None:
            reserved = MEASURE_SECONDS_PER_TICKET * len(validation)
            remaining = max(60.0, max_seconds - (time.monotonic() - started) - reserved)
            with progress_bar(console) as progress:
                first = trainer(
                    # An intent without tickets is learnt from its taxonomy texts, as zero-shot learns all.
                    [*train, *_texts_for(taxonomy, coverage["without_rows"])],
                    validation,
                    taxonomy,
                    taxonomy_path,
                    teacher,
                    building,
                    unlabelled=unlabelled,
                    max_seconds=remaining,
                    seed=seed,
                    progress=step_reporter(progress, "first stage: training"),
                )
        else:
            console.print(
                f"[yellow]first stage not trained: {escape(missing or '')}; --model "
                f"{escape(str(out_dir))} serves the encoder stage alone[/yellow]"
            )
        write_trained_labels(building, taxonomy)
        if kind == "zero-shot":
            for folder in (building, building / ENCODER_DIR):
                (folder / "VERSION").write_text(ZERO_SHOT_VERSION + "\n", encoding="utf-8")
        cascade = cascade_choice(kind, coverage["without_rows"])
        if first is not None and validation and not coverage["without_rows"]:
            cascade = _cascade_on_validation(building, validation, teacher, taxonomy, console)
        outcome = TrainingOutcome(
            out_dir, kind, report, first, missing, time.monotonic() - started,
            tuning=None if tuned is None else tuned[1], tuning_missing=tuning_missing,
        )  # fmt: skip
        record = _training_record(outcome, taxonomy, train, validation, data, unlabelled, seed)
        record["data"]["coverage"] = coverage
        record["cascade"] = cascade
        (building / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        (building / "README.md").write_text(model_card(record), encoding="utf-8")
    return outcome


def trained_kind(folder: Path) -> Kind | None:
    """The kind of a folder this module wrote (its training record says), None for any other model folder:
    the embedded triage-mini has a training.json too, of another recipe and without `kind`."""
    try:
        record = json.loads((folder / TRAINING_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = record.get("kind") if isinstance(record, dict) else None
    return kind if kind in ("zero-shot", "few-shot", "full") else None


def cascade_choice(kind: Kind, without_rows: Sequence[str] = ()) -> dict[str, Any]:
    """The folder's `inference.escalate_below` (used when the setting is left unset) and why, where it cannot
    be measured (`measured_cascade` where it can: a full folder with both stages and a ticket for every
    intent).

    A first stage that saw no held-out ticket is not calibrated, and it is sure of wrong answers: on
    bank-desk, a zero-shot folder served at 0.8 answered 161 of 240 BANKING77 test tickets from its first
    stage and got 42.9 % right, its encoder stage alone 76.6 %. Such folders send every ticket to the
    calibrated encoder stage (1.0); the first stage still answers when the encoder stage cannot in time.
    So do folders with intents `without_rows`: no held-out ticket of theirs could show the first stage's
    confidence on them."""
    if without_rows and kind != "zero-shot":
        return {"escalate_below": 1.0, "why": f"{len(without_rows)} intents have no labelled ticket, so "
                "the first stage's confidence on them is not measured; every ticket goes to the encoder "
                "stage"}  # fmt: skip
    if kind == "full":
        return {"escalate_below": DEFAULT_ESCALATE_BELOW, "why": "no first stage to measure the cascade "
                "with; 0.8 is what `model eval` chose for the shipped model"}  # fmt: skip
    return {"escalate_below": 1.0, "why": f"{kind}: the first stage saw no held-out ticket, so its "
            "confidence is not calibrated; every ticket goes to the encoder stage"}  # fmt: skip


def measured_cascade(
    first: Sequence[tuple[str, float]], encoder: Sequence[str], truth: Sequence[str]
) -> dict[str, Any]:
    """The cascade's threshold from both stages' answers on the same held-out tickets: `first` the first
    stage's (intent, confidence), `encoder` the encoder stage's intent, `truth` the labels.

    A ticket under the threshold is served the encoder stage's answer, one at or over it the first stage's.
    The threshold is the one `model eval` chooses (`choose_threshold`: the best served accuracy, the lowest
    threshold within one ticket of it), among `THRESHOLDS`: the first stage answers every ticket it can
    without costing accuracy, and escalations (an encoder pass each, shed first under load) go where they
    change answers. 1.0 is among them: a first stage that is no help sends every ticket on."""
    firsts = [Prediction(intent, "", confidence) for intent, confidence in first]
    encoders = [Prediction(intent, "", None) for intent in encoder]
    chosen, accuracy = choose_threshold(firsts, encoders, truth, THRESHOLDS)
    count = len(truth)
    escalated = {t: sum(1 for _, confidence in first if confidence < t) / count for t in THRESHOLDS}
    first_alone = sum(1 for (f, _), t in zip(first, truth, strict=True) if f == t) / count
    encoder_alone = sum(1 for e, t in zip(encoder, truth, strict=True) if e == t) / count
    return {
        "escalate_below": chosen,
        "why": f"measured on {count} held-out tickets: {accuracy[chosen]:.1%} served, "
        f"{escalated[chosen]:.0%} escalated; first stage alone {first_alone:.1%}, encoder stage alone "
        f"{encoder_alone:.1%}",
        "validation": {
            "tickets": count,
            "served_accuracy": accuracy[chosen],
            "escalated": escalated[chosen],
            "first_stage_accuracy": first_alone,
            "encoder_stage_accuracy": encoder_alone,
            "by_threshold": {
                str(t): {"served_accuracy": accuracy[t], "escalated": escalated[t]} for t in THRESHOLDS
            },
        },
    }


def _cascade_on_validation(
    out_dir: Path,
    validation: Sequence[tuple[str, str]],
    teacher: Callable[[Sequence[str]], Any],
    taxonomy: Taxonomy,
    console: Console,
) -> dict[str, Any]:
    """`measured_cascade` on the validation part, the first stage served from the written folder."""
    from worker.learning.first_stage import served_answers

    console.print(f"cascade: both stages answer the {len(validation)} held-out tickets")
    texts = [text for text, _ in validation]
    first = served_answers(out_dir, texts)
    encoder = [taxonomy.labels[i] for i in teacher(texts).argmax(axis=1)]
    cascade = measured_cascade(first, encoder, [intent for _, intent in validation])
    console.print(f"cascade: escalate_below {cascade['escalate_below']} ({cascade['why']})")
    return cascade


def _served_taxonomy(taxonomy: Taxonomy, taxonomy_path: Path, out_dir: Path) -> tuple[Taxonomy, Path]:
    """The folder's `taxonomy.toml`: the team's file with `[prompt] list_intents = false`, the prompt the
    first stage is trained on and served with.

    A model that learns the intents needs no list of them in its prompt, and a from-scratch model in a time
    bound pays for one: bank-desk's list (names and descriptions, 1,926 characters against 154 without it)
    is a constant prefix every ticket attends through. Trained on it for 5 minutes, the first stage got
    24.9 % of 301 held-out tickets (12 intents); BANKING77's own taxonomy lists none, and its first stage
    reached 83 % in 7 minutes (77 intents). The rest of the file (comments included) is kept as written."""
    text = taxonomy_path.read_text(encoding="utf-8")
    target = out_dir / "taxonomy.toml"
    if taxonomy.prompt.list_intents:
        line = "list_intents = false  # written by `model train`: the first stage learnt the intents"
        prompt = tomllib.loads(text).get("prompt")
        if prompt is not None and "list_intents" in prompt:
            text = re.sub(r"(?m)^(\s*)list_intents\s*=\s*true\b.*$", r"\g<1>" + line, text, count=1)
        elif prompt is not None:
            text = re.sub(r"(?m)^\[prompt\][^\n]*$", r"\g<0>\n" + line, text, count=1)
        else:
            text = text.rstrip("\n") + f"\n\n[prompt]\n{line}\n"
    target.write_text(text, encoding="utf-8")
    served = load_taxonomy(target)
    if served.labels != taxonomy.labels or served.prompt.list_intents:
        raise RuntimeError(f"{target}: rewriting the prompt changed the taxonomy")  # a bug, not a user error
    return served, target


def _encoder_line(report: encoder_stage.EncoderStageReport, intents: int) -> str:
    figures = (
        f"accuracy {report.validation_accuracy:.1%}, ECE {report.ece:.3f} on {report.held_out} held out "
        f"({report.calibration})"
        if report.validation_accuracy is not None and report.ece is not None
        else f"no held-out figures ({report.calibration})"
    )
    stopped = (
        f"; the time bound stopped it after {report.trained_on} tickets (a random sample of them)"
        if report.stopped_at_time_bound
        else ""
    )
    unmeasured = (
        f"; the figures cover {intents - len(report.unmeasured)} of {intents} intents, not "
        f"{_named(report.unmeasured)}"
        if report.unmeasured and report.validation_accuracy is not None
        else ""
    )
    return (
        f"encoder stage ({report.method}): {figures}, temperature {report.temperature:.3f}, "
        f"{report.seconds:.0f} s{stopped}{unmeasured}"
    )


def _first_stage_dict(first: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.asdict(first)
    return {"report": repr(first)}


def _training_record(
    outcome: TrainingOutcome,
    taxonomy: Taxonomy,
    train: Sequence[tuple[str, str]],
    validation: Sequence[tuple[str, str]],
    data: dict[str, Any],
    unlabelled: Sequence[str],
    seed: int,
) -> dict[str, Any]:
    per_intent = Counter(intent for _, intent in [*train, *validation])
    counts = [per_intent.get(label, 0) for label in taxonomy.labels]
    return {
        "kind": outcome.kind,
        "date": datetime.date.today().isoformat(),
        "taxonomy": {"name": taxonomy.name, "intents": len(taxonomy.labels)},
        "data": {
            **data,
            "training_rows": len(train),
            "validation_rows": len(validation),
            "unlabelled_rows": len(unlabelled),
            "rows_per_intent": {
                "min": min(counts),
                "median": statistics.median(counts),
                "max": max(counts),
                "without_rows": sum(1 for count in counts if count == 0),
            },
        },
        "seed": seed,
        "encoder_stage": outcome.encoder.as_dict(),
        "first_stage": None if outcome.first_stage is None else _first_stage_dict(outcome.first_stage),
        "first_stage_missing": outcome.first_stage_missing,
        "encoder_tuning": None if outcome.tuning is None else outcome.tuning.as_dict(),
        "encoder_tuning_missing": outcome.tuning_missing,
        "seconds": round(outcome.seconds, 1),
    }


def _figure(value: Any, percent: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:.1%}" if percent else f"{value:.3f}"


def tuning_paragraph(tuning: dict[str, Any] | None, missing: str | None) -> str:
    """The model card's words on the encoder's fine-tune, from its `TuningReport` as recorded."""
    if tuning is None:
        return f"**Encoder:** the shipped bge-small-en-v1.5, not fine-tuned ({missing or 'not recorded'})."
    stopped = " (stopped at the time bound)" if tuning["stopped_at_time_bound"] else ""
    return (
        f"**Encoder:** bge-small-en-v1.5 fine-tuned on the training tickets before the head was fitted: "
        f"{tuning['steps']} of {tuning['planned_steps']} steps, {tuning['tickets_seen']} tickets, "
        f"{tuning['seconds'] / 60:.1f} min{stopped}; {tuning['recipe']}. The figures above are the tuned "
        "encoder's, as served. The out-of-scope stand-in figure below is optimistic: the encoder was tuned "
        "on the stand-in intents' tickets too."
    )


def out_of_scope_paragraph(scope: dict[str, Any] | None, zero_shot: bool = False) -> str:
    """The model card's words on the out-of-scope detector, from its `OutOfScopeReport` as recorded
    (`zero_shot`: a folder learnt from the taxonomy alone)."""
    if scope is None and zero_shot:
        return (
            "**Out of scope:** no detector: its operating point is chosen on the taxonomy's example phrases "
            f"(each against prototypes built without it), and the taxonomy has fewer than "
            f"{encoder_stage.ZERO_SHOT_DETECTOR_PHRASES}; every ticket gets one of the intents."
        )
    if scope is None:
        return (
            f"**Out of scope:** no detector: it needs {encoder_stage.BALANCE_BELOW} labelled tickets of "
            "every intent (an intent known by its taxonomy texts alone would be out of scope to it); every "
            "ticket gets one of the intents."
        )
    chosen_on = scope.get("doubt_weight_chosen_on", "stand-ins")  # recorded since reviewers' verdicts count
    by_reviewed = chosen_on == "reviewed tickets"
    stand_in = (
        f" With {scope['stand_in_intents']} of the intents held out as stand-ins for the unknown, fitted the "
        f"same way without them, it flagged {scope['stand_in_recall']:.1%} of their tickets (the distance "
        f"alone: {scope['stand_in_recall_distance_alone']:.1%}) and {scope['stand_in_in_scope_flagged']:.1%} "
        "of the others' held-out tickets"
        + ("; the doubt's weight was chosen on them." if chosen_on == "stand-ins" else ".")
        if scope["stand_in_recall"] is not None
        else ""
    )
    reviewed = (
        f" Of the {scope['reviewed_out_of_scope']} tickets reviewers said fit none of the intents, it flags "
        f"{scope['reviewed_out_of_scope_flagged']:.1%}"
        + ("; they chose the doubt's weight." if by_reviewed else ".")
        if scope.get("reviewed_out_of_scope")
        else ""
    )
    held_out = (
        f"the taxonomy's {scope['held_out']} example phrases, each against prototypes built without it (no "
        "ticket was there to judge by: ask how it does on yours with `model eval --out-of-scope`)"
        if scope["held_out_from"] == "leave-one-out examples"
        else f"{scope['held_out']} held-out in-scope tickets ({scope['held_out_from']})"
    )
    if scope["held_out_from"].startswith("cross-fit"):
        held_out = cross_fit_words(scope)
    assured = (
        f" on new tickets with {scope['assurance']:.0%} confidence" if scope.get("assurance") else ""
    )  # recorded since the operating point allows for its sampling error
    score = scope["method"].split(" + ")[0] + (
        f" plus {scope['doubt_weight']:g} x the stage's doubt (1 - its winning probability)"
        if scope["doubt_weight"]
        else ""
    )
    return (
        f"**Out of scope:** a ticket whose {score} exceeds {scope['threshold']:.4f} is answered "
        "with the taxonomy's out-of-scope intent (`out_of_scope_intent`, default its `fallback_intent`), the "
        "nearest intent kept for reviewers (`out_of_scope.npz`). That threshold is the operating point for "
        f"an in-scope loss of {scope['in_scope_loss_target']:.0%}{assured}: it flagged "
        f"{scope['in_scope_flagged']:.1%} of {held_out}.{stand_in}{reviewed} `model train --in-scope-loss` "
        "moves it."
    )


def cross_fit_words(scope: dict[str, Any]) -> str:
    """How a cross-fitted threshold was measured, in the card's words: on tickets in no role of the
    statistics that scored them, as a new ticket is (worker/learning/out_of_scope.py); the validation
    part's share as served beside it; and where the worker says whether the promise holds live."""
    return (
        f"its {scope['held_out']} training and validation tickets, each scored out of fold by statistics "
        f"fitted without it ({scope['held_out_from']}), as a new ticket is; served, it flags "
        f"{scope['validation_in_scope_flagged']:.1%} of the validation part. The worker exports the promise "
        "as `triage_out_of_scope_expected_ratio` beside the share it answers out of scope (an alert fires "
        "past twice it: drift or new intents)"
    )


def model_card(record: dict[str, Any]) -> str:
    """The folder's README.md from its training record: what it learnt from, its figures, how it adapts."""
    kind = record["kind"]
    data = record["data"]
    encoder = record["encoder_stage"]
    first = record["first_stage"]
    cascade = record.get("cascade") or cascade_choice(kind)  # folders written before it was recorded
    intents = record["taxonomy"]["intents"]
    unmeasured = encoder.get("unmeasured", [])  # recorded since #43
    without_rows = data.get("coverage", {}).get("without_rows", [])
    without = f": {_named(without_rows)}" if without_rows else ""
    if kind == "zero-shot":
        learnt_from = (
            f"the taxonomy alone: {data['taxonomy_texts']} texts (each intent's name, description and "
            "examples); no labelled ticket"
        )
    elif kind == "few-shot":
        learnt_from = (
            f"{data['training_rows']} labelled tickets from {data.get('file')} (a few per intent: "
            f"{data['rows_per_intent']['min']} to {data['rows_per_intent']['max']}), and the taxonomy's texts"
        )
    else:
        learnt_from = (
            f"{data['training_rows']} labelled tickets from {data.get('file')} and the taxonomy's texts, "
            f"{data['validation_rows']} more held out for validation"
        )
    adapts = {
        "zero-shot": "Nothing was held out: there are no tickets. The encoder stage's temperature was "
        "fitted on "
        "each example phrase against prototypes built without it (leave-one-out), so its confidences are "
        "honest about guesses; without examples it is a fixed default. Records of this model say "
        "`model: <folder>@zero-shot`. Run it with review on (`--review-threshold`, see "
        "docs/your-taxonomy.md): "
        "reviewers' corrections are FeedbackEvents, and `triage-worker model train --feedback-topic` turns "
        "them into the few-shot model.",
        "few-shot": f"Fewer than {FULL_ROWS_PER_INTENT} tickets for some intent: a validation part "
        "would leave "
        "too little to learn from, so every ticket trained and the encoder stage's temperature and figures "
        "come from k-fold cross-validation of the same tickets (the figures below are out-of-fold). The "
        "first stage had no validation part.",
        "full": "A stratified 10 % of each intent was held out: the encoder stage's temperature was "
        "fitted on "
        "it and every figure below is measured on it.",
    }[kind]
    found_inside = (
        "the taxonomy and the encoder stage (the cascade's escalation stage, `inference.escalation = "
        '"auto"`) are found inside it.'
    )
    if first is None:
        found_inside = (
            "it has no first stage, so its encoder stage (`encoder/`) answers every ticket, without a "
            "cascade; the taxonomy is found inside it."
        )
        first_rows = f"| first stage | not trained: {record['first_stage_missing']} | | |"
    else:
        first_rows = (
            f"| first stage (ORT GenAI, {first.get('precision', '?')}, {first.get('parameters', '?')} "
            f"parameters) | {_figure(first.get('validation_accuracy'), True)} | "
            f"{_figure(first.get('ece'))} | "
            f"{first.get('seconds', 0):.0f} s |"
        )
    tuning = record.get("encoder_tuning")  # recorded since #46
    tuned = "" if tuning is None else ", fine-tuned on the tickets"
    encoder_row = (
        f"| encoder stage (`encoder/`: bge-small-en-v1.5 int8{tuned} + {encoder['method']}, temperature "
        f"{encoder['temperature']:.3f}, {encoder['calibration']}) | "
        f"{_figure(encoder['validation_accuracy'], True)} | {_figure(encoder['ece'])} | "
        f"{encoder['seconds']:.0f} s |"
    )
    lines = [
        f"# Model card — {record['taxonomy']['name']} ({kind})",
        "",
        f"Written by `triage-worker model train` on {record['date']}; `training.json` has every figure.",
        "",
        f"**Learnt from:** {learnt_from}. Taxonomy `{record['taxonomy']['name']}`, "
        f"{record['taxonomy']['intents']} intents (`taxonomy.toml`; `trained_labels.json` records them, and "
        "every start checks the configured taxonomy against it). Intents without a single ticket: "
        f"{data['rows_per_intent']['without_rows']}{without} (learnt from the taxonomy's texts alone).",
        "",
        "| stage | held-out accuracy | ECE | time |",
        "|---|---|---|---|",
        encoder_row,
        first_rows,
        *(
            [
                f"| served cascade (first stage, escalated under {cascade['escalate_below']}: "
                f"{cascade['validation']['escalated']:.0%} of tickets) | "
                f"{cascade['validation']['served_accuracy']:.1%} | | |"
            ]
            if "validation" in cascade
            else []
        ),
        *(
            [
                "",
                f"**Not measured:** the figures cover {intents - len(unmeasured)} of {intents} intents; no "
                f"held-out ticket was one of {_named(unmeasured)}, so nothing above says how well the model "
                "answers them. Label tickets of theirs and train again to measure them.",
            ]
            if unmeasured and encoder["validation_accuracy"] is not None
            else []
        ),
        "",
        f"**How validation and calibration adapt:** {adapts}",
        "",
        tuning_paragraph(tuning, record.get("encoder_tuning_missing")),
        "",
        out_of_scope_paragraph(encoder.get("out_of_scope"), zero_shot=kind == "zero-shot"),
        "",
        f"**Cascade:** tickets the first stage answers under {cascade['escalate_below']} go to the "
        f"encoder stage ({cascade['why']}); `inference.escalate_below` overrides it.",
        *(
            [
                "",
                "**Time bound:** embedding stopped at the time bound; the encoder stage learnt from the "
                f"first {encoder['trained_on']} training tickets (a random sample of them).",
            ]
            if encoder["stopped_at_time_bound"]
            else []
        ),
        "",
        f"**Run it:** `triage-worker classify --model .` and `triage-worker run --model .` take this folder "
        f"whole: {found_inside} Measure it with `triage-worker model eval --model . --data TICKETS` "
        "before promoting it, run it as a shadow of the current model first (`run --shadow-model .`), then "
        "promote it (docs/your-taxonomy.md).",
    ]
    return "\n".join(lines) + "\n"
