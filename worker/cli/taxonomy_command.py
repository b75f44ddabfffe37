"""`triage-worker taxonomy ...`: write a taxonomy from a team's tickets, and check one before training on it.

`taxonomy init --from-data FILE` lists every label of a CSV or JSON-lines export (worker/learning/data.py)
as an intent, its ticket count as a comment, with a placeholder description and priority for a person to
fill in; it never writes a file `taxonomy check` refuses (one over 1 MiB: thousands of labels). `taxonomy
check FILE` reports every problem of a taxonomy at once, one line each (the loader stops at the first), and
exits 2 when one of them stops a load; placeholders left from `init` and intents without a description are
warnings (zero-shot training learns from the descriptions). `taxonomy discover` groups the tickets no intent
covers into proposed intents (worker/learning/discovery.py) and writes the next step's inputs
(worker/learning/discovery_report.py): with `--model DIR` it classifies the tickets as `classify` does and
keeps those answered "none of these"; with `--all` it clusters every ticket (a team without a taxonomy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from worker.app.offline import classify_lines
from worker.classification import ticket_text
from worker.decoding import DecodeError, decode_ticket
from worker.errors import UserError
from worker.inference.taxonomy import INTENT_NAME, Taxonomy, load_taxonomy, parse_taxonomy
from worker.learning import discovery, discovery_report, encoder_stage
from worker.learning.data import intent_name, iter_label_counts, read_ticket_rows
from worker.logs import configure_logging
from worker.messages import PRIORITIES, TicketEvent, TriageResult
from worker.pipeline.sources.lines import LineReader, stream_lines
from worker.settings import Settings, add_config_argument, settings_from_args
from worker.small_files import MAX_SMALL_FILE_BYTES, read_small_file

PLACEHOLDER = "TODO:"
PLACEHOLDER_PRIORITY = "Medium"


def check_taxonomy(path: Path) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the taxonomy file, each one line naming where. No errors: it loads."""
    try:
        text = read_small_file(path, "a taxonomy").decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"taxonomy file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read taxonomy file {path}: {error}") from None
    return check_taxonomy_text(text, str(path))


