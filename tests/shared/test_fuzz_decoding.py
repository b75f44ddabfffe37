"""Property tests (hypothesis) of everything a record's bytes and headers reach before the model.

Any bytes decode to a TicketEvent or raise DecodeError, nothing else; valid tickets round-trip; the error
type and the field it names follow from how the input was broken; every DecodeError makes a dead letter
that reads back. `make fuzz` (python -m tools.fuzz) runs a million such inputs; these run a few hundred each,
derandomized (the same examples on every run, no example database) so CI never flakes.
"""

from __future__ import annotations

import datetime
import json
import typing
from typing import Any

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from worker.decoding import (
    MAX_MESSAGE_CHARS,
    MAX_NESTING_DEPTH,
    DecodeError,
    DecodeErrorType,
    decode_ticket,
)
from worker.kafka.dead_letters import (
    DEAD_LETTER_HEADERS,
    ERROR_MESSAGE,
    HEADER_DOCS,
    REPLAY_COUNT,
    dead_letter_headers,
    read_dead_letter,
    replay_headers,
)
from worker.messages import MAX_TICKET_ID_CHARS, TicketEvent

LIMIT = 1_048_576
ERROR_TYPES = frozenset(typing.get_args(DecodeErrorType))

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

# Any code point, lone surrogates included (they cannot be UTF-8, so they reach the decoder as \u escapes).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
plain_text = st.text(max_size=40)
timestamps = st.datetimes(
    min_value=datetime.datetime(1, 1, 1), timezones=st.sampled_from([datetime.UTC, None])
).map(lambda moment: moment.replace(tzinfo=datetime.UTC).isoformat())
# JSON's own numbers: int64 range (msgspec refuses larger ones in known fields) and finite floats.
json_ints = st.integers(-(2**63), 2**63 - 1)
json_floats = st.floats(allow_nan=False, allow_infinity=False)
json_scalars = st.none() | st.booleans() | json_ints | json_floats | plain_text
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(plain_text, inner, max_size=4)
)


def _has_text_to_classify(ticket: dict[str, Any]) -> bool:
    body: str = ticket["body"]
    subject: str | None = ticket.get("subject")
    return (body + (subject or "")).strip() != ""


tickets: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"ticket_id": st.text(min_size=1, max_size=20), "body": plain_text},
    optional={
        "subject": st.none() | plain_text,
        "customer_id": st.none() | plain_text,
        "channel": st.none() | plain_text,
        "created_at": st.none() | timestamps,
        "metadata": st.none() | st.dictionaries(plain_text, plain_text, max_size=4),
        "producer_only": json_values,
    },
).filter(_has_text_to_classify)


def _json(document: Any, ascii_only: bool) -> bytes:
    return json.dumps(document, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def _outcome(value: bytes | None) -> TicketEvent | DecodeError:
    """The one thing a record value becomes; anything but DecodeError escaping fails the test."""
    try:
        return decode_ticket(value, LIMIT)
    except DecodeError as error:
        assert error.error_type in ERROR_TYPES
        assert 0 < len(error.message) <= MAX_MESSAGE_CHARS
        _check_dead_letter(error)
        return error


def _check_dead_letter(error: DecodeError) -> None:
    headers = dead_letter_headers([("trace", b"t")], error.error_type, error.message, "tickets.raw", 2, 9)
    info = read_dead_letter(headers)
    assert (info.error_type, info.topic, info.partition, info.offset) == (
        error.error_type,
        "tickets.raw",
        2,
        9,
    )
    assert info.error_message == error.message  # short enough to travel whole


@FUZZ
@given(tickets, st.booleans())
def test_valid_tickets_round_trip(ticket: dict[str, Any], ascii_only: bool) -> None:
    event = _outcome(_json(ticket, ascii_only))
    assert isinstance(event, TicketEvent), event
    known = {name: value for name, value in ticket.items() if name != "producer_only"}
    assert msgspec.structs.asdict(event) == {**dict.fromkeys(TicketEvent.__struct_fields__), **known}


@FUZZ
@given(st.binary(max_size=2048))
def test_any_bytes_are_a_ticket_or_a_decode_error(value: bytes) -> None:
    _outcome(value)


def _mutate(value: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    data = bytearray(value)
    for position, cut, inserted in edits:
        at = position % (len(data) + 1)
        data[at : at + cut] = inserted
    return bytes(data)


_inserts = st.sampled_from(
    [b"[", b"{", b"]", b"}", b'"', b"\\", b",", b":", b"\\ud800", b"\xed\xa0\x80", b"\xc0\x80", b"\x00"]
) | st.binary(max_size=4)


@FUZZ
@given(
    tickets,
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 4), _inserts.map(lambda b: b * 3) | _inserts),
        min_size=1,
        max_size=6,
    ),
)
def test_mutated_tickets_are_a_ticket_or_a_decode_error(
    ticket: dict[str, Any], edits: list[tuple[int, int, bytes]]
) -> None:
    _outcome(_mutate(_json(ticket, ascii_only=False), edits))


