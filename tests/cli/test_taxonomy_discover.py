"""`triage-worker taxonomy discover` end to end, without a broker: from a JSON-lines file of tickets to the
folder a team reads and trains from (the shipped encoder embeds; `--model` classifies with the shipped
BANKING77 encoder stage, as `classify` does)."""

from __future__ import annotations

import csv
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from encoder_stages import banking77_rows

from worker.cli.cli import main
from worker.inference.taxonomy import load_taxonomy
from worker.learning.data import match_taxonomy, read_ticket_rows

STAGE = Path(__file__).resolve().parents[2] / "models" / "triage-encoder"
DAY0_INTENTS = ("card_arrival", "exchange_rate", "lost_or_stolen_phone", "cash_withdrawal_charge")
EMAIL = "jane.doe@example.com"
# Tickets of a help desk the BANKING77 stage was never trained for: what it should answer none of these.
IT_DESK = {
    "printer": [
        "the printer on the third floor keeps jamming",
        "printer jammed again with paper stuck inside",
        "the office printer is out of toner",
        "I cannot print to the second floor printer",
        "the printer prints blank pages",
    ],
    "vpn": [
        "my laptop will not connect to the office vpn",
        "the vpn keeps disconnecting when I work from home",
        "I cannot reach the vpn since this morning",
        "vpn client says authentication failed",
        "the office vpn is very slow today",
    ],
}


def _write(path: Path, tickets: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tickets), encoding="utf-8")
    return path


def _day0_tickets() -> tuple[list[dict[str, str]], dict[str, str]]:
    """30 BANKING77 test tickets of each of `DAY0_INTENTS`, over five days; every tenth carries an e-mail
    address. Also each ticket's true intent by id."""
    rows = [row for row in banking77_rows("test") if row[1] in DAY0_INTENTS]
    by_intent: dict[str, list[str]] = {}
    for text, intent in rows:
        by_intent.setdefault(intent, []).append(text)
    tickets, truth = [], {}
    for intent, texts in by_intent.items():
        for j, text in enumerate(texts[:30]):
            ticket_id = f"{intent}-{j}"
            body = f"{text} Reply to {EMAIL}" if j % 10 == 0 else text
            tickets.append(
                {"ticket_id": ticket_id, "body": body, "created_at": f"2026-12-0{1 + j % 5}T09:00:00Z"}
            )
            truth[ticket_id] = intent
    random.Random(1).shuffle(tickets)
    return tickets, truth


def test_day_0_proposes_the_intents_with_names_rows_and_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tickets, truth = _day0_tickets()
    source = _write(tmp_path / "tickets.jsonl", tickets)
    out = tmp_path / "proposals"
    assert main(["taxonomy", "discover", "--input", str(source), "--all", "--out", str(out)]) == 0
    assert "4 proposed intents" in capsys.readouterr().out
    assert main(["taxonomy", "check", str(out / "taxonomy.toml")]) == 0
    taxonomy = load_taxonomy(out / "taxonomy.toml")
    assert len(taxonomy.labels) == 4 and len(set(taxonomy.labels)) == 4
    assert (out / "taxonomy.toml").read_text(encoding="utf-8").count("# proposed by") == 4
    assignments = [json.loads(line) for line in (out / "assignments.jsonl").read_text().splitlines()]
    assert sorted(a["ticket_id"] for a in assignments) == sorted(truth)
    for label in taxonomy.labels:  # each proposal is one true intent's tickets
        members = Counter(truth[a["ticket_id"]] for a in assignments if a["proposed_intent"] == label)
        assert members.most_common(1)[0][1] >= 0.9 * sum(members.values())
    data = read_ticket_rows(out / "labelled.csv")
    assert len(data.rows) >= 100
    match_taxonomy(data, taxonomy)  # the rows `model train --data` reads, labelled with the proposals
    report = (out / "report.md").read_text(encoding="utf-8")
    assert report.splitlines()[2] == "![proposed intents by tickets](groups.svg)"
    assert "<svg" in (out / "groups.svg").read_text(encoding="utf-8")
    assert "| 2026-12-01 |" in report  # growth by day
    everything = "".join(p.read_text(encoding="utf-8") for p in out.iterdir())
    assert EMAIL not in everything and "[email]" in everything


