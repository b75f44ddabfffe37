"""Finding personal data in ticket text: payment card numbers, IBANs, e-mail addresses, phone numbers and US
social security numbers, each validated the way its issuer defines it, so that numbers that merely look
alike (order numbers, amounts, dates, tracking codes) stay as they are.

`find(text, region)` returns the spans, left to right and never overlapping. When two kinds could claim the
same characters the stricter one wins, in the order of `KINDS`: an e-mail address before the digits inside
it, an IBAN (mod 97) and a card (Luhn and issuer) before a phone number, which `phonenumbers` would also
accept for many long digit runs.

Each detector first looks for a cheap sign of its kind (an `@`, a run of digits, two capitals and two
digits) and only then runs its full check: most tickets have none, and the detector runs on every ticket the
worker takes (`docs/privacy.md` has the cost).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import phonenumbers

Kind = Literal["email", "iban", "card_number", "us_ssn", "phone"]
# Precedence, strictest first (see the module's docstring); also the order of a result's `pii` list.
KINDS: tuple[Kind, ...] = ("email", "iban", "card_number", "us_ssn", "phone")


@dataclass(frozen=True, slots=True)
class Finding:
    """`text[start:end]` is personal data of `kind`."""

    kind: Kind
    start: int
    end: int


# -- e-mail addresses ----------------------------------------------------------------------------------------

# A local part of the characters RFC 5322 allows unquoted (letters of any script included), and a domain of at
# least two labels. Quoted local parts and IP-literal domains are left out: nobody types them in a ticket.
# The local part begins with a letter, digit or underscore, so that a quote, bracket or `#` before an
# address (`'jo@example.com'`, `{jo@example.com}`) stays the sentence's.
# The top-level domain is letters (of any script: internationalised domains as people type them), or an ASCII
# Punycode label (`xn--fiqs8s`, how a mail client may show the same domain), tried first so that it is taken
# whole rather than cut at its `xn`.
_EMAIL = re.compile(
    r"(?<!\w)\w[\w.!#$%&'*+/=?^`{|}~-]*@(?:[^\W_](?:[\w-]{0,61}[^\W_])?\.)+"
    r"(?:[Xx][Nn]--[A-Za-z0-9](?:[A-Za-z0-9-]{0,57}[A-Za-z0-9])?|[^\W\d_]{2,63})(?!\w)"
)


def _emails(text: str) -> Iterator[Finding]:
    if "@" not in text:
        return
    for match in _EMAIL.finditer(text):
        yield Finding("email", match.start(), match.end())


# -- digit groups --------------------------------------------------------------------------------------------

# What people (and their mail clients) put between the groups of a card number or an IBAN: any run of
# spaces (a no-break, figure, thin, hair or narrow no-break space too: HTML mail pastes them) and tabs, with
# up to two marks among them: a line break (Windows' CR LF counts as one), a dash (hyphen, non-breaking
# hyphen, figure, en or em dash), a dot or a slash. So "4111 1111", "4111  1111", "4111 - 1111",
# "4111/1111", "4111 -- 1111" and "4111.\n1111" all join two groups.
_SPACE_CHARS = " \u00a0\u2007\u2009\u200a\u202f\t"
_MARK_CHARS = "-\u2010\u2011\u2012\u2013\u2014./\r\n"
_SEPARATOR_CHARS = _SPACE_CHARS + _MARK_CHARS
_SPACES = f"[{re.escape(_SPACE_CHARS)}]"
_MARK = rf"(?:\r\n|[{re.escape(_MARK_CHARS)}])"
_GAP = f"(?:{_SPACES}+(?:{_MARK}{_SPACES}*){{0,2}}|(?:{_MARK}{_SPACES}*){{1,2}})"
_SEPARATORS = re.compile(f"[{re.escape(_SEPARATOR_CHARS)}]")


# -- IBANs ---------------------------------------------------------------------------------------------------

# IBAN length by country (the SWIFT IBAN registry). A candidate whose country is not here is no IBAN.
_IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29,
    "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "EG": 29,
    "ES": 24, "FI": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28,
    "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19,
    "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29,
    "RO": 24, "RS": 22, "SA": 24, "SC": 31, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}  # fmt: skip
# A country code and check digits, then alphanumerics with at most one gap (above) between them (printed
# IBANs come in groups of four). The match may run past the IBAN into the next word; `_iban_end` cuts it.
_IBAN_START = re.compile(rf"(?<![^\W_])([A-Za-z]{{2}})(\d{{2}})(?:{_GAP}?[A-Za-z0-9]){{11,30}}")


def _iban_valid(compact: str) -> bool:
    """ISO 13616: the first four characters moved to the end, letters as 10..35, the number mod 97 is 1."""
    moved = compact[4:] + compact[:4]
    number = "".join(str(int(char, 36)) for char in moved)
    return int(number) % 97 == 1


def _iban_end(text: str, start: int, length: int) -> int | None:
    """Where the IBAN of `length` characters starting at `start` ends (separators skipped), or None when the
    text runs out or the IBAN would end inside a word."""
    taken, index = 0, start
    while taken < length:
        if index >= len(text):
            return None
        char = text[index]
        if char.isascii() and char.isalnum():
            taken += 1
        elif char not in _SEPARATOR_CHARS or taken == 0:
            return None
        index += 1
    if index < len(text) and text[index].isalnum():
        return None
    return index


def _ibans(text: str) -> Iterator[Finding]:
    for match in _IBAN_START.finditer(text):
        length = _IBAN_LENGTHS.get(match[1].upper())
        if length is None:
            continue
        end = _iban_end(text, match.start(), length)
        if end is None:
            continue
        compact = _SEPARATORS.sub("", text[match.start() : end]).upper()
        if _iban_valid(compact):
            yield Finding("iban", match.start(), end)


# -- payment card numbers ------------------------------------------------------------------------------------

# Issuer identification ranges (ISO/IEC 7812 prefixes as the networks publish them) and their lengths:
# (low prefix, high prefix, lengths). A Luhn-valid number outside all of them is not taken for a card.
_ISSUERS: tuple[tuple[int, int, frozenset[int]], ...] = (
    (4, 4, frozenset({13, 16, 19})),  # Visa
    (51, 55, frozenset({16})),  # Mastercard
    (2221, 2720, frozenset({16})),  # Mastercard 2-series
    (34, 34, frozenset({15})),  # American Express
    (37, 37, frozenset({15})),
    (6011, 6011, frozenset(range(16, 20))),  # Discover
    (644, 649, frozenset(range(16, 20))),
    (65, 65, frozenset(range(16, 20))),
    (300, 305, frozenset(range(14, 20))),  # Diners Club
    (36, 36, frozenset(range(14, 20))),
    (38, 39, frozenset(range(16, 20))),
    (3528, 3589, frozenset(range(16, 20))),  # JCB
    (62, 62, frozenset(range(16, 20))),  # UnionPay
    (2200, 2204, frozenset(range(16, 20))),  # Mir
    (50, 50, frozenset(range(13, 20))),  # Maestro
    (56, 69, frozenset(range(13, 20))),
)
# Runs of digit groups joined by gaps (above). A card is looked for among the windows of whole groups of a
# run, wherever it starts: after an order number, a quantity, a date or an amount the run holds more than
# the card ("Order 26 4225 4410 1995 2883", "On 2026-01-06 6011 6565 1606 1135").
_DIGIT_RUN = re.compile(rf"\d+(?:{_GAP}\d+)*")
_DIGITS = re.compile(r"\d+")
# The start of an IBAN-shaped code before a run of digits ("DE47 2298 ...", "ie43 yzjs 5895 ..."): when it
# is no valid IBAN, its digits are no card either, even when they pass Luhn (one in ten does).
_IBAN_HEAD = re.compile(rf"(?<![A-Za-z0-9])[A-Za-z]{{2}}\d{{2}}(?:{_GAP}?[A-Za-z0-9]{{1,4}}){{0,8}}{_GAP}?$")
# The first digit of every issuer's range: a window starting with another digit is no card.
_ISSUER_FIRST_DIGITS = frozenset("23456")


def luhn_valid(digits: str) -> bool:
    """The Luhn check (ISO/IEC 7812-1): every second digit from the right doubled, the sum divisible by 10."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        digit = ord(char) - 48
        if position % 2:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return total % 10 == 0