@FUZZ
@given(
    st.integers(1, 200_000),
    st.sampled_from([(b"[", b"]"), (b'{"a": ', b"}"), (b'[{"k": ', b"}]")]),
    st.booleans(),
    st.booleans(),
)
def test_nesting_over_the_limit_is_too_deeply_nested_at_any_depth(
    depth: int, pair: tuple[bytes, bytes], closed: bool, in_a_ticket: bool
) -> None:
    opener, closer = pair
    levels = depth * (2 if opener.startswith(b"[{") else 1) + (1 if in_a_ticket else 0)
    inner = opener * depth + b"1" + (closer * depth if closed else b"")
    value = b'{"ticket_id": "T", "body": "b", "x": ' + inner + b"}" if in_a_ticket else inner
    outcome = _outcome(value)
    if len(value) > LIMIT:
        assert isinstance(outcome, DecodeError) and outcome.error_type == "too_large"
    elif levels > MAX_NESTING_DEPTH:
        assert isinstance(outcome, DecodeError) and outcome.error_type == "too_deeply_nested"
    elif in_a_ticket and closed:
        assert isinstance(outcome, TicketEvent)
    else:
        assert isinstance(outcome, DecodeError)
        assert outcome.error_type in {"not_an_object", "invalid_json", "missing_field"}


@FUZZ
@given(
    st.sampled_from(["body", "subject", "ticket_id", "x", "metadata"]),
    st.integers(0, 1_100_000),
    st.sampled_from(["x", "é", "😀", '\\"', "["]),
)
def test_huge_strings_are_decoded_or_too_large(field: str, size: int, unit: str) -> None:
    text = unit * max(1, size // len(unit.encode()))
    if field == "metadata":
        value = _json({"ticket_id": "T", "body": "b", "metadata": {text: "v"}}, ascii_only=False)
    else:
        value = _json({"ticket_id": "T", "body": "b", field: text}, ascii_only=False)
    outcome = _outcome(value)
    id_too_long = field == "ticket_id" and len(text) > MAX_TICKET_ID_CHARS
    assert isinstance(outcome, TicketEvent) == (len(value) <= LIMIT and not id_too_long), outcome
    if isinstance(outcome, DecodeError):
        assert outcome.error_type == ("too_large" if len(value) > LIMIT else "too_long")


@FUZZ
@given(
    st.sampled_from(["body", "ticket_id", "x", "metadata", "created_at"]),
    st.integers(1, 120_000),
    st.sampled_from(["{d}", "-{d}", "1{d}.5", "0.{d}1", "1e{n}", "1E-{n}"]),
)
def test_huge_numbers_never_escape(field: str, digits: int, shape: str) -> None:
    number = shape.format(d="9" * digits, n=digits)
    value = b'{"ticket_id": "T", "body": "b", "' + field.encode() + b'": ' + number.encode() + b"}"
    outcome = _outcome(value)
    # Only an unknown field may hold a number; msgspec skips it whatever its size.
    assert isinstance(outcome, TicketEvent) == (field == "x"), outcome


@FUZZ
@given(
    st.sampled_from(["body", "ticket_id", "subject", "x", "metadata key", "metadata value"]),
    st.lists(
        st.sampled_from(
            ["\\ud800", "\\udfff", "\\ud83d\\ude00", "\\ud83d\\u0041", "\\u0000", "\u202e", "\ufeff"]
        )
        | st.text(st.characters(exclude_characters='"\\', exclude_categories=("Cs", "Cc")), max_size=8),
        max_size=4,
    ),
)
def test_surrogate_escapes_are_a_ticket_only_when_paired(field: str, pieces: list[str]) -> None:
    text = "".join(pieces)
    literal = f'"{text}"'
    if field == "metadata key":
        value = f'{{"ticket_id": "T", "body": "b", "metadata": {{{literal}: "v"}}}}'
    elif field == "metadata value":
        value = f'{{"ticket_id": "T", "body": "b", "metadata": {{"k": {literal}}}}}'
    else:
        value = f'{{"ticket_id": "T", "body": "b", "{field}": {literal}}}'
    outcome = _outcome(value.encode("utf-8"))
    try:
        decoded: Any = json.loads(literal)
        valid = not any(0xD800 <= ord(c) <= 0xDFFF for c in decoded)
    except json.JSONDecodeError:
        valid = False
    if not valid:
        assert isinstance(outcome, DecodeError) and outcome.error_type == "invalid_json", outcome
    elif field == "body" and not decoded.strip():  # no text left to classify
        assert isinstance(outcome, DecodeError) and outcome.error_type == "empty_ticket", outcome
    elif not (field == "ticket_id" and decoded == ""):
        assert isinstance(outcome, TicketEvent), outcome


_FIELDS = ["ticket_id", "body", "subject", "customer_id", "channel", "created_at", "metadata"]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_FIELDS), json_values | plain_text), min_size=1, max_size=6))
@example(pairs=[("body", ""), ("body", "0")])  # found once in a full run: an empty body is a valid value
@example(pairs=[("body", "0"), ("body", "")])  # ... and the last one, empty, leaves a ticket without text
def test_duplicate_keys_the_last_counts_and_every_one_must_be_valid(pairs: list[tuple[str, Any]]) -> None:
    """JSON leaves duplicate names undefined; here every value must be valid for its field, and then the
    record is the object its last values make (that object's rules about the whole ticket included)."""
    members = [("ticket_id", "T"), ("body", "b"), *pairs]
    value = ("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in members) + "}").encode()
    outcome = _outcome(value)
    if all(_valid_alone(name, item) for name, item in members):
        last = _outcome(_json(dict(members), ascii_only=True))
        if isinstance(last, TicketEvent):
            assert outcome == last
        else:
            assert isinstance(outcome, DecodeError) and outcome.error_type == last.error_type, outcome
    else:
        assert isinstance(outcome, DecodeError), outcome


