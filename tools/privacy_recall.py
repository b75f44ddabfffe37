"""Personal data in ordinary sentences (issue #55, item 3): how much of it the detector finds, and what it
takes that is none, on generated sentences and the project's own tickets.

`python -m tools.privacy_recall [--count N] [--seed S]` prints, per kind, the recall on N generated sentences
(seeded): each holds one identifier (a Luhn-valid card of a random brand and length, a mod-97-valid IBAN
of a random country, an e-mail address or a phone number) in a generated context: after or before a date
in one of several formats, an order number, a quantity, an amount with its currency, "no.", "#" or a label,
inside brackets or quotes, its groups split by a random run of separators, sentence punctuation right after
it. Then the false positives: findings on generated sentences that hold only such neighbours (order numbers,
dates, amounts, quantities; no identifier), and on the project's ticket corpora (BANKING77 test and train,
the sample tickets of `worker/dev/samples.py`, the out-of-domain tickets), none of which holds personal
data. Last, the detector's speed on BANKING77's test tickets (tickets/s, median of 5 rounds).

- **found**: a finding of the identifier's kind covers every character of it (what redaction promises:
  nothing of it stays in clear).
- **exact**: the finding is the identifier's span, no more (the neighbouring date or order number intact).

The generators (`sentence`, `card_number`, `iban`, ...) take a `random.Random`, so tests drive them from
seeded generators or hypothesis (`tests/privacy/test_privacy_contexts.py`).
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import string
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tools import REPO
from tools.pii_corpus import luhn_check_digit
from tools.pii_corpus import phone as _corpus_phone
from worker.privacy.detector import Finding, find

# -- identifiers ---------------------------------------------------------------------------------------------

# Brand: (prefixes to draw from, lengths). Every one is in an issuer range the detector knows.
CARD_BRANDS: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "visa": (("4",), (13, 16, 19)),
    "mastercard": (("51", "52", "53", "54", "55"), (16,)),
    "mastercard-2": (("2221", "2300", "2499", "2630", "2720"), (16,)),
    "amex": (("34", "37"), (15,)),
    "discover": (("6011", "644", "649", "65"), (16, 17, 18, 19)),
    "jcb": (("3528", "3550", "3589"), (16, 17, 18, 19)),
    "diners": (("36", "300", "305"), (14,)),
    "unionpay": (("62",), (16, 17, 18, 19)),
    "maestro": (("50", "5018", "6304", "6759", "6761"), (13, 15, 16, 18, 19)),
}
# Country: the BBAN's pattern (a: capital letter, n: digit, c: either), as the SWIFT registry gives it.
IBAN_COUNTRIES: dict[str, str] = {
    "DE": "n" * 18,
    "GB": "aaaa" + "n" * 14,
    "FR": "n" * 10 + "c" * 11 + "nn",
    "ES": "n" * 20,
    "IT": "a" + "n" * 10 + "c" * 12,
    "NL": "aaaa" + "n" * 10,
    "BE": "n" * 12,
    "CH": "n" * 5 + "c" * 12,
    "AT": "n" * 16,
    "PL": "n" * 24,
    "IE": "aaaa" + "n" * 14,
    "PT": "n" * 21,
    "NO": "n" * 11,
    "DK": "n" * 14,
    "FI": "n" * 14,
    "LU": "nnn" + "c" * 13,
    "RO": "aaaa" + "c" * 16,
    "HU": "n" * 24,
    "MT": "aaaa" + "n" * 5 + "c" * 18,
    "SA": "nn" + "c" * 18,
    "BR": "n" * 23 + "ac",
}
# What separates the groups of a printed card or IBAN: one of these, repeated between every two groups
# (or, now and then, a different one in each gap).
SEPARATORS = (
    " ", "  ", "   ", "-", " - ", "--", ".", ". ", "/", " / ", "\u00a0", "\u202f", "\u2009", "\t", "\n",
    "\r\n", "\u2013", " \u2013 ", "\u2014",
)  # fmt: skip
_POOLS = {"a": string.ascii_uppercase, "n": string.digits, "c": string.ascii_uppercase + string.digits}


def card_digits(rng: random.Random, brand: str | None = None) -> str:
    """A Luhn-valid card number of `brand` (a random one when None), its length one the brand issues."""
    prefixes, lengths = CARD_BRANDS[brand or rng.choice(sorted(CARD_BRANDS))]
    prefix, length = rng.choice(prefixes), rng.choice(lengths)
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    return body + luhn_check_digit(body)


def _group_sizes(rng: random.Random, digits: str) -> list[int]:
    """How a card is printed: in one piece; in fours, the rest in a last group of its own (4-4-4-4-3) or,
    where that makes five digits at most, joined to the last (4-4-5 for 13 digits); American Express's
    4-6-5 and Diners Club's 4-6-4."""
    length = len(digits)
    style = rng.randrange(4)
    if style == 0:
        return [length]
    if style == 1 and (length, digits[:2]) in ((15, "34"), (15, "37"), (14, "36"), (14, "30")):
        return [4, 6, length - 10]
    sizes = [4] * (length // 4)
    rest = length % 4
    if rest and rest + 4 <= 5 and rng.random() < 0.5:
        sizes[-1] += rest  # 4-4-5 for 13 digits
    elif rest:
        sizes.append(rest)
    return sizes


def _joined(rng: random.Random, parts: Sequence[str]) -> str:
    if rng.random() < 0.1:  # a different separator in each gap
        return "".join(
            part + (rng.choice(SEPARATORS) if i < len(parts) - 1 else "") for i, part in enumerate(parts)
        )
    return rng.choice(SEPARATORS).join(parts)


def card_number(rng: random.Random, brand: str | None = None) -> str:
    """A card number as a customer writes it: grouped by `_group_sizes`, split by separators."""
    digits = card_digits(rng, brand)
    parts, at = [], 0
    for size in _group_sizes(rng, digits):
        parts.append(digits[at : at + size])
        at += size
    return _joined(rng, parts)


def iban_compact(rng: random.Random, country: str | None = None) -> str:
    """A mod-97-valid IBAN of `country` (a random one when None), without separators."""
    country = country or rng.choice(sorted(IBAN_COUNTRIES))
    bban = "".join(rng.choice(_POOLS[kind]) for kind in IBAN_COUNTRIES[country])
    number = "".join(str(int(char, 36)) for char in bban + country + "00")
    return f"{country}{98 - int(number) % 97:02d}{bban}"


def iban(rng: random.Random, country: str | None = None) -> str:
    """An IBAN as people write it: in one piece or in groups of four, any separators, upper or lower case."""
    compact = iban_compact(rng, country)
    if rng.random() < 0.3:
        written = compact
    else:
        written = _joined(rng, [compact[i : i + 4] for i in range(0, len(compact), 4)])
    return written.lower() if rng.random() < 0.2 else written


def email(rng: random.Random) -> str:
    """An e-mail address: a local part of letters, digits and the symbols people use (`.`, `_`, `+`, `-`,
    `'`), a domain of two to three labels."""

    def label(size: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(size))

    local = rng.choice(string.ascii_letters) + "".join(
        rng.choice(string.ascii_letters + string.digits + "._+-'") for _ in range(rng.randint(0, 12))
    )
    local = local.rstrip(".").replace("..", ".")
    if not local[-1].isalnum():
        local += rng.choice(string.ascii_lowercase)
    labels = [label(rng.randint(2, 10)) for _ in range(rng.randint(1, 2))]
    tld = rng.choice(["com", "org", "net", "de", "co.uk", "io", "example", "travel", "fr"])
    return f"{local}@{'.'.join(labels)}.{tld}"


def phone(rng: random.Random) -> str:
    """A valid phone number of one of 15 countries, international (+country) or, for North America,
    national (`tools.pii_corpus.phone`)."""
    return _corpus_phone(rng)


# -- contexts ------------------------------------------------------------------------------------------------

_MONTHS = ("Jan", "February", "Mar", "April", "May", "Jun", "July", "Aug", "Sept", "Oct", "November", "Dec")


def date(rng: random.Random) -> str:
    """A date in one of the ways tickets write them."""
    year, month, day = rng.randint(1990, 2031), rng.randint(1, 12), rng.randint(1, 28)
    forms = (
        f"{year}-{month:02d}-{day:02d}",
        f"{day:02d}/{month:02d}/{year}",
        f"{month}/{day}/{year}",
        f"{day:02d}.{month:02d}.{year}",
        f"{day}.{month}.{year % 100:02d}",
        f"{year}/{month:02d}/{day:02d}",
        f"{day:02d}-{month:02d}-{year}",
        f"{day} {_MONTHS[month - 1]} {year}",
        f"{_MONTHS[month - 1]} {day}, {year}",
        f"{year}{month:02d}{day:02d}",
        f"{day:02d}/{month:02d}",
    )
    return rng.choice(forms)


def amount(rng: random.Random) -> str:
    """A sum of money with its currency, in the notations of several countries."""
    units, cents = rng.randint(0, 25000), rng.randint(0, 99)
    thousands = f"{units:,}"
    forms = (
        f"${thousands}.{cents:02d}",
        f"$ {units}",
        f"€{thousands.replace(',', '.')},{cents:02d}",
        f"{units},{cents:02d} EUR",
        f"{thousands.replace(',', ' ')},{cents:02d} €",
        f"£{units}.{cents:02d}",
        f"USD {thousands}",
        f"{units}.{cents:02d} GBP",
        f"CHF {units}.-",
        f"{units} zł",
    )
    return rng.choice(forms)


def order_number(rng: random.Random) -> str:
    """An order or reference number: digits of any length up to 12, or digits with a dash or a year."""
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 12)))
    return rng.choice((digits, digits, f"{rng.randint(2019, 2027)}-{digits}", f"{digits[:3]}-{digits}"))