def check_taxonomy_text(text: str, path: str) -> tuple[list[str], list[str]]:
    """`check_taxonomy` of a file's text (`path` names it in the lines); the size bound is the caller's."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        return [f"{path}: not valid TOML: {error}"], []
    errors: list[str] = []
    warnings: list[str] = []
    priorities = document.get("priorities", list(PRIORITIES))
    intents = document.get("intents")
    if not isinstance(intents, list) or not intents:
        errors.append(f"{path}: `intents` must list at least one intent ([[intents]] tables)")
        intents = []
    seen: dict[str, int] = {}
    for index, intent in enumerate(intents):
        where = f"{path}: intents[{index}]"
        if not isinstance(intent, dict):
            errors.append(f"{where} is not a table")
            continue
        name = intent.get("name")
        where += f" ({name})" if isinstance(name, str) else ""
        _check_intent(intent, where, priorities, errors, warnings)
        if isinstance(name, str):
            if name in seen:
                errors.append(f"{where}: the name is listed twice (first as intents[{seen[name]}])")
            seen.setdefault(name, index)
    described = Counter(
        intent["description"].strip()
        for intent in intents
        if isinstance(intent, dict) and isinstance(intent.get("description"), str)
        and intent["description"].strip() and not intent["description"].startswith(PLACEHOLDER)
    )  # fmt: skip
    for description, count in described.items():
        if count > 1:
            warnings.append(f"{path}: {count} intents share the description {description!r}")
    if not errors:
        try:
            parse_taxonomy(
                document, path
            )  # the rules of the whole file (fallbacks, priorities, unknown keys)
        except UserError as error:
            errors.append(str(error))
    return errors, warnings


def _check_intent(
    intent: dict[str, Any], where: str, priorities: Any, errors: list[str], warnings: list[str]
) -> None:
    name = intent.get("name")
    if not isinstance(name, str) or not name:
        errors.append(f"{where}: no `name`")
    elif not INTENT_NAME.match(name):
        errors.append(f"{where}: name {name!r} must be letters, digits or _.:/- (no spaces or quotes)")
    description = intent.get("description")
    if description is None:
        errors.append(f"{where}: no `description` (one line saying what its tickets are about)")
    elif not isinstance(description, str) or "\n" in description:
        errors.append(f"{where}: `description` must be one line of text")
    elif not description.strip():
        warnings.append(f"{where}: empty description (zero-shot training learns the intent from it)")
    elif description.startswith(PLACEHOLDER):
        warnings.append(f"{where}: the description is still the placeholder from `taxonomy init`")
    priority = intent.get("priority")
    if priority is None:
        errors.append(f"{where}: no `priority` (one of {', '.join(map(str, priorities))})")
    elif priority not in priorities:
        errors.append(f"{where}: priority {priority!r} is not one of {', '.join(map(str, priorities))}")
    examples = intent.get("examples", [])
    if not isinstance(examples, list) or not all(isinstance(e, str) and e.strip() for e in examples):
        errors.append(f"{where}: `examples` must be a list of non-empty one-line phrases")
    unknown = sorted(set(intent) - {"name", "description", "priority", "examples"})
    if unknown:
        errors.append(f"{where}: unknown key(s) {', '.join(unknown)} (name, description, priority, examples)")


def init_taxonomy(data_file: Path, text_column: str | None, label_column: str | None, name: str) -> str:
    """A taxonomy TOML with every label of `data_file` as an intent (see the module); a UserError instead
    when it would be one `taxonomy check` refuses (over `MAX_SMALL_FILE_BYTES`: the label column holds ids
    or free text, not intents)."""
    data = read_ticket_rows(data_file, text_column, label_column)
    by_name: dict[str, list[tuple[str, int]]] = {}
    for label, count in iter_label_counts(data):
        by_name.setdefault(intent_name(label), []).append((label, count))
    fallback = "unclassified"
    while fallback in by_name:
        fallback = f"{fallback}_"
    lines = [
        f"# Taxonomy written by `triage-worker taxonomy init --from-data {data_file}`:",
        f"# {len(data.rows)} usable tickets, {len(by_name)} labels (most tickets first). For each intent,",
        "# write a one-line description (zero-shot training and the prompt use it) and its priority,",
        "# optionally a few example phrases (examples = [...]); then `triage-worker taxonomy check` it.",
        f"# {data.summary()}",
        f"name = {json.dumps(name)}",
        f"fallback_intent = {json.dumps(fallback)}",
        'fallback_priority = "Medium"',
        f"priorities = {json.dumps(list(PRIORITIES))}",
    ]
    for intent, labels in by_name.items():
        total = sum(count for _, count in labels)
        spelled = ", ".join(json.dumps(label) for label, _ in labels)
        lines += [
            "",
            "[[intents]]",
            f"# {total} tickets (label {spelled})",
            f"name = {json.dumps(intent)}",
            f"description = {json.dumps(f'{PLACEHOLDER} one line saying what {intent} tickets are about')}",
            f"priority = {json.dumps(PLACEHOLDER_PRIORITY)}",
        ]
    text = "\n".join(lines) + "\n"
    size = len(text.encode("utf-8"))
    if size > MAX_SMALL_FILE_BYTES:
        raise UserError(
            f"{data_file}: {len(by_name)} labels in column {data.label_column!r} would make a taxonomy of "
            f"{size / 2**20:.1f} MiB, over the {MAX_SMALL_FILE_BYTES >> 20} MiB `taxonomy check` and "
            "`model train` read: is it the label column (--label-column NAME)? Labels that many need merging "
            "into intents first"
        )
    # Never what `taxonomy check` refuses, whatever the name (`--name ""`) or the file's name holds.
    errors, _ = check_taxonomy_text(text, f"the taxonomy from {data_file}")
    if errors:
        raise UserError(f"{errors[0]} (nothing written)")
    return text


def _check(args: argparse.Namespace) -> int:
    errors, warnings = check_taxonomy(Path(args.file))
    for line in errors:
        print(f"error: {line}")
    for line in warnings:
        print(f"warning: {line}")
    if errors:
        return 2
    taxonomy = load_taxonomy(Path(args.file))
    by_priority = Counter(intent.priority for intent in taxonomy.intents)
    spread = ", ".join(f"{priority} {by_priority[priority]}" for priority in taxonomy.priorities)
    examples = sum(len(intent.examples) for intent in taxonomy.intents)
    print(f"{args.file}: ok, {len(taxonomy.labels)} intents ({spread}), {examples} example phrases")
    return 0


def _init(args: argparse.Namespace) -> int:
    data_file = Path(args.from_data)
    name = args.name or intent_name(data_file.stem) or "my-taxonomy"
    text = init_taxonomy(data_file, args.text_column, args.label_column, name)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if out.exists():
        raise UserError(f"--out {out} exists: refusing to overwrite a taxonomy (choose another name)")
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: fill in each description and priority, then `triage-worker taxonomy check {out}`")
    return 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _read_tickets(path: Path, limit: int) -> list[tuple[int, bytes, TicketEvent]]:
    """(line index, line, ticket) of each line of `path` that is a ticket; the others counted on stderr
    by reason (their text is never printed: it may hold personal data)."""
    if not path.is_file():
        raise UserError(f"taxonomy discover: --input {path} is not a file")
    tickets, skipped = [], Counter[str]()
    with path.open("rb") as source:
        for index, line, unread in stream_lines(source, limit):
            if unread is not None:
                skipped[unread[0]] += 1
                continue
            try:
                tickets.append((index, line, decode_ticket(line, limit)))
            except DecodeError as error:
                skipped[error.error_type] += 1
    if skipped:
        _stderr(f"{path}: {sum(skipped.values())} lines skipped, not tickets ({dict(skipped.most_common())})")
    if not tickets:
        raise UserError(f"taxonomy discover: {path} holds no ticket (JSON lines of TicketEvent objects)")
    return tickets


def _out_of_scope(
    settings: Settings, name: str, tickets: Sequence[tuple[int, bytes, TicketEvent]]
) -> set[int]:
    """The line indices of the tickets the model answers "none of these", classified as `classify` does."""
    flagged: set[int] = set()
    decoder = msgspec.json.Decoder(TriageResult)

    def result(line: int, value: bytes) -> None:
        if decoder.decode(value).out_of_scope:
            flagged.add(line)

    reader = LineReader(iter([(index, line, None) for index, line, _ in tickets]), name)
    _stderr(f"classifying {len(tickets)} tickets with {settings.inference.model} ...")
    run = classify_lines(settings, reader, result, lambda _line, _kind, _message: None, announce=False)
    _stderr(f"classified {run.written} tickets in {run.seconds:.1f} s: {len(flagged)} answered none of these")
    return flagged


def _known_centres(taxonomy: Taxonomy | None, embedder: Any) -> dict[str, Any]:
    """Each existing intent's centre: the mean embedding of its name, description and examples."""
    if taxonomy is None:
        return {}
    texts = encoder_stage.intent_texts(taxonomy)
    return {
        intent.name: encoder_stage.embed(embedder, own).mean(axis=0)
        for intent, own in zip(taxonomy.intents, texts, strict=True)
    }


