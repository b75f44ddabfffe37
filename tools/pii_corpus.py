"""A generated corpus of support tickets holding personal data of every kind the worker detects, in many
formats (digit groups split by spaces, no-break spaces, tabs, line breaks, dashes or dots), and near-misses
that must stay as they are (issue #33; docs/privacy.md).

Every identifier is valid by its own rules: cards pass Luhn and sit in an issuer's range (Visa, Mastercard
in both series, American Express, Discover, Diners Club, JCB, UnionPay, Maestro), IBANs of fourteen countries
have their mod-97 check digits, phone numbers are numbers `phonenumbers` holds valid for their region, SSNs
follow the SSA's rules. The near-misses look like them and are not: order numbers that fail Luhn, IBANs with
wrong check digits, SSNs with a 000 or 666 area, amounts, dates, times, parcel tracking codes.

`corpus(count, seed)` is deterministic for a seed. `python -m tools.pii_corpus --count N` prints the tickets
as JSON lines (`ticket_id`, `body`, `subject`, `identifiers`, `kinds`, `near_misses`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field

import phonenumbers

# (prefix, length, grouping of the printed number) per brand.
_CARD_BRANDS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("4", 16, (4, 4, 4, 4)),  # Visa
    ("4", 13, (4, 4, 5)),  # Visa, the old 13-digit numbers
    ("51", 16, (4, 4, 4, 4)),  # Mastercard
    ("55", 16, (4, 4, 4, 4)),
    ("2221", 16, (4, 4, 4, 4)),  # Mastercard 2-series
    ("2720", 16, (4, 4, 4, 4)),
    ("34", 15, (4, 6, 5)),  # American Express
    ("37", 15, (4, 6, 5)),
    ("6011", 16, (4, 4, 4, 4)),  # Discover
    ("65", 16, (4, 4, 4, 4)),
    ("36", 14, (4, 6, 4)),  # Diners Club
    ("3530", 16, (4, 4, 4, 4)),  # JCB
    ("62", 19, (4, 4, 4, 4, 3)),  # UnionPay
    ("6759", 18, (4, 4, 4, 4, 2)),  # Maestro
)
# Country, BBAN pattern (a: letter, n: digit, c: either), as printed by their banks.
_IBAN_COUNTRIES: tuple[tuple[str, str], ...] = (
    ("DE", "nnnnnnnnnnnnnnnnnn"),
    ("GB", "aaaannnnnnnnnnnnnn"),
    ("FR", "nnnnnnnnnncccccccccccnn"),
    ("ES", "nnnnnnnnnnnnnnnnnnnn"),
    ("IT", "annnnnnnnnncccccccccccc"),
    ("NL", "aaaannnnnnnnnn"),
    ("BE", "nnnnnnnnnnnn"),
    ("CH", "nnnnncccccccccccc"),
    ("AT", "nnnnnnnnnnnnnnnn"),
    ("PL", "nnnnnnnnnnnnnnnnnnnnnnnn"),
    ("SE", "nnnnnnnnnnnnnnnnnnnn"),
    ("IE", "aaaannnnnnnnnnnnnn"),
    ("PT", "nnnnnnnnnnnnnnnnnnnnn"),
    ("NO", "nnnnnnnnnnn"),
)
# Between the groups of a card number or an IBAN, besides a space or a dash: what HTML mail clients paste (a
# no-break, narrow no-break or thin space), a tab, a line break, an en dash, a dot.
_PASTED_SEPARATORS = ("\u00a0", "\u202f", "\u2009", "\t", "\n", "\u2013", ".")
_PHONE_REGIONS = ("US", "GB", "DE", "FR", "IN", "BR", "JP", "AU", "ES", "IT", "NL", "MX", "ZA", "CA", "SG")
_EMAILS = (
    "jane.doe@example.com",
    "j.o.doe+billing@mail.example.co.uk",
    "JOHN_SMITH99@Example.ORG",
    "ops-team@sub.domain-name.example.net",
    "o'connor@example.ie",
    "josé.garcía@correo.example.es",
    "user%route@example.io",
    "x@example.travel",
)
# The order of a result's `pii` list (worker.privacy.detector.KINDS).
_KINDS = ("email", "iban", "card_number", "us_ssn", "phone")
_TEMPLATES = (
    "Hi, my card {card_number} was charged twice. Please call me on {phone} (order {order}, {amount}).",
    "Please send the refund to {iban} and confirm to {email}. Invoice {invoice} dated {date}.",
    "I can't log in. My email is {email}, phone {phone}, SSN {us_ssn}. Parcel {tracking} arrived {date}.",
    "Card {card_number} expires {expiry}; transfer from {iban} failed at {time}. Ref {bad_iban}.",
    "Contact: {phone} / {email}. Paid {amount} with {card_number}, order {order}, not {bad_ssn}.",
    "Wrong amount {amount} on {date}; account {iban}; number on file {us_ssn}; tracking {tracking}.",
)


@dataclass
class CorpusTicket:
    """One ticket: its text and what it holds. `identifiers` must never leave the input topic in clear;
    `near_misses` must come through unchanged; `kinds` is what its result's `pii` must list."""

    ticket_id: str
    body: str
    subject: str | None
    identifiers: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    near_misses: list[str] = field(default_factory=list)