def quantity(rng: random.Random) -> str:
    return str(rng.choice((1, 2, 3, 4, 5, 10, 12, 26, 100, rng.randint(1, 999))))


# A neighbour before the identifier: (the words before it, how the neighbour is made).
_BEFORE: tuple[tuple[str, Callable[[random.Random], str] | None], ...] = (
    ("On ", date),
    ("since ", date),
    ("Order ", order_number),
    ("order #", order_number),
    ("Order no. ", order_number),
    ("ref. ", order_number),
    ("Qty ", quantity),
    ("I bought ", quantity),
    ("Paid ", amount),
    ("charged ", amount),
    ("", None),
)
_LABELS = ("", "", "card ", "card no. ", "card no.", "card #", "#", "no. ", "Card: ", "number:", "IBAN ",
           "account ", "to ", "with ", "mail ", "phone: ", "call ")  # fmt: skip
# What sits between the neighbour (or label) and the identifier.
_GAPS = (" ", " ", " ", "  ", " - ", ", ", ": ", " / ", "\t", "\n", " -- ", "; ", " (", " \u2013 ")
_BRACKETS = (("", ""), ("", ""), ("", ""), ("(", ")"), ("[", "]"), ("{", "}"), ("<", ">"), ('"', '"'),
             ("'", "'"), ("\u201c", "\u201d"), ("\u00ab", "\u00bb"), ("*", "*"))  # fmt: skip
