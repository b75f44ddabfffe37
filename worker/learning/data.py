"""Labelled tickets the way teams have them: a CSV or JSON-lines export, one ticket per row.

`read_ticket_rows` reads a file (`.csv`, `.tsv`; `.jsonl`, `.ndjson`, `.json` as JSON lines) or a BANKING77
folder (its `train.csv`), finding the text and label columns by their usual names unless told. Rows that
cannot be used are counted, never silently used: empty (or JSON `null`) text or label, a text seen before (and
whether with another label), bytes that are not UTF-8, CSV rows whose fields do not match the header, JSON
lines that are not an object. A field of any length is read (the file is at most `MAX_FILE_BYTES`).
`match_taxonomy` turns the labels into the taxonomy's intents (exactly, or after `intent_name`'s
normalisation: "Card arrival" is `card_arrival`) and stops with one line naming the labels that are not
intents and the nearest ones. Every problem with the file itself is a `UserError` (one line, exit 2).
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import io
import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from worker.errors import UserError
from worker.inference.taxonomy import Taxonomy

# Column names tried in order when none is given (BANKING77 calls its label `category`).
TEXT_COLUMNS = ("text", "body", "ticket", "message", "description", "subject")
LABEL_COLUMNS = ("label", "intent", "category", "class", "topic")
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")
# The export of a whole help desk fits; a file this large is a mistake (a database dump, a binary).
MAX_FILE_BYTES = 1 << 30
# Undecodable bytes become lone surrogates (surrogateescape): a row holding one was not UTF-8.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


@dataclasses.dataclass(frozen=True)
class RowCounts:
    """How many rows the file had, and how many of them were left out, by reason."""

    read: int = 0
    empty: int = 0
    duplicate: int = 0  # the same text again (conflicting ones included)
    conflicting: int = 0  # ... of which with another label than the first time
    not_utf8: int = 0
    malformed: int = 0  # a CSV row with more or fewer fields than the header, a JSON line that is no object

    @property
    def skipped(self) -> int:
        return self.empty + self.duplicate + self.not_utf8 + self.malformed


@dataclasses.dataclass(frozen=True)
class TicketRows:
    """The usable (text, label) rows of `source`, in file order, and the counts of what was left out."""

    source: Path
    text_column: str
    label_column: str
    rows: list[tuple[str, str]]
    counts: RowCounts

    def label_counts(self) -> Counter[str]:
        return Counter(label for _, label in self.rows)

    def summary(self) -> str:
        """One line: rows read, used, and each reason rows were skipped for (only those that happened)."""
        c = self.counts
        reasons = [
            (c.empty, "empty text or label"),
            (
                c.duplicate,
                "duplicate text" + (f" ({c.conflicting} with another label)" if c.conflicting else ""),
            ),
            (c.not_utf8, "not UTF-8"),
            (c.malformed, "malformed (fields not matching the header, or not a JSON object)"),
        ]
        skipped = ", ".join(f"{count} {why}" for count, why in reasons if count)
        return (
            f"{self.source}: {c.read} rows, {len(self.rows)} used"
            + (f"; skipped {skipped}" if skipped else "")
            + f" (text column {self.text_column!r}, label column {self.label_column!r})"
        )


def intent_name(label: str) -> str:
    """A label as a valid intent name: lower case, runs of spaces and punctuation other than _.:/- as one
    `_`, trailing `?` and leading or trailing _.:/- dropped (BANKING77's `Refund_not_showing_up` is
    `refund_not_showing_up`)."""
    name = re.sub(r"[^a-z0-9_.:/-]+", "_", label.strip().lower().rstrip("?")).strip("_.:/-")
    return name or "unnamed"


def read_ticket_rows(
    path: Path, text_column: str | None = None, label_column: str | None = None
) -> TicketRows:
    """Usable rows of a CSV or JSON-lines file, or of a BANKING77 folder's train.csv (see the module)."""
    if path.is_dir():
        if not (path / "train.csv").is_file():
            raise UserError(f"{path} is a folder without train.csv: give a CSV or JSON-lines file")
        path = path / "train.csv"
    records, malformed = _records(path, _decoded(_read_bytes(path)))
    return _usable(path, records, malformed, text_column, label_column)