def luhn_check_digit(partial: str) -> str:
    """The check digit that makes `partial` + it pass Luhn."""
    total = 0
    for position, char in enumerate(reversed(partial)):
        digit = int(char)
        if position % 2 == 0:  # doubled once the check digit is appended
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return str((10 - total % 10) % 10)


def _grouped(digits: str, groups: tuple[int, ...], separator: str) -> str:
    parts, at = [], 0
    for size in groups:
        parts.append(digits[at : at + size])
        at += size
    return separator.join(part for part in parts if part)


def card_number(rng: random.Random) -> str:
    prefix, length, groups = rng.choice(_CARD_BRANDS)
    body = prefix + "".join(rng.choice("0123456789") for _ in range(length - len(prefix) - 1))
    digits = body + luhn_check_digit(body)
    return _grouped(digits, groups, rng.choice(["", " ", "-", " ", *_PASTED_SEPARATORS]))


def failing_order_number(rng: random.Random) -> str:
    """A 16-digit number in a card's range whose last digit fails Luhn: an order number, not a card."""
    body = "4" + "".join(rng.choice("0123456789") for _ in range(14))
    wrong = (int(luhn_check_digit(body)) + rng.randint(1, 9)) % 10
    return body + str(wrong)


def _check_digits(country: str, bban: str) -> str:
    number = "".join(str(int(char, 36)) for char in bban + country + "00")
    return f"{98 - int(number) % 97:02d}"