_PUNCTUATION = ("", "", "", ".", ",", "!", "?", ";", ":", "...", ").", "?!", " -")
# A neighbour after it: (the words between it and the neighbour, how the neighbour is made).
_AFTER: tuple[tuple[str, Callable[[random.Random], str] | None], ...] = (
    (" on ", date),
    (" ", date),
    (" for ", amount),
    (" ", amount),
    (" order ", order_number),
    (" ", quantity),
    (" exp ", lambda rng: f"{rng.randint(1, 12):02d}/{rng.randint(24, 35)}"),
    (" was charged twice", None),
    ("", None),
    ("", None),
)

Maker = Callable[[random.Random], str]
MAKERS: dict[str, Maker] = {"card_number": card_number, "iban": iban, "email": email, "phone": phone}


@dataclass(frozen=True)
class Sentence:
    """A generated sentence: `text[start:end]` is the identifier of `kind`; `neighbours` are the spans of
    the order numbers, dates, amounts and quantities beside it, which no finding may touch."""

    text: str
    kind: str
    start: int
    end: int
    neighbours: tuple[tuple[int, int], ...]

    @property
    def identifier(self) -> str:
        return self.text[self.start : self.end]


def sentence(rng: random.Random, kind: str | None = None, identifier: str | None = None) -> Sentence:
    """One sentence holding one identifier of `kind` (a random kind when None; `identifier` when given,
    else a generated one) in a random context."""
    kind = kind or rng.choice(sorted(MAKERS))
    text, neighbours = "", []
    lead, before = rng.choice(_BEFORE)
    text += rng.choice(("", "Hi, ", "Hello team. ")) + lead
    if before is not None:
        value = before(rng)
        neighbours.append((len(text), len(text) + len(value)))
        text += value
        text += rng.choice(_GAPS)
    label = rng.choice(_LABELS)
    if kind == "email" and label.endswith("."):
        label += " "  # "no.jo@example.com" is itself an address: no detector can tell
    text += label
    opening, closing = rng.choice(_BRACKETS)
    text += opening
    identifier = identifier or MAKERS[kind](rng)
    start = len(text)
    text += identifier
    end = len(text)
    text += closing + rng.choice(_PUNCTUATION)
    words, after = rng.choice(_AFTER)
    text += words
    if after is not None:
        value = after(rng)
        neighbours.append((len(text), len(text) + len(value)))
        text += value
    text += rng.choice(("", ".", " please.", " Thanks!", "\n"))
    return Sentence(text, kind, start, end, tuple(neighbours))


