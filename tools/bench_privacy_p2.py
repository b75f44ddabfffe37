"""The detector's share of the worker's end-to-end throughput (issue #33): P2's worker measurement (`make
bench`, tools/bench/p2_inference_overhead.py) on one local broker, alternating the detector off
(`privacy.detect=[]`, `inference.redact_input=false`) and on (the defaults), same code, in ABBA order.

`python -m tools.bench_privacy_p2 [--tickets 2000] [--rounds 4]` writes results/privacy-p2.json: each run's
tickets/s and the worker tree's CPU ms per ticket, and the totals of each side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tools.bench.measure import progress
from tools.bench.worker_modes import compare
from tools.load import Tickets, kafka
from worker.logs import configure_logging
from worker.settings import LogSettings, PrivacySettings

REPO = Path(__file__).resolve().parents[1]
MODES = {"off": ["--set", "privacy.detect=", "--set", "inference.redact_input=false"], "on": []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_privacy_p2", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tickets", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "results" / "privacy-p2.json"))
    args = parser.parse_args(argv)
    configure_logging(LogSettings(level="warning"), PrivacySettings())
    tickets = Tickets()
    with tempfile.TemporaryDirectory() as tmp, kafka(progress) as bootstrap:
        measured = compare(bootstrap, tickets, args.tickets, args.rounds, MODES, Path(tmp), "privacy")
    totals = measured["totals"]
    result = {
        "command": "python -m tools.bench_privacy_p2 " + " ".join(sys.argv[1:] if argv is None else argv),
        **measured,
        "rate_on_over_off": round(totals["on"]["rate"] / totals["off"]["rate"], 3),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
