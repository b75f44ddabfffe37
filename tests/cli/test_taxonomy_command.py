"""`triage-worker taxonomy init/check`: from a team's export to a taxonomy a person finishes, and every
problem of a taxonomy in one run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tools import REPO
from worker.cli.cli import main
from worker.inference.taxonomy import load_taxonomy
from worker.learning.data import match_taxonomy, read_ticket_rows

BROKEN = """
name = "desk"
priorities = ["Low", "Medium", "High"]

[[intents]]
name = "card lost"
description = "a lost card"
priority = "Critical"

[[intents]]
name = "refunds"
priority = "Low"

[[intents]]
name = "refunds"
description = "refunds"
priority = "Low"
colour = "red"

[[intents]]
name = "top_up"
description = ""
priority = "Medium"
examples = ["how do I add money", ""]
"""


def test_check_reports_every_problem_one_line_each_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "desk.toml"
    path.write_text(BROKEN)
    assert main(["taxonomy", "check", str(path)]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"error: {path}: intents[0] (card lost): name 'card lost' must be letters, digits or _.:/- "
        "(no spaces or quotes)",
        f"error: {path}: intents[0] (card lost): priority 'Critical' is not one of Low, Medium, High",
        f"error: {path}: intents[1] (refunds): no `description` (one line saying what its tickets are about)",
        f"error: {path}: intents[2] (refunds): unknown key(s) colour (name, description, priority, examples)",
        f"error: {path}: intents[2] (refunds): the name is listed twice (first as intents[1])",
        f"error: {path}: intents[3] (top_up): `examples` must be a list of non-empty one-line phrases",
        f"warning: {path}: intents[3] (top_up): empty description "
        "(zero-shot training learns the intent from it)",
    ]


def test_check_passes_the_shipped_taxonomies(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("banking77", "default", "bank-desk"):
        assert main(["taxonomy", "check", str(REPO / "taxonomies" / f"{name}.toml")]) == 0
    out = capsys.readouterr().out
    assert "bank-desk.toml: ok, 12 intents (Low 3, Medium 5, High 3, Critical 1), 36 example phrases" in out


def test_check_of_a_file_that_is_not_toml_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.toml"
    path.write_text("name = \n[[intents]\n")
    assert main(["taxonomy", "check", str(path)]) == 2
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"error: {path}: not valid TOML")


def test_init_lists_every_label_with_its_count_and_the_result_checks_and_matches_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "helpdesk-export.csv"
    export.write_text(
        "subject,team\n"
        "where is my card,Card Delivery\n"
        "card still not here,Card Delivery\n"
        "money missing,Refunds?\n"
        "password reset,unclassified\n"
        ",Refunds?\n"
    )
    out = tmp_path / "mine.toml"
    assert (
        main(["taxonomy", "init", "--from-data", str(export), "--label-column", "team", "--out", str(out)])
        == 0
    )
    text = out.read_text()
    assert '# 2 tickets (label "Card Delivery")\nname = "card_delivery"' in text
    assert '# 1 tickets (label "Refunds?")\nname = "refunds"' in text
    assert "skipped 1 empty text or label" in text
    taxonomy = load_taxonomy(out)
    assert taxonomy.labels == ("card_delivery", "refunds", "unclassified")
    assert taxonomy.fallback_intent == "unclassified_"  # the data has a label of that name
    # The training data's labels are the new taxonomy's intents.
    rows = match_taxonomy(read_ticket_rows(export, label_column="team"), taxonomy)
    assert rows[0] == ("where is my card", "card_delivery")
    capsys.readouterr()
    assert main(["taxonomy", "check", str(out)]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3 and all("still the placeholder" in line for line in warnings)
    # It never overwrites a file.
    assert (
        main(["taxonomy", "init", "--from-data", str(export), "--label-column", "team", "--out", str(out)])
        == 2
    )


def test_init_skips_json_null_labels_and_texts_counting_them_never_an_intent_null(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "export.jsonl"
    rows = [("where is my card", "card_delivery"), ("refund please", None), (None, "card_delivery")]
    export.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in rows))
    out = tmp_path / "desk.toml"
    assert main(["taxonomy", "init", "--from-data", str(export), "--out", str(out)]) == 0
    taxonomy = load_taxonomy(out)
    assert taxonomy.labels == ("card_delivery",)
    assert "3 rows, 1 used; skipped 2 empty text or label" in out.read_text()


def test_init_reads_an_export_with_a_field_over_128_kib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The csv module's default limit (131,072 characters) failed the whole export on one long ticket."""
    export = tmp_path / "export.csv"
    with export.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerows(
            [("text", "label"), ("log pasted: " + "x" * 200_000, "bug_report"), ("hi", "greeting")]
        )
    out = tmp_path / "desk.toml"
    assert main(["taxonomy", "init", "--from-data", str(export), "--out", str(out)]) == 0
    assert load_taxonomy(out).labels == ("bug_report", "greeting")
    assert csv.field_size_limit() == 131_072  # the process's limit is as it was


def test_init_refuses_what_check_would_refuse_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10,000 labels (a column of ids or free text) made a 1.5 MiB taxonomy that `taxonomy check` and
    `model train` refuse; a blank --name one whose name check refuses."""
    export = tmp_path / "export.csv"
    with export.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(("text", "label"))
        writer.writerows((f"ticket {n}", f"case {n}") for n in range(10_000))
    out = tmp_path / "desk.toml"
    capsys.readouterr()
    assert main(["taxonomy", "init", "--from-data", str(export), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"triage-worker: error: {export}: 10000 labels in column 'label' would make a taxonomy of 1.5 MiB, "
        "over the 1 MiB `taxonomy check` and `model train` read: is it the label column (--label-column "
        "NAME)? Labels that many need merging into intents first"
    )
    assert not out.exists()
    small = tmp_path / "small.csv"
    small.write_text("text,label\nhello,greeting\n")
    assert main(["taxonomy", "init", "--from-data", str(small), "--name", "  ", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"triage-worker: error: the taxonomy from {small}: `name` must not be empty (nothing written)"
    )
    assert not out.exists()
