"""The files in schemas/ are what the Structs say, and they validate real messages the way consumers would."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import msgspec
import pytest

from worker.cli.cli import main
from worker.cli.config_command import SCHEMA_DIR, drifted_schemas, schema_files
from worker.kafka import dead_letters
from worker.messages import SCHEMA_VERSION, SourcePosition, TriageResult


def test_schema_files_match_the_structs() -> None:
    drift = drifted_schemas(SCHEMA_DIR)
    assert not drift, "schemas/ drifted; run `triage-worker schemas --write`:\n" + "\n".join(drift.values())


def test_schemas_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schemas", "--check"]) == 0
    assert main(["schemas", "--write", "--dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(schema_files())
    assert main(["schemas", "--check", "--dir", str(tmp_path)]) == 0

    stale = tmp_path / "triage_result.schema.json"
    stale.write_text(stale.read_text().replace('"Critical"', '"Urgent"'))
    capsys.readouterr()
    assert main(["schemas", "--check", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{stale} is out of date with the code" in err
    assert re.search(r'^-\s+"Urgent"', err, flags=re.MULTILINE)
    assert re.search(r'^\+\s+"Critical"', err, flags=re.MULTILINE)
    assert "run `triage-worker schemas --write`" in err


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["--write", "--dir", "{file}"], "schemas --write: {file} is not a folder"),
        (
            ["--write", "--dir", "/proc/self"],
            "schemas --write: cannot write /proc/self/ticket_event.schema.json: No such file or directory",
        ),
        (["--check", "--dir", "{file}"], "schemas --check: {file} is not a folder"),
        (["--check", "--dir", "{missing}"], "schemas --check: {missing} does not exist"),
    ],
    ids=["write-to-a-file", "write-to-proc", "check-a-file", "check-a-missing-folder"],
)
def test_a_folder_that_cannot_hold_schemas_is_one_line(
    arguments: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    places = {"file": tmp_path / "a-file", "missing": tmp_path / "nowhere"}
    places["file"].write_text("not a folder\n")
    assert main(["schemas", *(argument.format(**places) for argument in arguments)]) == 2
    assert capsys.readouterr().err == f"triage-worker: error: {line.format(**places)}\n"


def test_a_check_against_an_empty_folder_names_the_missing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["schemas", "--check", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [*(f"{tmp_path / name} is missing" for name in schema_files()), err[-1]]


def test_schema_files_are_pretty_sorted_and_end_with_a_newline() -> None:
    for name in ("ticket_event.schema.json", "triage_result.schema.json"):
        text = (SCHEMA_DIR / name).read_text(encoding="utf-8")
        assert text.endswith("}\n")
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _schema(name: str) -> dict[str, object]:
    schema: dict[str, object] = json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _sample_result() -> dict[str, object]:
    result = TriageResult(
        schema_version=SCHEMA_VERSION,
        ticket_id="T-1",
        intent="lost_or_stolen_card",
        priority="Critical",
        confidence=0.91,
        fallback=False,
        fallback_reason=None,
        scores={"lost_or_stolen_card": 0.91, "card_not_working": 0.05},
        model="triage-mini",
        latency_ms=37.0,
        classified_at="2024-05-01T12:30:00.123Z",
        source=SourcePosition(topic="tickets.raw", partition=0, offset=42),
        truncated=False,
        pii=["card_number"],
    )
    document: dict[str, object] = msgspec.json.decode(msgspec.json.encode(result))
    return document


def test_a_real_triage_result_validates_against_its_schema() -> None:
    jsonschema.validate(_sample_result(), _schema("triage_result.schema.json"))


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("priority", "Urgent"),
        ("confidence", 1.2),
        ("fallback_reason", "timeout"),
        ("source", {"topic": "t"}),
        ("pii", ["passport"]),
    ],
)
def test_a_bad_triage_result_fails_its_schema(field: str, bad: object) -> None:
    document = _sample_result()
    document[field] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, _schema("triage_result.schema.json"))


def test_ticket_schema_requires_id_and_body_and_tolerates_unknown_fields() -> None:
    schema = _schema("ticket_event.schema.json")
    jsonschema.validate({"ticket_id": "T", "body": "", "created_at": "2024-05-01T12:30:00Z", "x": 1}, schema)
    for bad in (
        {"body": "b"},
        {"ticket_id": "", "body": "b"},
        {"ticket_id": "T", "body": "b", "created_at": "now"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_dead_letter_doc_lists_exactly_the_header_constants() -> None:
    text = (SCHEMA_DIR / "dead_letter.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(triage\.[a-z_.]+)` \|", text, flags=re.MULTILINE))
    constants = {
        dead_letters.ERROR_TYPE,
        dead_letters.ERROR_MESSAGE,
        dead_letters.SOURCE_TOPIC,
        dead_letters.SOURCE_PARTITION,
        dead_letters.SOURCE_OFFSET,
        dead_letters.FAILED_AT,
        dead_letters.REPLAY_COUNT,
    }
    assert constants == dead_letters.DEAD_LETTER_HEADERS
    assert documented == constants | {dead_letters.OMITTED_BYTES, dead_letters.REDACTED}