def neighbours_only(rng: random.Random) -> str:
    """A sentence with order numbers, dates, amounts and quantities beside each other (half of them without
    the words that say what they are, so that their digits run on into each other), and no identifier."""
    parts = []
    for _ in range(rng.randint(2, 5)):
        lead, make = rng.choice(_BEFORE[:-1])
        parts.append((lead if rng.random() < 0.5 else "") + (make(rng) if make else ""))
    return rng.choice(_GAPS).join(parts) + rng.choice(_PUNCTUATION)


def reference_table(rng: random.Random, lines: int) -> str:
    """A table pasted into a ticket, one line per item: two references of four digits, a six-digit one
    ("6907-8262  724231"); its digits run on from line to line."""
    return "\n".join(
        f"{rng.randrange(10**4):04d}-{rng.randrange(10**4):04d}  {rng.randrange(10**6):06d}"
        for _ in range(lines)
    )


# -- measuring -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    found: bool  # a finding of the kind covers the whole identifier
    exact: bool  # ... and is exactly its span
    touched: tuple[str, ...]  # the kinds of the findings that overlap one of the neighbours


def judge(planted: Sentence, findings: Sequence[Finding]) -> Verdict:
    covering = [
        f for f in findings if f.kind == planted.kind and f.start <= planted.start and planted.end <= f.end
    ]
    exact = any(f.start == planted.start and f.end == planted.end for f in covering)
    touched = tuple(
        f.kind for f in findings if any(f.start < end and start < f.end for start, end in planted.neighbours)
    )
    return Verdict(bool(covering), exact, touched)


def ticket_corpora() -> dict[str, list[str]]:
    """The project's own tickets, none holding personal data."""
    corpora: dict[str, list[str]] = {}
    for name in ("test", "train"):
        with (REPO / "data" / "banking77" / f"{name}.csv").open(encoding="utf-8", newline="") as handle:
            corpora[f"BANKING77 {name}"] = [row["text"] for row in csv.DictReader(handle)]
    with (REPO / "worker" / "dev" / "sample_tickets.csv").open(encoding="utf-8", newline="") as handle:
        corpora["worker/dev sample tickets"] = [row["text"] for row in csv.DictReader(handle)]
    lines = (REPO / "data" / "out-of-domain" / "tickets.txt").read_text(encoding="utf-8").splitlines()
    corpora["out-of-domain tickets"] = [line for line in lines if line.strip()]
    return corpora


Find = Callable[[str], Sequence[Finding]]


def tickets_per_second(texts: Sequence[str], finds: Sequence[Find], rounds: int = 5) -> list[float]:
    """Each of `finds` over `texts`, in turn, round after round (so the machine's load falls on each
    alike): tickets per second, the median of `rounds`, one figure per find."""
    times: list[list[float]] = [[] for _ in finds]
    for _ in range(rounds):
        for index, one in enumerate(finds):
            started = time.perf_counter()
            for text in texts:
                one(text)
            times[index].append(time.perf_counter() - started)
    return [len(texts) / statistics.median(taken) for taken in times]


