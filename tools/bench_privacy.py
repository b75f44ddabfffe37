"""Measurements behind docs/privacy.md (issue #33): `python -m tools.bench_privacy [--quick]`.

1. False positives: the detector on every BANKING77 text (test and train), which hold no personal data.
2. `inference.redact_input`: the embedded model's accuracy on BANKING77 test as is, with a sentence holding
   an identifier of the generated corpus appended to each ticket, and with that sentence redacted (what the
   model gets with `inference.redact_input = true`).
3. Cost: the detector's time per ticket (corpus tickets, which all hold identifiers, and BANKING77 tickets,
   which hold none), and per triage record for its key and the input headers it carries (W3C trace context
   and a short header of the worker's samples, all scanned), against the worker's own time per ticket,
   measured here as the embedded model's time per ticket in one context (`score`): the smallest share of a
   ticket's cost the worker has, so the ratio is an upper bound of the throughput the detector can take.

Writes results/privacy.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from tools.pii_corpus import card_number, iban, phone, us_ssn
from worker.classification import ClassifyRequest
from worker.inference.engine import GenAIEngine
from worker.learning.evaluation import Example, read_examples, resolve_taxonomy
from worker.privacy.redaction import Redactor
from worker.privacy.values import CarriedMetadata
from worker.settings import DEFAULT_MODEL_DIR, InferenceSettings, PrivacySettings

REPO = Path(__file__).resolve().parents[1]
Item = TypeVar("Item")
DATA = REPO / "data" / "banking77"
_SENTENCES = (
    ("card_number", "My card number is {}.", card_number),
    ("iban", "My IBAN is {}.", iban),
    ("phone", "Call me back on {}.", phone),
    ("us_ssn", "My SSN is {}.", us_ssn),
    ("email", "My email is {}.", lambda _rng: "jane.doe+bank@example.com"),
)


def _accuracy(engine: GenAIEngine, texts: list[str], examples: list[Example]) -> float:
    context = engine.new_context()
    right = 0
    for index, (text, example) in enumerate(zip(texts, examples, strict=True)):
        answer = context.classify(ClassifyRequest(index, text, time.monotonic() + 60.0))
        right += answer.intent == example.intent
    return right / len(texts)


def _headers(rng: random.Random) -> list[tuple[str, bytes | None]]:
    """What a traced record of the worker's samples carries: W3C trace context (random ids, as a tracer's
    are) and the sample's kind."""
    trace, span = f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}"
    return [
        ("traceparent", f"00-{trace}-{span}-01".encode()),
        ("tracestate", f"congo={span}".encode()),
        ("sample.kind", b"ticket"),
    ]


def _per_ticket_s(work: Sequence[Item], run: Callable[[Item], object]) -> float:
    started = time.perf_counter()
    for item in work:
        run(item)
    return (time.perf_counter() - started) / len(work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_privacy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="the first 600 test tickets only")
    parser.add_argument("--out", default=str(REPO / "results" / "privacy.json"))
    args = parser.parse_args(argv)
    redactor = Redactor()
    settings = InferenceSettings(model=str(DEFAULT_MODEL_DIR), escalation=None)
    taxonomy, taxonomy_path = resolve_taxonomy(settings)
    test = read_examples(DATA / "test.csv", taxonomy)
    train = read_examples(DATA / "train.csv", taxonomy)
    flagged = [e.text for e in test + train if redactor.scan(None, e.text).kinds]
    examples = test[:600] if args.quick else test

    rng = random.Random(33)
    with_pii, redacted, kinds = [], [], []
    for example in examples:
        kind, template, make = _SENTENCES[rng.randrange(len(_SENTENCES))]
        text = f"{example.text} {template.format(make(rng))}"
        with_pii.append(text)
        redacted.append(redactor.redact(text))
        kinds.append(kind)
    missed = sum(
        kind not in redactor.scan(None, text).kinds for kind, text in zip(kinds, with_pii, strict=True)
    )

    engine = GenAIEngine(settings, taxonomy, taxonomy_path)
    plain = [e.text for e in examples]
    accuracy = {
        "original": _accuracy(engine, plain, examples),
        "with_identifier": _accuracy(engine, with_pii, examples),
        "with_identifier_redacted": _accuracy(engine, redacted, examples),
    }
    context = engine.new_context()
    sample = plain[:300]
    model_s = _per_ticket_s(sample, lambda t: context.classify(ClassifyRequest(0, t, time.monotonic() + 60)))
    detector_clean_s = _per_ticket_s(plain * 3, lambda t: redactor.scan(None, t))
    detector_pii_s = _per_ticket_s(with_pii * 3, lambda t: redactor.scan(None, t))
    privacy = PrivacySettings()
    carried = CarriedMetadata(privacy.copy_redactor(), privacy.carry_headers)
    records = [(f"customer-{index}".encode(), _headers(rng)) for index in range(len(plain))]
    keys_and_headers_s = _per_ticket_s(
        records, lambda record: (carried.key_is_personal(record[0]), carried.headers(record[1]))
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    result = {
        "command": "python -m tools.bench_privacy" + (" --quick" if args.quick else ""),
        "commit": commit.stdout.strip(),
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "false_positives": {"banking77_texts": len(test) + len(train), "flagged": len(flagged)},
        "redact_input": {
            "tickets": len(examples),
            "identifier_sentences_missed": missed,
            "accuracy": {name: round(value, 4) for name, value in accuracy.items()},
        },
        "cost": {
            "model_ms_per_ticket_one_context": round(model_s * 1000, 3),
            "detector_us_per_ticket_banking77": round(detector_clean_s * 1e6, 1),
            "detector_us_per_ticket_with_identifier": round(detector_pii_s * 1e6, 1),
            "detector_share_of_model_time_banking77": round(detector_clean_s / model_s, 4),
            "detector_share_of_model_time_with_identifier": round(detector_pii_s / model_s, 4),
            "key_and_headers_us_per_record": round(keys_and_headers_s * 1e6, 1),
            "key_and_headers_share_of_model_time": round(keys_and_headers_s / model_s, 4),
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