def _issued(digits: str) -> bool:
    return _issued_prefix(digits[:4], len(digits))


@functools.lru_cache(maxsize=4096)
def _issued_prefix(prefix: str, length: int) -> bool:
    """Whether an issuer's range holds numbers of `length` digits beginning with `prefix` (four digits)."""
    for low, high, lengths in _ISSUERS:
        width = len(str(low))
        if low <= int(prefix[:width]) <= high and length in lengths:
            return True
    return False


def card_valid(digits: str) -> bool:
    """Whether `digits` (digits only) could be a payment card's number: 13 to 19 digits, Luhn-valid, in an
    issuer's range and of a length it issues."""
    return (
        13 <= len(digits) <= 19
        and digits[0] in _ISSUER_FIRST_DIGITS
        and _issued(digits)
        and luhn_valid(digits)
    )


def _in_failed_iban(text: str, start: int) -> bool:
    head = _IBAN_HEAD.search(text, max(0, start - 48), start)
    return head is not None and not any(_ibans(head[0] + text[start : start + 40]))


def _card_shaped(sizes: Sequence[int], first_digits: str) -> bool:
    """Whether digit groups of `sizes` are grouped as cards are printed: in one piece; in fours, the last
    group of one to five digits ("4111 1111 1111 1111", "4111 1111 1111 1111 123", "4111 1111 11111"); or
    as American Express (4-6-5, from 34 or 37) and Diners Club (4-6-4, from 36 or 300-305) print theirs.
    `first_digits`: the number's first two digits or more."""
    if len(sizes) == 1 or (all(size == 4 for size in sizes[:-1]) and sizes[-1] <= 5):
        return True
    if list(sizes) == [4, 6, 5]:
        return first_digits[:2] in ("34", "37")
    return list(sizes) == [4, 6, 4] and (first_digits[:2] == "36" or "300" <= first_digits[:3] <= "305")


