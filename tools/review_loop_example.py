"""The review loop's measured example: corrections of the embedded model's most confused intent pair, and
what a fine-tune on them does (docs/review-loop.md).

    .venv/bin/python -m tools.review_loop_example --out /tmp/review-example

1. Classify BANKING77 test.csv with the model; find the pair of intents it confuses most (errors both ways).
2. Write a feedback file: every test ticket of that pair as a FeedbackEvent with its BANKING77 label, the
   model's answer as `model_intent` (what reviewers working through those tickets would write).
3. Run `triage-worker model train --feedback FILE --holdout 0.5`: half of the pair's tickets (per intent) are
   trained on, half held out; the model card gives the pair's held-out accuracy and BANKING77 test accuracy
   (the trained-on tickets left out) before and after, and the time taken.

Needs only the runtime dependencies; seeded, so a rerun on the same model gives the same figures.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from tools import REPO
from worker.learning.evaluation import read_examples
from worker.learning.fine_tune import Featurizer
from worker.messages import FeedbackEvent, utc_timestamp


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO / "models" / "triage-mini")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "banking77")
    parser.add_argument("--out", type=Path, required=True, help="folder for the feedback file and the model")
    parser.add_argument("--pair", help="two intents, comma-separated (default: the most confused pair)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    featurizer = Featurizer(args.model)
    test = [(e.text, e.intent) for e in read_examples(args.data / "test.csv", featurizer.engine.taxonomy)]
    started = time.monotonic()
    decided = featurizer.decide([text for text, _ in test])
    print(f"classified {len(test)} test tickets in {time.monotonic() - started:.0f} s", flush=True)
    if args.pair:
        pair = tuple(args.pair.split(","))
    else:
        confused: collections.Counter[tuple[str, ...]] = collections.Counter()
        for (_, truth), answer in zip(test, decided, strict=True):
            if truth != answer:
                confused[tuple(sorted((truth, answer)))] += 1
        pair, errors = confused.most_common(1)[0]
        print(f"most confused pair: {pair[0]} / {pair[1]} ({errors} errors on test.csv)")
    feedback = args.out / "feedback.jsonl"
    with feedback.open("wb") as handle:
        for number, ((text, truth), answer) in enumerate(zip(test, decided, strict=True)):
            if truth in pair:
                event = FeedbackEvent(
                    ticket_id=f"test-{number}",
                    intent=truth,
                    text=text,
                    model_intent=answer,
                    reviewer="banking77",
                    reviewed_at=utc_timestamp(),
                )
                handle.write(msgspec.json.encode(event) + b"\n")
    command = [
        sys.executable, "-m", "worker", "model", "train", "--feedback", str(feedback),
        "--model", str(args.model), "--data", str(args.data), "--out", str(args.out / "model"),
        "--holdout", "0.5",
    ]  # fmt: skip
    print("running:", " ".join(command[1:]), f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    done = subprocess.run(command, cwd=REPO, check=False)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
