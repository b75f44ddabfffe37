"""The broker compatibility matrix (`make test-brokers`): the broker-backed accounting tests against each
Kafka release the project supports, one local broker per release; results/brokers.md and brokers.json.

    .venv/bin/python -m tools.broker_matrix [--versions 3.9.2 4.1.1 4.4.0] [--out results]

For each release its jars are resolved first (outside the timing), then one pytest session runs the tests
SELECTION picks with TRIAGE_KAFKA_VERSION=<release> and TRIAGE_TEST_BROKER=local, so tests/conftest.py starts
that release on a free port (a KAFKA_BOOTSTRAP_SERVERS or TRIAGE_KAFKA_HOME in the environment is dropped:
either would run some other broker). The tests: kill -9 at random points, a broker restart and a second
worker joining and leaving mid-stream, each with both guarantees (their cascade variants are left out: the
cascade adds model work, not broker work), the Kafka seam's contract suite and the local broker's restart
test.

A row counts passed, failed and skipped tests from pytest's JUnit XML, and checks the release the session's
broker announced against the one asked for. Releases run one after another (the machine has 2 cores).
Exits 1 when a release had a failure, ran no test, or ran another release than asked for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.promises import progress
from worker.dev.local_broker import KAFKA_VERSION, KAFKA_VERSION_ENV, fetch_jars, parse_kafka_version

REPO = Path(__file__).resolve().parents[1]
# The newest 3.x (the last line with ZooKeeper, which many clusters still run), the default, the newest 4.x.
SUPPORTED_VERSIONS = ("3.9.2", "4.1.1", KAFKA_VERSION)
# Kill -9, broker restart and rebalance (each guarantee once), the whole contract suite (its kafka half, by
# -m), and the local broker's restart test.
SELECTION = "kill_9 or broker_restart or joins_and_leaves or kafka_contract or restart_on_the_same_log_dir"
TEST_FILES = (
    "tests/pipeline/test_pipeline_e2e.py",
    "tests/kafka/test_kafka_contract.py",
    "tests/dev/test_local_broker.py",
)
PYTEST_ARGS = ("-p", "no:cacheprovider", "-m", "kafka", "-rfE", "-k", SELECTION, *TEST_FILES)


@dataclass(frozen=True)
class Row:
    version: str
    passed: int
    failed: int
    skipped: int
    seconds: float
    exit_code: int
    announced: str  # the session's "[kafka] ..." line: which broker the tests really met
    failures: tuple[str, ...]  # pytest's short summary lines (FAILED/ERROR ...)
    skips: tuple[str, ...] = ()  # "test: why", so that a skip is read, not just counted

    @property
    def met_the_release(self) -> bool:
        return f"Kafka {self.version} broker" in self.announced

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.failed == 0 and self.passed > 0 and self.met_the_release


def environment_for(version: str, environ: dict[str, str]) -> dict[str, str]:
    """The pytest session's environment: the local broker of `version`, whatever the caller's names."""
    env = {
        key: value
        for key, value in environ.items()
        if key not in ("KAFKA_BOOTSTRAP_SERVERS", "TRIAGE_KAFKA_HOME")
    }
    return {**env, KAFKA_VERSION_ENV: version, "TRIAGE_TEST_BROKER": "local"}


def shown_command(version: str) -> str:
    """What one row ran, as a person would type it in the repository (python: the project's venv)."""
    return f"{KAFKA_VERSION_ENV}={version} TRIAGE_TEST_BROKER=local " + shlex.join(
        ["python", "-m", "pytest", *PYTEST_ARGS]
    )


def count_outcomes(junit_xml: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) from pytest's JUnit XML; an error (setup, teardown) counts as failed."""
    failed: set[str] = set()
    skipped: set[str] = set()
    seen: set[str] = set()
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        seen.add(name)  # a test with a teardown error appears twice: once is enough
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is not None:
            skipped.add(name)
    skipped -= failed
    return len(seen - failed - skipped), len(failed), len(skipped)


def skip_reasons(junit_xml: Path) -> tuple[str, ...]:
    reasons: dict[str, None] = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            reasons[f"{case.get('name')}: {skipped.get('message')}"] = None
    return tuple(reasons)


def run_release(version: str, logs: Path) -> Row:
    fetch_jars(version=version, echo=progress)
    log, junit_xml = logs / f"pytest-{version}.log", logs / f"pytest-{version}.xml"
    progress(f"Kafka {version}: pytest, log {log}")
    started = time.monotonic()
    with log.open("w") as output:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", f"--junitxml={junit_xml}", *PYTEST_ARGS],
            cwd=REPO,
            env=environment_for(version, dict(os.environ)),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            check=False,
        )
    seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    passed, failed, skipped = count_outcomes(junit_xml) if junit_xml.is_file() else (0, 0, 0)
    announced = re.search(r"^\[kafka\] (.*)$", text, re.MULTILINE)
    failures = tuple(line for line in text.splitlines() if re.match(r"(FAILED|ERROR) ", line))
    row = Row(
        version,
        passed,
        failed,
        skipped,
        round(seconds, 1),
        done.returncode,
        announced.group(1) if announced else "(no broker announced)",
        failures,
        skip_reasons(junit_xml) if junit_xml.is_file() else (),
    )
    verdict = "pass" if row.ok else "FAIL"
    progress(
        f"Kafka {version}: {verdict}, {passed} passed, {failed} failed, {skipped} skipped in {seconds:.0f}s"
    )
    return row


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def render(rows: list[Row], when: str, load: str) -> str:
    lines = [
        "# Broker compatibility matrix",
        "",
        f"`make test-brokers` (tools/broker_matrix.py), {when}, on {os.cpu_count()} cores (load average "
        f"{load} at the start): the broker-backed accounting tests, one local broker per Kafka release "
        "started from its Maven Central jars, releases one after another.",
        "",
        "| Kafka | passed | failed | skipped | time | result |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        verdict = "pass" if row.ok else "**fail**"
        if not row.met_the_release:
            verdict += " (the session met another broker)"
        counts = f"{row.passed} | {row.failed} | {row.skipped}"
        lines.append(f"| {row.version} | {counts} | {_minutes(row.seconds)} | {verdict} |")
    lines += ["", "Each release ran, from the repository root:", ""]
    lines += [f"    {shown_command(row.version)}" for row in rows]
    lines += [
        "",
        "Tests: kill -9 at random points, a broker restart on the same data, a second worker joining and",
    ]
    lines += [
        "leaving mid-stream, each with both guarantees; the Kafka seam's contract suite; the local broker's"
    ]
    lines += ["restart test. The broker each session met:", ""]
    lines += [f"- {row.version}: {row.announced}" for row in rows]
    skipping = [row for row in rows if row.skips]
    if skipping:
        lines += ["", "## Skipped", ""]
        lines += [f"- {row.version}: {reason}" for row in skipping for reason in row.skips]
    failing = [row for row in rows if row.failures]
    if failing:
        lines += ["", "## Failures", ""]
        for row in failing:
            lines += [f"Kafka {row.version}:", "", *(f"    {line}" for line in row.failures), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=list(SUPPORTED_VERSIONS), metavar="VERSION")
    parser.add_argument("--out", type=Path, default=REPO / "results")
    parser.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="where each release's pytest log and JUnit XML go (a temp dir)",
    )
    args = parser.parse_args(argv)
    versions = [parse_kafka_version(version, "--versions") for version in args.versions]
    logs: Path = args.logs or Path(tempfile.mkdtemp(prefix="triage-broker-matrix-"))
    logs.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    rows = [run_release(version, logs) for version in versions]

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "brokers.md").write_text(render(rows, when, load))
    record = {
        "when": when,
        "load_average": load,
        "selection": SELECTION,
        "rows": [{**asdict(row), "ok": row.ok, "command": shown_command(row.version)} for row in rows],
    }
    (args.out / "brokers.json").write_text(json.dumps(record, indent=2) + "\n")
    progress(f"wrote {args.out / 'brokers.md'} and brokers.json (pytest logs in {logs})")
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
