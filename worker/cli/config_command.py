"""`config show` (effective settings, secrets masked) and `schemas --check|--write` (contracts on disk).

The files in ``schemas/`` are generated from the msgspec Structs and the dead-letter header table, so the
Structs stay the one source of truth; ``--check`` is what CI and the tests run to catch a drifted copy.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import typing
from pathlib import Path

import msgspec

from worker.contracts.avro_schema import avro_schema_text
from worker.decoding import DecodeErrorType
from worker.errors import UserError
from worker.kafka.dead_letters import (
    HEADER_DOCS,
    MAX_MESSAGE_BYTES,
    OPTIONAL_HEADER_DOCS,
    PIPELINE_ERROR_DOCS,
)
from worker.learning.feedback import FEEDBACK_ERROR_DOCS
from worker.messages import FeedbackEvent, ReviewRecord, ShadowResult, TicketEvent, TriageResult
from worker.settings import add_config_argument, settings_from_args, settings_to_toml
from worker.shipped import is_source_checkout, shipped_path

SCHEMA_DIR = shipped_path("schemas")
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _json_schema(struct: type[msgspec.Struct]) -> str:
    schema: dict[str, object] = {"$schema": JSON_SCHEMA_DIALECT, **msgspec.json.schema(struct)}
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _dead_letter_doc() -> str:
    rows = "\n".join(f"| `{name}` | {meaning} |" for name, meaning in (*HEADER_DOCS, *OPTIONAL_HEADER_DOCS))
    error_types = ", ".join(f"`{name}`" for name in typing.get_args(DecodeErrorType))
    pipeline_types = "; ".join(f"`{name}`: {meaning}" for name, meaning in PIPELINE_ERROR_DOCS)
    feedback_types = "; ".join(f"`{name}`: {meaning}" for name, meaning in FEEDBACK_ERROR_DOCS)
    return f"""# Dead-letter records

<!-- Generated from worker/kafka/dead_letters.py by `triage-worker schemas --write`; do not edit. -->

A record the worker cannot decode as a `TicketEvent` goes to the dead-letter topic (`topics.dead_letter`,
default `tickets.dlq`) with its original key, value bytes and headers untouched (with `dead_letter.redact =
true`, their personal data redacted: `triage.redacted`), plus these headers (values are UTF-8 text):

| Header | Meaning |
|---|---|
{rows}

`triage.error.type` values written by the decoder: {error_types}. Written by the pipeline:
{pipeline_types}.

Feedback records (`topics.feedback`) that `triage-worker model train --feedback-topic` refuses go to the
same topic, with the feedback topic as `triage.source.topic`: {feedback_types}.

`triage.error.message` is cut to {MAX_MESSAGE_BYTES} bytes. When a replayed record fails again, the
`triage.*` headers of the earlier failure are replaced, not repeated, and `triage.replay_count` carries on.
"""


def schema_files() -> dict[str, str]:
    """File name in ``schemas/`` → the content generated from the code right now."""
    return {
        "ticket_event.schema.json": _json_schema(TicketEvent),
        "triage_result.schema.json": _json_schema(TriageResult),
        # What a registry-format output topic registers (worker/contracts/avro_schema.py).
        "triage_result.avsc": avro_schema_text(TriageResult),
        "shadow_result.schema.json": _json_schema(ShadowResult),
        "review_record.schema.json": _json_schema(ReviewRecord),
        "feedback_event.schema.json": _json_schema(FeedbackEvent),
        "dead_letter.md": _dead_letter_doc(),
    }


def drifted_schemas(directory: Path) -> dict[str, str]:
    """File name → unified diff (disk → code) for each file in `directory` that is missing or stale."""
    drift: dict[str, str] = {}
    for name, expected in schema_files().items():
        path = directory / name
        try:
            # Not UTF-8 is drift like any other, shown in the diff.
            actual = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        except OSError as error:
            raise UserError(f"schemas: cannot read {path}: {error.strerror or error}") from None
        if actual != expected:
            diff = difflib.unified_diff(
                actual.splitlines(keepends=True),
                expected.splitlines(keepends=True),
                fromfile=f"{path} (on disk)",
                tofile=f"{path} (from the code)",
            )
            drift[name] = "".join(diff)
    return drift


def _show_config(args: argparse.Namespace) -> int:
    sys.stdout.write(settings_to_toml(settings_from_args(args)))
    return 0


def _schemas(args: argparse.Namespace) -> int:
    if args.write and args.dir is None and not is_source_checkout():
        # The default folder is then the installed package's own copy, which is no place to write to.
        raise UserError("schemas --write: pass --dir DIR (an installed package, not a source checkout)")
    directory: Path = args.dir or SCHEMA_DIR
    if args.write:
        _write_schemas(directory)
        return 0
    if not directory.is_dir():
        # Not six diffs against empty files: the folder itself is the problem.
        problem = "is not a folder" if directory.exists() else "does not exist"
        raise UserError(f"schemas --check: {directory} {problem}")
    drift = drifted_schemas(directory)
    for name, diff in drift.items():
        if not (directory / name).is_file():
            print(f"{directory / name} is missing", file=sys.stderr)
            continue
        lines = diff.splitlines()
        shown = "\n".join(lines[:40]) + (
            f"\n... ({len(lines) - 40} more diff lines)" if len(lines) > 40 else ""
        )
        print(f"{directory / name} is out of date with the code:\n{shown}", file=sys.stderr)
    if drift:
        print("run `triage-worker schemas --write` and commit the result", file=sys.stderr)
        return 1
    print(f"schemas in {directory} match the code")
    return 0


def _write_schemas(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"schemas --write: {directory} is not a folder") from None
    except OSError as error:
        raise UserError(f"schemas --write: cannot create {directory}: {error.strerror or error}") from None
    for name, content in schema_files().items():
        path = directory / name
        try:
            path.write_text(content, encoding="utf-8")
        except OSError as error:
            raise UserError(f"schemas --write: cannot write {path}: {error.strerror or error}") from None
        print(f"wrote {path}")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = subparsers.add_parser("config", help="inspect the effective configuration")
    actions = config.add_subparsers(title="actions", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show", help="print the effective settings as TOML (defaults < file < env < --set), secrets masked"
    )
    add_config_argument(show)
    show.set_defaults(handler=_show_config)

    schemas = subparsers.add_parser("schemas", help="check or regenerate the message schemas in schemas/")
    mode = schemas.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff if the files drifted")
    mode.add_argument("--write", action="store_true", help="regenerate the files from the code")
    schemas.add_argument("--dir", type=Path, help=f"schema folder (default {SCHEMA_DIR})")
    schemas.set_defaults(handler=_schemas)