def _valid_alone(name: str, item: Any) -> bool:
    """Whether `item` is a valid value of `name`: `{"ticket_id": "T", "body": "b", "subject": "s", name:
    item}` is a ticket. The subject makes an empty body count as valid: the rule that refuses a ticket with
    no text at all is about the whole ticket, not about one value of `body`."""
    try:
        decode_ticket(
            _json({"ticket_id": "T", "body": "b", "subject": "s", name: item}, ascii_only=True), LIMIT
        )
    except DecodeError:
        return False
    return True


_WRONG = st.one_of(
    st.booleans(),
    json_ints,
    json_floats,
    st.lists(json_scalars, max_size=3),
    st.dictionaries(plain_text, json_scalars, max_size=3),
)


@FUZZ
@given(tickets, st.sampled_from(_FIELDS), _WRONG)
def test_a_field_of_the_wrong_type_is_named(ticket: dict[str, Any], field: str, wrong: Any) -> None:
    if field == "metadata" and isinstance(wrong, dict):
        wrong = {**wrong, "k": 1}  # an object, but with a value that is not a string
    outcome = _outcome(_json({**ticket, field: wrong}, ascii_only=False))
    assert isinstance(outcome, DecodeError) and outcome.error_type == "wrong_type", outcome
    assert f"`{field}" in outcome.message


@FUZZ
@given(tickets, st.sampled_from(["ticket_id", "body"]))
def test_a_missing_required_field_is_named(ticket: dict[str, Any], field: str) -> None:
    outcome = _outcome(_json({k: v for k, v in ticket.items() if k != field}, ascii_only=True))
    assert isinstance(outcome, DecodeError) and outcome.error_type == "missing_field"
    assert outcome.message == f"required field `{field}` is missing"


# --- dead-letter headers ----------------------------------------------------------------------------------

_header_names = st.sampled_from(sorted(DEAD_LETTER_HEADERS)) | st.text(max_size=12) | st.none()
_header_values = (
    st.none()
    | st.binary(max_size=16)
    | st.integers(0, 2**70).map(lambda n: str(n).encode())
    | st.integers(0, 6000).map(lambda n: b"9" * n)
    | st.sampled_from([b"-1", "٣".encode(), b" 1", b"1\n", b"\xff"])
)


@FUZZ
@given(
    st.lists(st.tuples(_header_names, _header_values), max_size=8),
    st.sampled_from([*sorted(ERROR_TYPES), "internal_error"]),
    any_text | st.text(max_size=3000),
    st.integers(0, 2**63 - 1),
    st.integers(0, 10),
)
def test_dead_letter_headers_take_any_header_set_and_read_back(
    originals: list[tuple[Any, bytes | None]], error_type: str, message: str, offset: int, replays: int
) -> None:
    written = dead_letter_headers(originals, error_type, message, "tickets.raw", 1, offset, replays)
    # The record's own headers stay, in order; the triage.* ones appear once each, as bytes.
    assert written[: len(written) - 7] == [(n, v) for n, v in originals if n not in DEAD_LETTER_HEADERS]
    assert [name for name, _ in written[-7:]] == [name for name, _ in HEADER_DOCS]
    assert all(isinstance(value, bytes) for _, value in written[-7:])
    text = dict(written[-7:])[ERROR_MESSAGE]
    assert text is not None and len(text) <= 1024
    info = read_dead_letter(written)
    assert (info.error_type, info.topic, info.partition, info.offset) == (
        error_type,
        "tickets.raw",
        1,
        offset,
    )
    carried = [value for name, value in originals if name == REPLAY_COUNT]
    last = carried[-1] if carried else None
    readable = last is not None and last.isdigit() and len(last) <= 19
    assert info.replay_count == (max(replays, int(last)) if readable and last is not None else replays)
    assert dict(replay_headers(written))[REPLAY_COUNT] == str(info.replay_count + 1).encode()