def _decoded(data: bytes) -> str:
    """UTF-16 when a byte-order mark says so (spreadsheet exports), else UTF-8 with any BOM dropped; bytes
    that are not UTF-8 stay as lone surrogates, so that their rows can be counted out."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", errors="surrogatepass")
    return data.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")


def _records(path: Path, text: str) -> tuple[list[dict[str, str]], int]:
    """The file's rows as column → value, and how many rows were malformed: JSON (one array of objects, or
    one object a line) by the file's suffix, else CSV."""
    if path.suffix.lower() not in JSON_LINES_SUFFIXES:
        return _csv_rows(path, text)
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: not valid JSON ({error})") from None
        return _json_objects(values)
    return _json_lines(path, text)


def _read_bytes(path: Path) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise UserError(f"{path}: {size / 2**20:.0f} MiB is larger than a ticket export can be (1 GiB)")
        return path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"data file not found: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a folder: give a CSV or JSON-lines file") from None
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None


def _csv_rows(path: Path, text: str) -> tuple[list[dict[str, str]], int]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    rows: list[dict[str, str]] = []
    malformed = 0
    # The csv module refuses a field over 128 KiB (one long ticket, a pasted log) and with it the whole
    # file; no field can be longer than the file, whose size is already bounded (`MAX_FILE_BYTES`).
    limit = csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
        for row in reader:
            # More fields than the header names (an unquoted comma) or fewer: its columns cannot be trusted.
            if None in row or None in row.values():
                malformed += 1
            else:
                rows.append(row)
    except csv.Error as error:
        raise UserError(f"{path}: not a CSV file ({error})") from None
    finally:
        csv.field_size_limit(limit)
    if reader.fieldnames is None:
        raise UserError(f"{path}: empty file (a CSV export starts with a header row naming its columns)")
    return rows, malformed


def _json_objects(values: list[object]) -> tuple[list[dict[str, str]], int]:
    """Objects' values as text: a string as it is, `null` as empty (a row without that value, counted as
    such, never a label "null"), any other value as its JSON (a numeric label id: "3")."""
    rows = [
        {str(k): v if isinstance(v, str) else "" if v is None else json.dumps(v) for k, v in value.items()}
        for value in values
        if isinstance(value, dict)
    ]
    return rows, len(values) - len(rows)


def _json_lines(path: Path, text: str) -> tuple[list[dict[str, str]], int]:
    values: list[object] = []
    unreadable = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError:
            unreadable += 1
    rows, not_objects = _json_objects(values)
    malformed = unreadable + not_objects
    if not rows and malformed:
        raise UserError(f"{path}: not JSON lines (no line is a JSON object; a CSV export needs a .csv name)")
    return rows, malformed


def _pick(path: Path, columns: Sequence[str], given: str | None, candidates: Sequence[str], what: str) -> str:
    if given is not None:
        if given not in columns:
            raise UserError(f"{path}: no column {given!r} (columns: {', '.join(columns) or 'none'})")
        return given
    lowered = {column.lower(): column for column in columns}
    for candidate in candidates:
        if candidate in lowered:
            return lowered[candidate]
    option = "--text-column" if what == "text" else "--label-column"
    raise UserError(
        f"{path}: no {what} column (looked for {', '.join(candidates)}; columns: "
        f"{', '.join(columns) or 'none'}): name it with {option}"
    )


