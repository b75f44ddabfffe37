"""Issue #55, item 3: personal data where ordinary sentences put it, proved on generated identifiers in
generated contexts (`tools/privacy_recall.py`'s generators), not on a list of strings: Luhn-valid cards of
every brand and length the networks issue, mod-97-valid IBANs of 21 countries, e-mail addresses and phone
numbers, after or before dates in several formats, order numbers, quantities, amounts with their currency,
"no.", "#" and other labels, inside brackets and quotes, their groups split by any run of separators, and
sentence punctuation right after. Found means the whole identifier is redacted; exact means nothing of the
neighbouring date, order number or amount is.

Property tests run derandomized (the same examples on every run, no example database), so the fast tier
never flakes; the seeded tests measure recall over a few thousand sentences, as `python -m
tools.privacy_recall` does over more."""

from __future__ import annotations

import random
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools.privacy_recall import (
    CARD_BRANDS,
    IBAN_COUNTRIES,
    Sentence,
    card_digits,
    card_number,
    iban,
    iban_compact,
    judge,
    neighbours_only,
    sentence,
)
from worker.privacy.detector import Finding, card_valid, find, luhn_valid
from worker.privacy.redaction import Redactor

PROPERTY = settings(
    derandomize=True,
    database=None,
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
randoms = st.randoms(use_true_random=False)


def _digit_groups(text: str, start: int, end: int) -> list[tuple[int, int]]:
    return [(m.start() + start, m.end() + start) for m in re.finditer(r"\d+", text[start:end])]


def _ambiguous(planted: Sentence, finding: Finding) -> bool:
    """Whether the digits a card finding takes beyond the planted card make a card of their own with some of
    the card's groups: "2612 4225 4410 1995 2883" where "2612 4225 4410 1995" passes Luhn and is in an
    issuer's range as much as "4225 4410 1995 2883" does. No detector can tell which is the card; taking
    both is what leaves no card digit in clear."""
    groups = _digit_groups(planted.text, finding.start, finding.end)
    for first in range(len(groups)):
        for last in range(first, len(groups)):
            span = (groups[first][0], groups[last][1])
            digits = "".join(planted.text[a:b] for a, b in groups[first : last + 1])
            beside = span != (planted.start, planted.end) and span[0] < planted.end
            if beside and planted.start < span[1] and card_valid(digits):
                return True
    return False


def _check_exact_or_ambiguous(planted: Sentence) -> None:
    findings = find(planted.text)
    verdict = judge(planted, findings)
    assert verdict.found, (planted.text, planted.identifier, findings)
    if not verdict.exact:
        (finding,) = [f for f in findings if f.start <= planted.start and planted.end <= f.end]
        assert planted.kind == "card_number" and _ambiguous(planted, finding), (planted.text, findings)


# -- the generators make what they say -----------------------------------------------------------------------


@PROPERTY
@given(rng=randoms, brand=st.sampled_from(sorted(CARD_BRANDS)))
def test_generated_cards_are_luhn_valid_and_issued(rng: random.Random, brand: str) -> None:
    digits = card_digits(rng, brand)
    assert luhn_valid(digits) and card_valid(digits), digits
    assert len(digits) in CARD_BRANDS[brand][1]


@PROPERTY
@given(rng=randoms, country=st.sampled_from(sorted(IBAN_COUNTRIES)))
def test_generated_ibans_pass_mod_97_at_their_country_s_length(rng: random.Random, country: str) -> None:
    compact = iban_compact(rng, country)
    assert len(compact) == 4 + len(IBAN_COUNTRIES[country])
    moved = compact[4:] + compact[:4]
    assert int("".join(str(int(char, 36)) for char in moved)) % 97 == 1
    assert [f.kind for f in find(compact)] == ["iban"]


# -- properties: every generated identifier in every generated context -------------------------------------


@PROPERTY
@given(rng=randoms, brand=st.sampled_from(sorted(CARD_BRANDS)))
def test_a_card_of_any_brand_is_found_whole_in_any_context(rng: random.Random, brand: str) -> None:
    """Each brand at each of its lengths, grouped in any way cards are printed and split by any run of
    separators, after or before a date, order number, quantity or amount: redacted whole, and nothing of
    the neighbour with it, unless the neighbour's digits make a card with the card's (`_ambiguous`)."""
    _check_exact_or_ambiguous(sentence(rng, "card_number", card_number(rng, brand)))


@PROPERTY
@given(rng=randoms, country=st.sampled_from(sorted(IBAN_COUNTRIES)))
def test_an_iban_of_any_country_is_found_exactly_in_any_context(rng: random.Random, country: str) -> None:
    planted = sentence(rng, "iban", iban(rng, country))
    verdict = judge(planted, find(planted.text))
    assert verdict.found and verdict.exact, (planted.text, find(planted.text))


@PROPERTY
@given(rng=randoms)
def test_an_email_address_is_found_exactly_in_any_context(rng: random.Random) -> None:
    planted = sentence(rng, "email")
    verdict = judge(planted, find(planted.text))
    assert verdict.found and verdict.exact, (planted.text, find(planted.text))


@PROPERTY
@given(rng=randoms)
def test_the_redacted_card_keeps_its_last_four_and_the_sentence_around_it(rng: random.Random) -> None:
    """What a copy of the ticket holds: the sentence as written, the card replaced by its placeholder."""
    planted = sentence(rng, "card_number")
    findings = find(planted.text)
    if not judge(planted, findings).exact:
        return  # an ambiguous card: test_a_card_of_any_brand_is_found_whole_in_any_context
    last_four = re.sub(r"\D", "", planted.identifier)[-4:]
    expected = f"{planted.text[: planted.start]}[card ••••{last_four}]{planted.text[planted.end :]}"
    redacted = Redactor(detect=["card_number", "iban", "email"]).redact(planted.text)
    assert redacted == expected
    for start, end in planted.neighbours:
        assert planted.text[start:end] in redacted


@PROPERTY
@given(rng=randoms)
def test_dates_amounts_order_numbers_and_quantities_are_no_card_or_iban(rng: random.Random) -> None:
    """Bare numbers beside each other, half of them without their words, so that their digits run on into
    each other: none is taken for a card or an IBAN."""
    text = neighbours_only(rng)
    found = find(text, kinds=frozenset({"card_number", "iban", "us_ssn"}))
    # Two numbers of four digits or more joined by one separator are a card printed in two groups when their
    # digits pass as one ("56159341239 - 1653"): 2 in 5,000 of these sentences (docs/privacy.md's
    # figure, python -m tools.privacy_recall), none among the derandomized examples.
    assert found == [], (text, found)


# -- recall over seeded sentences (the acceptance figures) ---------------------------------------------------


def _recall(kind: str, count: int, seed: int) -> tuple[float, float, int]:
    rng = random.Random(seed)
    found = exact = touched = 0
    for _ in range(count):
        planted = sentence(rng, kind)
        verdict = judge(planted, find(planted.text))
        found += verdict.found
        exact += verdict.exact
        touched += kind in verdict.touched
    return found / count, exact / count, touched


def test_cards_in_ordinary_sentences_recall_at_least_99_5_percent() -> None:
    found, exact, touched = _recall("card_number", 2000, seed=5501)
    assert found >= 0.995 and exact >= 0.995 and touched <= 2, (found, exact, touched)


def test_ibans_in_ordinary_sentences_recall_at_least_99_5_percent() -> None:
    found, exact, touched = _recall("iban", 1500, seed=5502)
    assert found >= 0.995 and exact >= 0.995 and touched == 0, (found, exact, touched)


def test_emails_and_phones_in_ordinary_sentences() -> None:
    assert _recall("email", 500, seed=5503) == (1.0, 1.0, 0)
    found, exact, _ = _recall("phone", 300, seed=5504)
    assert found >= 0.97 and exact >= 0.96, (found, exact)


# -- the issue's own sentences -------------------------------------------------------------------------------


def test_the_sentences_of_issue_55_are_redacted_whole_and_only_the_card() -> None:
    redactor = Redactor()
    assert redactor.redact("On 2026-01-06 6011 6565 1606 1135 was charged twice") == (
        "On 2026-01-06 [card ••••1135] was charged twice"
    )
    assert redactor.redact("Order 26 4225 4410 1995 2883") == "Order 26 [card ••••2883]"
