"""The broker matrix's plumbing (tools/broker_matrix.py, `make test-brokers`), without Java: which releases
it runs, what each pytest session is told, and how a row is counted. The matrix itself is the slow proof."""

from __future__ import annotations

import re
from pathlib import Path

import kafka_source
import pytest

from tools import REPO, broker_matrix
from worker.dev import local_broker


def test_the_makefile_runs_the_supported_releases_and_the_default_among_them() -> None:
    makefile = (REPO / "Makefile").read_text()
    listed = re.search(r"^BROKER_VERSIONS \?= (.+)$", makefile, re.MULTILINE)
    assert listed is not None
    assert tuple(listed.group(1).split()) == broker_matrix.SUPPORTED_VERSIONS
    assert local_broker.KAFKA_VERSION in broker_matrix.SUPPORTED_VERSIONS
    for version in broker_matrix.SUPPORTED_VERSIONS:
        assert local_broker.parse_kafka_version(version) == version
    # CI's time is tight: the matrix is its own target, never a part of `make test`.
    test_target = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "test-brokers" not in test_target and "broker_matrix" not in test_target


def test_each_session_gets_the_local_broker_of_its_release() -> None:
    caller = {
        "KAFKA_BOOTSTRAP_SERVERS": "elsewhere:9092",
        "TRIAGE_KAFKA_HOME": "/one/release/only",
        "TRIAGE_KAFKA_VERSION": "4.1.1",
        "PATH": "/usr/bin",
    }

    env = broker_matrix.environment_for("3.9.2", caller)

    assert env == {"TRIAGE_KAFKA_VERSION": "3.9.2", "TRIAGE_TEST_BROKER": "local", "PATH": "/usr/bin"}
    assert broker_matrix.shown_command("3.9.2").startswith(
        "TRIAGE_KAFKA_VERSION=3.9.2 TRIAGE_TEST_BROKER=local python -m pytest"
    )


def test_the_container_image_follows_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIAGE_KAFKA_IMAGE", raising=False)
    monkeypatch.setenv("TRIAGE_KAFKA_VERSION", "4.4.0")

    assert kafka_source.kafka_image() == "apache/kafka:4.4.0"


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
<testcase classname="tests.test_a" name="test_passes"/>
<testcase classname="tests.test_a" name="test_fails"><failure message="boom"/></testcase>
<testcase classname="tests.test_a" name="test_skips"><skipped message="no local broker"/></testcase>
<testcase classname="tests.test_a" name="test_teardown_errs"/>
<testcase classname="tests.test_a" name="test_teardown_errs"><error message="teardown"/></testcase>
</testsuite></testsuites>
"""


def test_a_row_counts_each_test_once_and_a_teardown_error_as_a_failure(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)

    assert broker_matrix.count_outcomes(junit) == (1, 2, 1)
    assert broker_matrix.skip_reasons(junit) == ("test_skips: no local broker",)


def _row(version: str, announced: str, failed: int = 0) -> broker_matrix.Row:
    return broker_matrix.Row(version, 21 - failed, failed, 0, 400.0, 1 if failed else 0, announced, ())


def test_a_row_passes_only_when_every_test_passed_against_the_release_asked_for() -> None:
    assert _row("4.4.0", "Kafka 4.4.0 broker came up from the Maven-resolved jars").ok
    assert not _row("4.4.0", "Kafka 4.4.0 broker came up", failed=1).ok
    assert not _row("4.4.0", "Kafka 4.1.1 broker came up from the Maven-resolved jars").ok
    assert not _row("4.4.0", "using the broker given by KAFKA_BOOTSTRAP_SERVERS=x").ok

    wrong_broker = _row("4.4.0", "Kafka 4.1.1 broker came up")
    skipping = broker_matrix.Row("3.9.2", 20, 0, 1, 61.0, 0, "Kafka 3.9.2 broker", (), ("test_x: why",))
    table = broker_matrix.render([wrong_broker, skipping], "now", "1.0")
    assert "| 4.4.0 | 21 | 0 | 0 | 6 min 40 s | **fail** (the session met another broker) |" in table
    assert "| 3.9.2 | 20 | 0 | 1 | 1 min 01 s | pass |" in table
    assert "- 3.9.2: test_x: why" in table
