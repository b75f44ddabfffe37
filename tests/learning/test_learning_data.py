"""Labelled tickets the way teams export them (worker/learning/data.py): what is used, what is counted out,
and one clear line for every file that cannot be used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import REPO
from worker.errors import UserError
from worker.inference.taxonomy import load_taxonomy
from worker.learning.data import intent_name, read_labelled, read_texts, read_ticket_rows

BANK_DESK = load_taxonomy(REPO / "taxonomies" / "bank-desk.toml")


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def test_a_csv_export_is_read_with_its_usual_column_names_and_bad_rows_are_counted_not_used(
    tmp_path: Path,
) -> None:
    csv_file = _write(
        tmp_path / "export.csv",
        "id,Body,Category\n"
        '1,"my card was stolen, please block it",card_security\n'
        "2,My card was stolen,  please block it,card_security\n"  # an unquoted comma: malformed
        "3,,top_up\n"
        '4,"where is my new card",card_delivery\n'
        '5,"Where is my  new card",top_up\n',
    )
    data = read_ticket_rows(csv_file)
    assert (data.text_column, data.label_column) == ("Body", "Category")
    assert data.rows == [
        ("my card was stolen, please block it", "card_security"),
        ("where is my new card", "card_delivery"),
    ]
    counts = data.counts
    assert (counts.read, counts.empty, counts.duplicate, counts.conflicting, counts.malformed) == (
        5,
        1,
        1,
        1,
        1,
    )
    assert (
        "5 rows, 2 used; skipped 1 empty text or label, 1 duplicate text (1 with another label), 1 malformed"
        in (data.summary())
    )


def test_rows_that_are_not_utf8_are_counted_and_left_out(tmp_path: Path) -> None:
    csv_file = _write(
        tmp_path / "latin1.csv", b"text,label\ncaf\xe9 card lost,card_security\nok text,top_up\n"
    )
    data = read_ticket_rows(csv_file)
    assert data.rows == [("ok text", "top_up")]
    assert data.counts.not_utf8 == 1
    assert "1 not UTF-8" in data.summary()


def test_json_lines_with_named_columns_and_garbage_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"title": "x", "msg": "I lost my card", "queue": "card_security"}),
        "not json at all",
        json.dumps(["a", "list"]),
        json.dumps({"msg": "how do I top up", "queue": "top_up"}),
    ]
    path = _write(tmp_path / "tickets.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"no text column .*columns: title, msg, queue.*--text-column"):
        read_ticket_rows(path)
    data = read_ticket_rows(path, text_column="msg", label_column="queue")
    assert data.rows == [("I lost my card", "card_security"), ("how do I top up", "top_up")]
    assert data.counts.malformed == 2 and data.counts.read == 4


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.csv", None, r"data file not found"),
        ("empty.csv", b"", r"empty file"),
        ("binary.csv", b"\x00\x01\x02PK\x03\x04" * 50, r"not a CSV file|no text column"),
        ("nolabel.csv", b"text,other\nhello,x\n", r"no label column .*--label-column"),
        ("allempty.csv", b"text,label\n,\n , \n", r"no usable row"),
        ("garbage.jsonl", b"{{{\n]]]\n", r"not JSON lines"),
    ],
)
def test_files_that_cannot_be_used_are_one_line_errors(
    tmp_path: Path, name: str, content: bytes | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=message) as raised:
        read_ticket_rows(path)
    assert "\n" not in str(raised.value)


def test_labels_that_are_not_intents_stop_it_naming_them_and_the_nearest_intents(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "export.csv",
        "text,label\nlost my card,card_securty\nwhere is my card,Card Delivery\nhello,billing_question\n",
    )
    with pytest.raises(UserError) as raised:
        read_labelled(path, BANK_DESK)
    message = str(raised.value)
    assert "2 label(s) are not intents of the taxonomy 'bank-desk'" in message
    assert "'card_securty' (nearest: card_security" in message
    assert "'billing_question'" in message
    assert "Card Delivery" not in message  # normalised to card_delivery, an intent
    assert "\n" not in message


def test_the_banking77_folder_layout_keeps_working() -> None:
    rows, data = read_labelled(
        REPO / "data" / "banking77", load_taxonomy(REPO / "taxonomies" / "banking77.toml")
    )
    assert data.source.name == "train.csv" and data.label_column == "category"
    assert len(rows) > 9000
    assert {intent for _, intent in rows} >= {"refund_not_showing_up", "reverted_card_payment"}


def test_intent_names_from_labels() -> None:
    assert intent_name("Card arrival") == "card_arrival"
    assert intent_name("reverted_card_payment?") == "reverted_card_payment"
    assert intent_name("Billing / Refunds") == "billing_/_refunds"


def test_unlabelled_tickets_from_a_text_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "raw.txt", b"one\n\ntwo\none\n\xff bad\n")
    assert read_texts(path) == ["one", "two"]


def test_a_json_array_export_and_a_utf16_spreadsheet_export(tmp_path: Path) -> None:
    array = _write(
        tmp_path / "tickets.json",
        json.dumps(
            [{"text": "card lost", "label": "card_security"}, "junk", {"text": "top up?", "label": "top_up"}]
        ),
    )
    data = read_ticket_rows(array)
    assert data.rows == [("card lost", "card_security"), ("top up?", "top_up")] and data.counts.malformed == 1
    utf16 = _write(tmp_path / "excel.csv", "text,label\ncafé card lost,card_security\n".encode("utf-16"))
    assert read_ticket_rows(utf16).rows == [("café card lost", "card_security")]