def _discover(args: argparse.Namespace) -> int:
    if (args.model is None) == (not args.all):
        raise UserError("taxonomy discover: give either --model DIR (its out-of-scope tickets) or --all")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"taxonomy discover: --out {out} exists and is not an empty folder (choose another)")
    settings = settings_from_args(args, {"inference.model": args.model, "inference.taxonomy": args.taxonomy})
    configure_logging(settings.log, settings.privacy)
    source = Path(args.input)
    tickets = _read_tickets(source, settings.pipeline.max_value_bytes)
    taxonomy_path = Path(args.taxonomy) if args.taxonomy else None
    if args.model is not None:
        flagged = _out_of_scope(settings, str(source), tickets)
        tickets = [ticket for ticket in tickets if ticket[0] in flagged]
        if not tickets:
            raise UserError(
                f"taxonomy discover: {args.model} answers none of the tickets of {source} out of scope: "
                "nothing to discover (--all clusters every ticket)"
            )
        taxonomy_path = taxonomy_path or Path(args.model) / "taxonomy.toml"
    taxonomy = load_taxonomy(taxonomy_path) if taxonomy_path is not None else None
    redactor = settings.privacy.copy_redactor()
    texts = [ticket_text(event.subject, event.body) for _, _, event in tickets]
    embedder = encoder_stage.open_embedder(echo=_stderr)
    started = time.monotonic()
    vectors = encoder_stage.embed(embedder, texts, _progress("embedding"))
    _stderr(f"embedded {len(texts)} tickets in {time.monotonic() - started:.0f} s")
    redacted = [redactor.redact(text) for text in texts]
    found = discovery.discover(
        vectors,
        redacted,
        _known_centres(taxonomy, embedder),
        discovery.DiscoverySettings(seed=args.seed),
        _progress("estimating the number of intents"),
    )
    rows = [
        discovery_report.DiscoveredTicket(event.ticket_id, text, event.created_at)
        for (_, _, event), text in zip(tickets, redacted, strict=True)
    ]
    _write_discovery(out, rows, found, taxonomy, taxonomy_path, str(source))
    return 0


