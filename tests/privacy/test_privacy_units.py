"""Personal data in tickets (issue #33), pure logic: what the detector finds and leaves, what each copy the
worker makes keeps of it. End to end against the broker: tests/privacy/test_privacy_e2e.py."""

from __future__ import annotations

import csv
import io
import json
import re

import msgspec
import pytest
import structlog

from tools import REPO
from tools.pii_corpus import corpus
from worker.cli.cli import main
from worker.learning.feedback import FeedbackBook
from worker.logs import configure_logging
from worker.messages import FeedbackEvent
from worker.privacy.detector import find, luhn_valid
from worker.privacy.redaction import Redactor
from worker.settings import LogSettings, PrivacySettings, load_settings


def _digits(text: str) -> str:
    return re.sub(r"\D", "", text)


@pytest.mark.parametrize("seed", [33, 34])
def test_every_identifier_of_the_corpus_is_redacted_and_every_near_miss_stays(seed: int) -> None:
    redactor = Redactor()
    for ticket in corpus(400, seed):
        scan = redactor.scan(ticket.subject, ticket.body)
        copied = f"{scan.subject or ''}\n{scan.body}"
        assert [i for i in ticket.identifiers if i in copied] == [], ticket
        assert [m for m in ticket.near_misses if m not in copied] == [], ticket
        assert list(scan.kinds) == ticket.kinds, ticket


def test_a_card_keeps_only_its_last_four_digits_whatever_its_format() -> None:
    redactor = Redactor()
    for written in ("4111 1111 1111 1111", "4111-1111-1111-1111", "4111111111111111", "3782 822463 10005"):
        redacted = redactor.redact(f"card {written}, thanks")
        last_four = _digits(written)[-4:]
        assert redacted == f"card [card ••••{last_four}], thanks"


def test_near_misses_stay_as_they_are() -> None:
    order = "4111111111111112"  # a Visa prefix, but fails Luhn
    assert not luhn_valid(order)
    texts = [
        f"order {order}",
        "IBAN DE00 3704 0044 0532 0130 00 (wrong check digits)",
        "ssn 000-12-3456, 666-12-3456, 901-12-3456, 123-00-4567, 123-45-0000",
        "Invoice INV-2024-015547 of 2024-05-01 for $1,250.00 at 10:30",
        "parcel 1Z999AA10123456784, JD014600006281234567GB",
        "my account number is 12345678, sort code 20-00-00",
        "it costs 1 500,00 EUR on 12.03.2025",
    ]
    for text in texts:
        assert find(text) == [], text


def test_each_kind_is_found_in_the_formats_people_write() -> None:
    cases = {
        "card_number": ["5555 5555 5555 4444", "3530-1113-3330-0000", "6011000990139424", "36227206271667"],
        "iban": ["GB82 WEST 1234 5698 7654 32", "fr1420041010050500013m02606", "NO9386011117947"],
        "email": ["jane.doe+tag@example.co.uk", "JOSÉ@correo.example.es", "a_b-c@sub.example-x.org"],
        "phone": ["+44 20 7946 0958", "(201) 555-0123", "+49 151 23456789", "+91-9876543210", "201.555.0123"],
        "us_ssn": ["123-45-6789", "123 45 6789"],
    }
    for kind, writings in cases.items():
        for written in writings:
            assert [f.kind for f in find(f"see {written} please")] == [kind], written


# Between digit groups: no-break, narrow no-break and thin spaces (HTML mail pastes them), a tab, a line break
# (LF or CR LF), an en dash, a dot.
PASTED_SEPARATORS = ["\u00a0", "\u202f", "\u2009", "\t", "\n", "\r\n", "\u2013", "."]


@pytest.mark.parametrize("separator", PASTED_SEPARATORS)
def test_cards_and_ibans_are_found_whatever_separates_their_groups(separator: str) -> None:
    """Issue #43, item 8: the detector took only a space or a dash between groups."""
    card = separator.join(["4111", "1111", "1111", "1111"])
    iban = separator.join(["GB82", "WEST", "1234", "5698", "7654", "32"])
    redacted = Redactor().redact(f"card {card}, refund to {iban}, thanks")
    assert redacted == "card [card ••••1111], refund to [iban], thanks"


def test_numbers_grouped_by_dots_or_lines_that_are_no_card_stay() -> None:
    texts = [
        "order 4111.1111.1111.1112 (fails Luhn)",
        "build 10.0.19045.2006, host 192.168.100.200, on 12.03.2025, 1.234.567,89 EUR",
        "lines:\n4000\n1234\n5678\n9012\n",
        "IBAN DE00\u00a03704\u00a00044\u00a00532\u00a00130\u00a000 (wrong check digits)",
    ]
    for text in texts:
        assert find(text) == [], text


def test_internationalised_mail_domains_are_redacted_whole() -> None:
    """Issue #43, item 8: a Punycode top-level domain was cut at its `xn`, leaving `[email]--fiqs8s`."""
    redactor = Redactor()
    addresses = ("john@xn--fsq.xn--fiqs8s", "jo@XN--BCHER-KVA.example", "用户@例子.广告", "jo@bücher.example")
    for address in addresses:
        assert redactor.redact(f"write to {address}, thanks") == "write to [email], thanks", address