def _glued_before(text: str, at: int) -> bool:
    """Whether a digit group starting at `at` is part of something before it: a word, an international
    phone number (`+`), the decimals or thousands of a number (`1,`)."""
    if at == 0:
        return False
    before = text[at - 1]
    return before.isalnum() or before in "_+" or (before == "," and at > 1 and text[at - 2].isdigit())


def _glued_after(text: str, at: int) -> bool:
    """Whether a digit group ending at `at` runs on into a word or a number's decimals (`,50`)."""
    if at >= len(text):
        return False
    after = text[at]
    return after.isalnum() or after == "_" or (after == "," and text[at + 1 : at + 2].isdigit())


def _cards(text: str) -> Iterator[Finding]:
    for run in _DIGIT_RUN.finditer(text):
        if len(run[0]) < 13:
            continue
        groups = [(run.start() + m.start(), run.start() + m.end()) for m in _DIGITS.finditer(run[0])]
        # A group glued to a word (or a "+") on the run's edge is part of that word: no card starts or
        # ends in it.
        if _glued_before(text, groups[0][0]):
            groups = groups[1:]
        if groups and _glued_after(text, groups[-1][1]):
            groups = groups[:-1]
        yield from _cards_in_run(text, groups)


def _cards_in_run(text: str, groups: Sequence[tuple[int, int]]) -> Iterator[Finding]:
    """The cards among the windows of whole `groups` (positions in `text`) of one run: every window of 13 to
    19 digits that is a card by `card_valid`, ranked by how a card is written (`_rank`), the best first; a
    window overlapping one already taken is left, and a window of rank 0 counts only when it is the whole
    run ("41111111 11111111" alone, not "645039637802 / 1996-07-04"). Where windows of the same rank
    overlap, all of them are taken as one: a card followed by a CVV-sized group that is a card with it
    ("4111 1111 1111 1111 123": the 19 digits), or a four-digit order number that makes a card with the
    card's first groups, which the digits cannot tell apart (the redaction then takes the order number
    too, rather than leave a card's digits in clear)."""
    windows: list[tuple[int, int, int]] = []  # (rank, first group, last group)
    failed_iban: dict[int, bool] = {}
    for first in range(len(groups)):
        if text[groups[first][0]] not in _ISSUER_FIRST_DIGITS:
            continue
        digits = ""
        for last in range(first, len(groups)):
            digits += text[groups[last][0] : groups[last][1]]
            if len(digits) > 19:
                break
            if len(digits) < 13 or not card_valid(digits):
                continue
            if first not in failed_iban:
                failed_iban[first] = _in_failed_iban(text, groups[first][0])
            rank = _rank(text, groups[first : last + 1])
            if rank == 0 and (first, last) != (0, len(groups) - 1):
                rank = -1  # grouped as no card is, and more digits beside it: numbers running on
            if not failed_iban[first] and rank >= 0:
                windows.append((rank, first, last))
    taken: list[tuple[int, int]] = []  # spans of groups, first to last
    for rank in (2, 1, 0):
        merged: list[tuple[int, int]] = []
        for _, first, last in sorted(window for window in windows if window[0] == rank):
            if merged and first <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
            else:
                merged.append((first, last))
        taken += [span for span in merged if not any(_overlap(span, other) for other in taken)]
    for first, last in sorted(taken):
        yield Finding("card_number", groups[first][0], groups[last][1])