def _usable(
    path: Path,
    records: list[dict[str, str]],
    malformed: int,
    text_column: str | None,
    label_column: str | None,
) -> TicketRows:
    columns = list(dict.fromkeys(key for record in records[:1000] for key in record))
    text_key = _pick(path, columns, text_column, TEXT_COLUMNS, "text")
    label_key = _pick(path, columns, label_column, LABEL_COLUMNS, "label")
    empty = duplicate = conflicting = not_utf8 = 0
    first_label: dict[str, str] = {}
    rows: list[tuple[str, str]] = []
    for record in records:
        text, label = record.get(text_key, "").strip(), record.get(label_key, "").strip()
        if _NOT_UTF8.search(text) or _NOT_UTF8.search(label):
            not_utf8 += 1
        elif not text or not label:
            empty += 1
        elif " ".join(text.lower().split()) in first_label:
            duplicate += 1
            conflicting += first_label[" ".join(text.lower().split())] != label
        else:
            first_label[" ".join(text.lower().split())] = label
            rows.append((text, label))
    counts = RowCounts(
        read=len(records) + malformed,
        empty=empty,
        duplicate=duplicate,
        conflicting=conflicting,
        not_utf8=not_utf8,
        malformed=malformed,
    )
    if not rows:
        raise UserError(f"{path}: no usable row ({counts.read} read, all skipped)")
    return TicketRows(path, text_key, label_key, rows, counts)


def match_taxonomy(data: TicketRows, taxonomy: Taxonomy) -> list[tuple[str, str]]:
    """`data`'s rows with their labels as the taxonomy's intent names; a UserError naming every label that
    is not an intent (with the nearest intents) when there is any."""
    intents = set(taxonomy.labels)
    mapping: dict[str, str] = {}
    unknown: list[str] = []
    for label in data.label_counts():
        name = label if label in intents else intent_name(label)
        if name in intents:
            mapping[label] = name
        else:
            unknown.append(label)
    if unknown:
        raise UserError(
            f"{data.source}: {len(unknown)} label(s) are not intents of the taxonomy {taxonomy.name!r}: "
            + "; ".join(_with_nearest(label, taxonomy.labels) for label in sorted(unknown)[:10])
            + (f"; and {len(unknown) - 10} more" if len(unknown) > 10 else "")
            + " (add them to the taxonomy, `triage-worker taxonomy init --from-data` lists every label, "
            "or correct the rows)"
        )
    return [(text, mapping[label]) for text, label in data.rows]


def _with_nearest(label: str, intents: Sequence[str]) -> str:
    nearest = difflib.get_close_matches(intent_name(label), intents, n=3, cutoff=0.5)
    return f"{label!r} (nearest: {', '.join(nearest)})" if nearest else f"{label!r} (no intent near it)"


def read_labelled(
    path: Path, taxonomy: Taxonomy, text_column: str | None = None, label_column: str | None = None
) -> tuple[list[tuple[str, str]], TicketRows]:
    """(text, intent) rows of `path` for `taxonomy`, and what was read (for its summary line)."""
    data = read_ticket_rows(path, text_column, label_column)
    return match_taxonomy(data, taxonomy), data


def read_texts(path: Path, text_column: str | None = None) -> list[str]:
    """Unlabelled tickets: a text file (one ticket a line), or the text column of a CSV / JSON-lines file;
    empty, duplicate and non-UTF-8 lines are left out."""
    if path.suffix.lower() in (".txt", ""):
        lines = (line.strip() for line in _decoded(_read_bytes(path)).splitlines())
        return list(dict.fromkeys(line for line in lines if line and not _NOT_UTF8.search(line)))
    records, _ = _records(path, _decoded(_read_bytes(path)))
    columns = list(dict.fromkeys(key for record in records[:1000] for key in record))
    key = _pick(path, columns, text_column, TEXT_COLUMNS, "text")
    texts = (record.get(key, "").strip() for record in records)
    return list(dict.fromkeys(text for text in texts if text and not _NOT_UTF8.search(text)))


def iter_label_counts(data: TicketRows) -> Iterator[tuple[str, int]]:
    """Labels by descending count, then name."""
    yield from sorted(data.label_counts().items(), key=lambda item: (-item[1], item[0]))