def detector_at(revision: str) -> Find:
    """`find` of worker/privacy/detector.py as it was at git `revision`, loaded beside this one (its
    findings are of its own `Finding` class, alike in fields)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:worker/privacy/detector.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType(f"detector_at_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:worker/privacy/detector.py", "exec"), module.__dict__)
    found: Find = module.find
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.privacy_recall", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--count", type=int, default=20000, help="generated sentences (default 20000)")
    parser.add_argument("--seed", type=int, default=55)
    parser.add_argument("--show", type=int, default=5, help="misses to print per kind")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timing rounds; the median is shown (default 5)"
    )
    parser.add_argument(
        "--detector", metavar="REV", help="measure the detector of git revision REV instead of this tree's"
    )
    parser.add_argument(
        "--against", metavar="REV", help="time the detector of git revision REV too, in the same rounds"
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    measured: Find = detector_at(args.detector) if args.detector else find
    kinds = sorted(MAKERS)
    tally = {kind: [0, 0, 0, 0] for kind in kinds}  # sentences, found, exact, neighbour touched
    touched_by: dict[str, int] = {}
    misses: dict[str, list[str]] = {kind: [] for kind in kinds}
    generated = [sentence(rng, kinds[index % len(kinds)]) for index in range(args.count)]
    for planted in generated:
        verdict = judge(planted, measured(planted.text))
        row = tally[planted.kind]
        row[0] += 1
        row[1] += verdict.found
        row[2] += verdict.exact
        row[3] += bool(verdict.touched)
        for kind in verdict.touched:
            touched_by[kind] = touched_by.get(kind, 0) + 1
        if not verdict.exact and len(misses[planted.kind]) < args.show:
            misses[planted.kind].append(repr(planted.text))
    print(f"detector: {args.detector or 'this tree'}; generated sentences: {args.count}, seed {args.seed}")
    print(f"{'kind':<12} {'sentences':>9} {'found':>8} {'recall':>8} {'exact':>8} {'neighbour hit':>13}")
    for kind in kinds:
        total, found, exact, touched = tally[kind]
        print(
            f"{kind:<12} {total:>9} {found:>8} {100 * found / total:>7.2f}% {100 * exact / total:>7.2f}%"
            f" {touched:>13}"
        )
    hits = ", ".join(f"{kind} {count}" for kind, count in sorted(touched_by.items())) or "none"
    print(f"neighbours (dates, order numbers, amounts, quantities) overlapped, by the finding's kind: {hits}")
    for kind in kinds:
        for text in misses[kind]:
            print(f"  not exact ({kind}): {text}")
    negatives = [neighbours_only(rng) for _ in range(args.count // 4)]
    flagged = [text for text in negatives if measured(text)]
    by_kind: dict[str, int] = {}
    for text in flagged:
        for finding in measured(text):
            by_kind[finding.kind] = by_kind.get(finding.kind, 0) + 1
    kinds_found = ", ".join(f"{kind} {count}" for kind, count in sorted(by_kind.items())) or "none"
    print(
        f"false positives, generated sentences with no identifier: {len(flagged)} of {len(negatives)}"
        f" (findings: {kinds_found})"
    )
    for text in flagged[: args.show]:
        print(f"  flagged: {text!r} -> {measured(text)}")
    table = reference_table(random.Random(args.seed), 3000)
    cards = [f for f in measured(table) if f.kind == "card_number"]
    print(f"false positives, a pasted table of 3,000 lines of reference numbers: {len(cards)} card findings")
    for name, texts in ticket_corpora().items():
        flagged = [text for text in texts if measured(text)]
        print(f"false positives, {name}: {len(flagged)} of {len(texts)} tickets")
        for text in flagged[: args.show]:
            print(f"  flagged: {text!r} -> {measured(text)}")
    finds: list[Find] = [measured]
    names = [args.detector or "this tree"]
    if args.against:
        finds.append(detector_at(args.against))
        names.append(args.against)
    banking_test = ticket_corpora()["BANKING77 test"]
    with_digits = [text for text in banking_test if any(char.isdigit() for char in text)]
    texts = [planted.text for planted in generated[:3000]]
    for label, work in (
        (f"BANKING77 test ({len(banking_test)} tickets)", banking_test),
        (f"BANKING77 test tickets with a digit ({len(with_digits)})", with_digits),
        (f"generated sentences ({len(texts)}, one identifier each)", texts),
    ):
        rates = tickets_per_second(work, finds, args.rounds)
        shown = ", ".join(f"{name} {rate:,.0f}" for name, rate in zip(names, rates, strict=True))
        print(f"speed, {label}: tickets/s {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