def _rank(text: str, groups: Sequence[tuple[int, int]]) -> int:
    """2: grouped as cards are printed (`_card_shaped`), the same separator in every gap (or in one piece);
    1: so grouped, different separators; 0: grouped otherwise, but in groups of three digits or more (the
    first of four or more) with the same separator in every gap, taken only when the window is its whole
    run (`_cards_in_run`); -1: no card. A date, an amount, a quantity or a reference beside a card is
    seldom of a higher rank with it than the card alone ("On 2026-01-06 6011 6565 1606 1135",
    "5353--6864--3248--8813. 3"), and numbers that run on into each other are seldom more than rank -1
    ("304-304353318610", "30 126032. 1995-04", "68152 - 2008/04/15")."""
    sizes = [end - start for start, end in groups]
    same_gaps = len({text[end:start] for (_, end), (start, _) in itertools.pairwise(groups)}) <= 1
    if _card_shaped(sizes, text[groups[0][0] : groups[0][0] + 3]):
        return 2 if same_gaps else 1
    return 0 if same_gaps and sizes[0] >= 4 and min(sizes) >= 3 else -1


def _overlap(one: tuple[int, int], other: tuple[int, int]) -> bool:
    return one[0] <= other[1] and other[0] <= one[1]


# -- US social security numbers ------------------------------------------------------------------------------

# Written with separators only: a bare nine-digit number is as likely an order or account number.
_SSN = re.compile(r"(?<![\w-])(\d{3})([- ])(\d{2})\2(\d{4})(?![\w]|-\d)")


def _ssn_valid(area: str, group: str, serial: str) -> bool:
    """The SSA's rules: no area 000, 666 or 900-999, no group 00, no serial 0000."""
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def _ssns(text: str) -> Iterator[Finding]:
    for match in _SSN.finditer(text):
        if _ssn_valid(match[1], match[3], match[4]):
            yield Finding("us_ssn", match.start(), match.end())


# -- phone numbers -------------------------------------------------------------------------------------------