def _bban(rng: random.Random, pattern: str) -> str:
    pools = {
        "a": "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "n": "0123456789",
        "c": "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    }
    return "".join(rng.choice(pools[kind]) for kind in pattern)


def iban(rng: random.Random, valid: bool = True) -> str:
    country, pattern = rng.choice(_IBAN_COUNTRIES)
    bban = _bban(rng, pattern)
    check = _check_digits(country, bban)
    if not valid:
        check = f"{(int(check) + rng.randint(1, 90)) % 97 + 2:02d}"
        check = check if check != _check_digits(country, bban) else f"{(int(check) + 1) % 100:02d}"
    compact = country + check + bban
    style = rng.randrange(3)
    if style == 0:
        return compact
    separator = rng.choice([" ", " ", *_PASTED_SEPARATORS])
    grouped = separator.join(compact[i : i + 4] for i in range(0, len(compact), 4))
    return grouped if style == 1 else grouped.lower()


def phone(rng: random.Random) -> str:
    """A valid number of a random region, in one of its printed formats (international, E.164, national
    for North America, RFC 3966 without its scheme)."""
    while True:
        region = rng.choice(_PHONE_REGIONS)
        kind = rng.choice([phonenumbers.PhoneNumberType.MOBILE, phonenumbers.PhoneNumberType.FIXED_LINE])
        example = phonenumbers.example_number_for_type(region, kind)
        if example is None:
            continue
        national = str(example.national_number)
        # Vary the last four digits, keeping only numbers the numbering plan holds valid.
        varied = national[:-4] + f"{rng.randrange(10000):04d}"
        number = phonenumbers.parse(varied, region)
        if not phonenumbers.is_valid_number(number):
            continue
        formats = [phonenumbers.PhoneNumberFormat.INTERNATIONAL, phonenumbers.PhoneNumberFormat.E164]
        if region in ("US", "CA"):
            formats.append(phonenumbers.PhoneNumberFormat.NATIONAL)
        return phonenumbers.format_number(number, rng.choice(formats))


def us_ssn(rng: random.Random) -> str:
    """An SSN the SSA could issue (no area 000, 666 or 9xx, no group 00, no serial 0000)."""
    area = rng.choice([a for a in range(1, 900) if a != 666])
    separator = rng.choice("- ")
    return f"{area:03d}{separator}{rng.randint(1, 99):02d}{separator}{rng.randint(1, 9999):04d}"


def _near_misses(rng: random.Random) -> dict[str, str]:
    return {
        "order": failing_order_number(rng),
        "amount": rng.choice(["$1,250.00", "€3.499,99", "USD 12,000", "£89.95", "1 500,00 EUR"]),
        "date": rng.choice(["2024-05-01", "01/05/2024", "12.03.2025", "March 3, 2025"]),
        "time": rng.choice(["10:30", "23:59:01", "9am"]),
        "expiry": rng.choice(["12/27", "03/2029"]),
        "invoice": f"INV-2024-{rng.randrange(1000000):06d}",
        "tracking": rng.choice(
            [
                f"1Z{rng.randrange(10**6):06d}AA{rng.randrange(10**8):08d}",
                f"JD{rng.randrange(10**15):015d}GB",
                f"RR{rng.randrange(10**9):09d}CN",
            ]
        ),
        "bad_iban": iban(rng, valid=False),
        "bad_ssn": rng.choice(["000", "666", "901"]) + f"-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}",
    }


def corpus(count: int, seed: int = 33) -> list[CorpusTicket]:
    """`count` tickets, deterministic for `seed`; every kind and near-miss recurs across them."""
    rng = random.Random(seed)
    makers = {
        "card_number": card_number,
        "iban": iban,
        "email": lambda r: r.choice(_EMAILS),
        "phone": phone,
        "us_ssn": us_ssn,
    }
    tickets = []
    for index in range(count):
        template = _TEMPLATES[index % len(_TEMPLATES)]
        misses = _near_misses(rng)
        values: dict[str, str] = dict(misses)
        ticket = CorpusTicket(ticket_id=f"PII-{seed}-{index}", body="", subject=None)
        for kind, make in makers.items():
            if "{" + kind + "}" in template:
                values[kind] = make(rng)
                ticket.identifiers.append(values[kind])
        ticket.near_misses = [value for name, value in misses.items() if "{" + name + "}" in template]
        ticket.body = template.format(**values)
        if index % 4 == 0:  # some carry an identifier in the subject
            address = rng.choice(_EMAILS)
            ticket.subject = f"Re: account of {address}"
            ticket.identifiers.append(address)
            values["email"] = address
        ticket.kinds = [kind for kind in _KINDS if kind in values]
        tickets.append(ticket)
    return tickets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.pii_corpus", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=120)
    parser.add_argument("--seed", type=int, default=33)
    args = parser.parse_args(argv)
    for ticket in corpus(args.count, args.seed):
        sys.stdout.write(json.dumps(asdict(ticket), ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