def _progress(what: str) -> discovery.Progress:
    """A progress line on stderr at most every 10 s (the K scan and the embedding take minutes)."""
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 10.0 or done == total:
            last[0] = now
            _stderr(f"{what}: {done}/{total}")

    return report


def _write_discovery(
    out: Path,
    rows: Sequence[discovery_report.DiscoveredTicket],
    found: discovery.Discovery,
    taxonomy: Taxonomy | None,
    taxonomy_path: Path | None,
    source: str,
) -> None:
    """The four outputs (worker/learning/discovery_report.py), the taxonomy checked before it is written."""
    if taxonomy is None or taxonomy_path is None:
        current = discovery_report.new_taxonomy_header("discovered", "unclassified", PRIORITIES)
        priority = "Medium"
    else:
        current = read_small_file(taxonomy_path, "a taxonomy").decode("utf-8")
        priority = taxonomy.fallback_priority
    if not found.intents:
        _stderr("no coherent group found: nothing proposed")
    text = discovery_report.proposed_taxonomy(current, found, priority, Path(source).name)
    errors, _ = check_taxonomy_text(text, "the proposed taxonomy")
    if errors:
        raise UserError(f"{errors[0]} (nothing written)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "taxonomy.toml").write_text(text, encoding="utf-8")
    discovery_report.write_assignments(out / "assignments.jsonl", rows, found)
    labelled = discovery_report.write_labelled(out / "labelled.csv", rows, found)
    (out / "groups.svg").write_text(discovery_report.size_chart_svg(found.intents), encoding="utf-8")
    (out / "report.md").write_text(discovery_report.report(rows, found, Path(source).name), encoding="utf-8")
    unassigned = int((found.assignment == discovery.UNASSIGNED).sum())
    print(
        f"wrote {out}: {len(found.intents)} proposed intents over {labelled} tickets ({unassigned} "
        f"unassigned); read {out / 'report.md'}, keep the proposals you accept in {out / 'taxonomy.toml'}, "
        f"then train on your labelled tickets plus {out / 'labelled.csv'} with --taxonomy "
        f"{out / 'taxonomy.toml'} (docs/your-taxonomy.md)"
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    taxonomy = subparsers.add_parser("taxonomy", help="write a taxonomy from your tickets, and check one")
    commands = taxonomy.add_subparsers(title="taxonomy commands", metavar="COMMAND", required=True)

    check = commands.add_parser(
        "check", help="every problem of a taxonomy file, one line each (exit 2 when it cannot load)"
    )
    check.add_argument("file", metavar="FILE", help="taxonomy TOML")
    check.set_defaults(handler=_check)

    init = commands.add_parser(
        "init", help="a taxonomy with every label of a CSV or JSON-lines export, for you to describe"
    )
    init.add_argument("--from-data", required=True, metavar="FILE", help="labelled tickets (CSV, JSON lines)")
    init.add_argument("--out", metavar="FILE", help="taxonomy to write (default: standard output)")
    init.add_argument("--name", help="the taxonomy's name (default: from the file name)")
    init.add_argument("--text-column", metavar="NAME", help="the tickets' text column")
    init.add_argument("--label-column", metavar="NAME", help="the labels' column")
    init.set_defaults(handler=_init)

    discover = commands.add_parser(
        "discover",
        help="group the tickets no intent covers into proposed intents (names, examples, training rows)",
    )
    discover.add_argument("--input", required=True, metavar="FILE", help="JSON lines of TicketEvent objects")
    which = discover.add_mutually_exclusive_group()
    which.add_argument("--model", metavar="DIR", help="classify with it; cluster those answered out of scope")
    which.add_argument("--all", action="store_true", help="cluster every ticket (no taxonomy yet: day 0)")
    discover.add_argument("--taxonomy", metavar="FILE", help="the current taxonomy (default: the model's)")
    discover.add_argument("--out", required=True, metavar="DIR", help="new folder for the outputs")
    discover.add_argument(
        "--seed", type=int, default=0, help="seed of the clustering (same seed, same result)"
    )
    add_config_argument(discover)
    discover.set_defaults(handler=_discover)