# A phone number has at least seven digits, possibly split by spaces, dots, dashes or brackets, neither
# following nor followed by a letter or digit (a number glued to a word is no phone: `_glued`), which spares
# the costly matcher the digit runs inside hex ids (trace ids, UUIDs).
_PHONE_SIGN = re.compile(r"(?<![^\W_])\d(?:[\s().\-/]{0,3}\d){6,}(?![^\W_])")


def _phones(text: str, region: str | None) -> Iterator[Finding]:
    if _PHONE_SIGN.search(text) is None:
        return
    # VALID: the number must be one the numbering plan assigns (not merely of a possible length), which keeps
    # most amounts and reference numbers out. `region` is the country of numbers written without a +prefix.
    for match in phonenumbers.PhoneNumberMatcher(text, region, phonenumbers.Leniency.VALID):
        if _glued(text, match.start, match.end):
            continue  # part of a reference: "INV-2024-015547" holds a valid Washington DC number
        international = match.raw_string.lstrip("([").startswith("+")
        if not international and not _grouped_as_dialled(match.raw_string, region):
            continue
        start = match.start
        # The matcher takes a bracket before a number as the start of "(201) 555-0123" even when it closes
        # after the number ("(+27101237872)"): it is the sentence's.
        while text[start] in "([" and _CLOSING[text[start]] not in text[start + 1 : match.end]:
            start += 1
        yield Finding("phone", start, match.end)


_CLOSING = {"(": ")", "[": "]"}


def _glued(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] is joined to a word or number on either side, directly or by a dash or
    slash ("INV-2024-015547", "2024015547-B")."""
    before = text[max(0, start - 2) : start]
    after = text[end : end + 2]
    return (before[-1:].isalnum() or (before[-1:] in ("-", "/") and before[:1].isalnum())) or (
        after[:1].isalnum() or (after[:1] in ("-", "/") and after[1:2].isalnum())
    )


def _grouped_as_dialled(raw: str, region: str | None) -> bool:
    """A number without a country code counts only when its digits are grouped the way the region writes
    them (or not at all): "2286 4944 72" is a valid US number by its digits, but nobody writes one so, while
    reference codes often are."""
    strict = phonenumbers.PhoneNumberMatcher(raw, region, phonenumbers.Leniency.STRICT_GROUPING)
    return any(match.raw_string == raw for match in strict)


# Every kind holds a digit or an `@`: text without either (most header names and many tickets) holds none.
_ANY_SIGN = re.compile(r"[\d@]")
# What claimed spans are overwritten with before the next kind is looked for: no letter, digit, separator or
# sign any detector reads, so a span is neither found twice nor glued to what follows it.
_MASK = "\u2588"


def find(text: str, region: str | None = "US", kinds: frozenset[Kind] = frozenset(KINDS)) -> list[Finding]:
    """Every span of personal data of `kinds` in `text`, left to right, none overlapping another. Kinds are
    looked for in `KINDS` order, each in the text with the spans of the kinds before it masked: an IBAN's
    digits are not read again as a card, and a card right after an IBAN is still found. `region` (ISO 3166
    alpha-2, e.g. "US") is the country of phone numbers written without a country code; None finds only
    those with one."""
    found: list[Finding] = []
    if _ANY_SIGN.search(text) is None:
        return found
    masked = text
    for kind in KINDS:
        if kind not in kinds:
            continue
        if kind == "email":
            candidates = _emails(masked)
        elif kind == "iban":
            candidates = _ibans(masked)
        elif kind == "card_number":
            candidates = _cards(masked)
        elif kind == "us_ssn":
            candidates = _ssns(masked)
        else:
            candidates = _phones(masked, region)
        new = list(candidates)
        if new:
            found.extend(new)
            for finding in new:
                size = finding.end - finding.start
                masked = masked[: finding.start] + _MASK * size + masked[finding.end :]
    return sorted(found, key=lambda finding: finding.start)
