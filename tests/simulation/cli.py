"""The simulator's command line.

    PYTHONPATH=tests python -m simulation --door all --seeds 100000      # the soak (make simulate)
    PYTHONPATH=tests python -m simulation --door queue --seed 1234 -v    # one seed: schedule and log
    PYTHONPATH=tests python -m simulation -v --schedule '{"door": ...}'  # a schedule a failure printed

A sweep prints each new failure (door, seed, the violations, a shrunk schedule, the replay command) and a
line per door; it exits 1 when it found a failure that is not a known defect (`runner.KNOWN`).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

from .checks import Violation
from .harness import HARNESSES
from .runner import KNOWN, failure_report, known, replay_command, shrink, sweep, unknown
from .schedule import DOORS, Schedule, generate


def main(argv: list[str]) -> int:
    prog = "PYTHONPATH=tests python -m simulation"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--door", default="all", choices=("all", *DOORS))
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds per door (from --start)")
    parser.add_argument("--start", type=int, default=0, help="the first seed of a sweep")
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument(
        "--schedule", help="replay this schedule (the JSON a failure prints for its minimal one)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="with --seed: the schedule and the log")
    parser.add_argument("--no-shrink", action="store_true", help="print failing schedules whole")
    args = parser.parse_args(argv)
    doors = DOORS if args.door == "all" else (args.door,)
    if args.schedule is not None:
        return _replay_one(Schedule.from_json(args.schedule), args.verbose)
    if args.seed is not None:
        return _replay(doors, args.seed, args.verbose)
    _quiet_logs()
    failed = False
    for door in doors:

        def report(seed: int, violations: list[Violation], door: str = door) -> None:
            schedule = generate(door, seed)
            shrunk = None if args.no_shrink else shrink(schedule, violations[0].prop)
            print(failure_report(schedule, violations, shrunk), flush=True)

        found = sweep(door, range(args.start, args.start + args.seeds), report)
        failed = failed or bool(found.failures)
        per_run_ms = 1000.0 * found.seconds / max(1, found.runs)
        print(
            f"{door}: {found.runs} schedules in {found.seconds:.1f} s ({per_run_ms:.1f} ms each), "
            f"{len(found.failures)} failing",
            flush=True,
        )
        for what, count in sorted(found.known.items()):
            print(f"  known ({count} times, first seed {found.first_known[what]}): {what}")
    return 1 if failed else 0


def _replay(doors: tuple[str, ...], seed: int, verbose: bool) -> int:
    failed = [_replay_one(generate(door, seed), verbose) for door in doors]
    return max(failed)


def _replay_one(schedule: Schedule, verbose: bool) -> int:
    door, seed = schedule.door, schedule.seed
    harness = HARNESSES[door](schedule)
    if verbose:
        print(schedule.describe())
        print("log (virtual seconds since the start):")
        _log_on(harness.clock)
    else:
        _quiet_logs()
    began = time.perf_counter()
    violations = harness.run()
    took = time.perf_counter() - began
    print(
        f"{door} seed {seed}: {len(violations)} violation(s), {harness.workers} worker(s), "
        f"{harness.clock.elapsed:.2f} virtual s in {took * 1000:.0f} ms"
    )
    for violation in violations:
        defect = known(door, violation)
        print(f"  - {violation.describe()}" + (f"  [known: {defect.what}]" if defect else ""))
    if violations and not verbose:
        print(f"  replay: {replay_command(door, seed)}")
    return 1 if unknown(door, violations) else 0


def _quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def _log_on(clock: Any) -> None:
    def render(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> str:
        message = event.pop("event", "")
        fields = " ".join(f"{key}={value}" for key, value in event.items() if key not in ("level", "logger"))
        return f"  {clock.elapsed:9.4f}  {message} {fields}"

    structlog.configure(
        processors=[structlog.processors.add_log_level, render],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(),
    )


__all__ = ["KNOWN", "main"]