def test_with_a_model_only_the_tickets_it_answers_none_of_these_are_grouped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(3)
    tickets = [
        {
            "ticket_id": f"{topic}-{i}",
            "body": rng.choice(texts) + rng.choice(["", " please", ", help", " again"]),
        }
        for topic, texts in IT_DESK.items()
        for i in range(12)
    ]
    tickets += [
        {"ticket_id": f"bank-{i}", "body": text} for i, (text, _) in enumerate(banking77_rows("test")[::77])
    ]
    source = _write(tmp_path / "tickets.jsonl", tickets)
    out = tmp_path / "proposals"
    assert (
        main(["taxonomy", "discover", "--input", str(source), "--model", str(STAGE), "--out", str(out)]) == 0
    )
    assert main(["taxonomy", "check", str(out / "taxonomy.toml")]) == 0
    current = load_taxonomy(STAGE / "taxonomy.toml")
    proposed = load_taxonomy(out / "taxonomy.toml")
    new = [label for label in proposed.labels if label not in current.labels]
    assert proposed.labels[: len(current.labels)] == current.labels and new
    assignments = [json.loads(line) for line in (out / "assignments.jsonl").read_text().splitlines()]
    grouped = {a["ticket_id"]: a["proposed_intent"] for a in assignments}
    assert sum(1 for ticket_id in grouped if ticket_id.startswith("bank-")) <= 4  # in scope: not grouped
    printers = {grouped.get(f"printer-{i}") for i in range(12)}
    assert len(printers) == 1 and printers <= set(new)
    assert "answered none of these" in capsys.readouterr().err


def test_refusals_say_why_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert (
        main(["taxonomy", "discover", "--input", str(tmp_path / "missing.jsonl"), "--all", "--out", str(out)])
        == 2
    )
    assert "is not a file" in capsys.readouterr().err
    empty = _write(tmp_path / "empty.jsonl", [])
    assert main(["taxonomy", "discover", "--input", str(empty), "--all", "--out", str(out)]) == 2
    assert "holds no ticket" in capsys.readouterr().err
    source = _write(tmp_path / "t.jsonl", [{"ticket_id": "1", "body": "my card has not arrived"}])
    assert main(["taxonomy", "discover", "--input", str(source), "--out", str(out)]) == 2
    assert "either --model DIR" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine", encoding="utf-8")
    assert (
        main(["taxonomy", "discover", "--input", str(source), "--all", "--out", str(tmp_path / "full")]) == 2
    )
    assert "not an empty folder" in capsys.readouterr().err
    assert not out.exists()


def test_a_model_that_finds_every_ticket_in_scope_leaves_nothing_to_discover(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tickets = [{"ticket_id": str(i), "body": text} for i, (text, _) in enumerate(banking77_rows("test")[:6])]
    source = _write(tmp_path / "tickets.jsonl", tickets)
    out = tmp_path / "out"
    assert (
        main(["taxonomy", "discover", "--input", str(source), "--model", str(STAGE), "--out", str(out)]) == 2
    )
    assert "nothing to discover" in capsys.readouterr().err
    assert not out.exists()


def test_labelled_rows_are_csv_a_spreadsheet_reads_back(tmp_path: Path) -> None:
    tickets, _ = _day0_tickets()
    tickets[0]["body"] = 'my card, "the new one", has not arrived\nwhere is it?'
    source = _write(tmp_path / "tickets.jsonl", tickets)
    out = tmp_path / "proposals"
    assert main(["taxonomy", "discover", "--input", str(source), "--all", "--out", str(out)]) == 0
    with (out / "labelled.csv").open(encoding="utf-8", newline="") as handle:
        texts = [row["text"] for row in csv.DictReader(handle)]
    assert any(text.startswith('my card, "the new one"') and "\n" in text for text in texts)