def test_a_card_right_after_an_iban_is_found_too() -> None:
    redacted = Redactor().redact("DE89 3704 0044 0532 0130 00 4111 1111 1111 1111")
    assert redacted == "[iban] [card ••••1111]"


def test_kinds_to_keep_are_listed_but_left_in_clear_and_kinds_not_detected_are_neither() -> None:
    text = "mail jane@example.com, card 4111 1111 1111 1111"
    kept = Redactor(keep=["email"]).scan(None, text)
    assert (kept.kinds, kept.body) == (
        ("email", "card_number"),
        "mail jane@example.com, card [card ••••1111]",
    )
    cards_only = Redactor(detect=["card_number"]).scan(None, text)
    assert (cards_only.kinds, cards_only.body) == (
        ("card_number",),
        "mail jane@example.com, card [card ••••1111]",
    )
    assert Redactor(detect=[]).scan("s", text).body == text


def test_settings_name_the_kinds_from_the_environment_comma_separated() -> None:
    settings = load_settings(
        env={"TRIAGE_PRIVACY__KEEP": "email, phone", "TRIAGE_DEAD_LETTER__REDACT": "true"}
    )
    assert (settings.privacy.keep, settings.dead_letter.redact) == (["email", "phone"], True)
    assert settings.privacy.redactor().redact("mail a@b.example or 4111111111111111") == (
        "mail a@b.example or [card ••••1111]"
    )


def test_no_false_positive_on_banking77_tickets() -> None:
    """The figure docs/privacy.md reports: BANKING77's test and train texts (13,083 tickets) have no
    identifier in them, and the detector finds none."""
    redactor = Redactor()
    found = []
    for name in ("test.csv", "train.csv"):
        with (REPO / "data" / "banking77" / name).open(encoding="utf-8", newline="") as handle:
            for row in csv.DictReader(handle):
                if redactor.scan(None, row["text"]).kinds:
                    found.append(row["text"])
    assert found == []


def test_the_log_never_holds_an_identifier_at_any_level_tracebacks_included() -> None:
    stream = io.StringIO()
    configure_logging(LogSettings(level="debug", format="json"), PrivacySettings(), stream)
    try:
        log = structlog.get_logger("test")
        log.debug("ticket_seen", text="call +44 20 7946 0958", nested={"cards": ["4111 1111 1111 1111"]})
        try:
            raise ValueError("bad ticket: IBAN GB82 WEST 1234 5698 7654 32, ssn 123-45-6789")
        except ValueError:
            log.exception("record_failed", offset=12345678901)
    finally:
        configure_logging(LogSettings(), PrivacySettings())
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    written = stream.getvalue()
    for identifier in ("7946 0958", "4111 1111 1111 1111", "GB82 WEST", "5698 7654 32", "123-45-6789"):
        assert identifier not in written
    assert lines[0]["text"] == "call [phone]" and lines[0]["nested"] == {"cards": ["[card ••••1111]"]}
    assert "bad ticket: IBAN [iban], ssn [ssn]" in lines[1]["exception"]
    assert lines[1]["offset"] == 12345678901  # numbers are not text: left alone


def test_the_log_finds_phone_numbers_of_the_configured_region_and_keeps_no_kind_in_clear() -> None:
    """Issue #43, items 6 and 8: the log was redacted with a fixed US region, whatever `privacy.phone_region`
    said; `privacy.keep` (the review topic's) and `privacy.detect` do not apply to it."""
    stream = io.StringIO()
    privacy = PrivacySettings(phone_region="GB", detect=["card_number"], keep=["email"])
    configure_logging(LogSettings(format="json"), privacy, stream)
    try:
        structlog.get_logger("test").info("ticket_seen", text="call 020 7946 0958 or mail jane@example.com")
    finally:
        configure_logging(LogSettings(), PrivacySettings())
    assert json.loads(stream.getvalue())["text"] == "call [phone] or mail [email]"


def test_training_corrections_and_rejection_messages_are_redacted() -> None:
    book = FeedbackBook(["card_arrival"])
    verdict = FeedbackEvent(
        ticket_id="T-1",
        intent="card_arrival",
        text="my card 4111 1111 1111 1111 has not arrived, mail jane@example.com",
        reviewer="r",
        reviewed_at="2026-11-02T10:00:00Z",
    )
    assert book.add(msgspec.json.encode(verdict), "line 1") is None
    unknown = msgspec.structs.replace(verdict, ticket_id="jane@example.com", intent="nope")
    rejection = book.add(msgspec.json.encode(unknown), "line 2")
    assert rejection is not None and "jane@example.com" not in rejection.message
    (correction,) = book.corrections()
    assert correction.text == "my card [card ••••1111] has not arrived, mail [email]"


def test_a_command_s_error_quotes_no_identifier(capsys: pytest.CaptureFixture[str]) -> None:
    """Errors quote what they were given (here a setting's value; elsewhere a ticket's text or a record's
    value): the CLI prints them with personal data redacted."""
    assert main(["config", "show", "--set", "review.threshold=call 201-555-0123 or a@b.example"]) == 2
    error = capsys.readouterr().err
    assert error == (
        'triage-worker: error: config error: review.threshold: expected float | null, got "call [phone] or '
        '[email]" (from command line)\n'
    )
