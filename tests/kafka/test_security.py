"""SASL_SSL (SCRAM-SHA-512 over TLS) against the real broker: every command works with configuration only,
a refused login or an untrusted certificate stops it at start in one line, and the password shows nowhere.

The broker is the `secure_broker` fixture: `triage-worker broker start --sasl-ssl-port`, whose client
settings file (`--config`) or the same options as `KAFKA_*` variables are all a command gets. Checks on
the topics go through the broker's PLAINTEXT listener, so they never depend on what is under test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import SecureBroker

from tools import REPO
from tools.harness import TINY_MODEL, Topics, Worker, audit, end_offsets, wait_until_committed
from worker.dev import local_broker
from worker.errors import UserError
from worker.kafka.admin import check_cluster

pytestmark = pytest.mark.kafka

# A command that checks its connection first must give up long before librdkafka's own timeouts.
START_FAILURE_S = 20.0


def _env_config(config: dict[str, str]) -> dict[str, str]:
    """The client settings as the `KAFKA_*` variables a deployment would set."""
    return {"KAFKA_" + key.upper().replace(".", "_"): value for key, value in config.items()}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "TRIAGE_"))}
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


def _assert_ok_and_secret_free(result: subprocess.CompletedProcess[str], password: str) -> None:
    assert result.returncode == 0, result.stderr
    assert password not in result.stdout + result.stderr


def _topic_env(topics: Topics) -> dict[str, str]:
    return {
        "TRIAGE_TOPICS__INPUT": topics.input,
        "TRIAGE_TOPICS__OUTPUT": topics.output,
        "TRIAGE_TOPICS__DEAD_LETTER": topics.dead_letter,
        "TRIAGE_TOPICS__PARTITIONS": "2",
    }


def test_config_show_masks_the_password_from_file_and_environment(secure_broker: SecureBroker) -> None:
    from_file = _cli("config", "show", "--config", str(secure_broker.client_file))
    from_env = _cli("config", "show", env=_env_config(secure_broker.client_config))

    for result in (from_file, from_env):
        _assert_ok_and_secret_free(result, secure_broker.password)
        assert '"sasl.password" = "***"' in result.stdout
        assert '"sasl.username" = "triage"' in result.stdout


def test_topics_samples_worker_and_replay_work_through_sasl_ssl(
    secure_broker: SecureBroker, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(f"sec.raw.{suffix}", f"sec.triaged.{suffix}", f"sec.dlq.{suffix}")
    password, plain = secure_broker.password, secure_broker.plain_bootstrap
    by_env = {**_env_config(secure_broker.client_config), **_topic_env(topics)}
    by_file = ("--config", str(secure_broker.client_file))

    created = _cli("topics", "create", env=by_env)
    _assert_ok_and_secret_free(created, password)
    assert f"{topics.input}: created (partitions=2, replication_factor=1)" in created.stdout

    samples = ("--count", "16", "--rate", "0", "--malformed-ratio", "0.25", "--seed", "5")
    published = _cli("produce-samples", *by_file, *samples, env=_topic_env(topics))
    _assert_ok_and_secret_free(published, password)
    counted = re.search(r"published 16 records to \S+ \((\d+) malformed", published.stderr)
    assert counted is not None, published.stderr
    malformed = int(counted[1])
    assert malformed > 0

    group = f"triage-sec-{suffix}"
    worker = Worker(secure_broker.bootstrap, topics, group, tmp_path, args=by_file)
    try:
        worker.wait_for("pipeline_started", timeout=90)
        wait_until_committed(plain, group, topics.input, timeout=120, worker=worker)
        assert worker.stop() == 0
    finally:
        worker.kill()
    assert password not in worker.log_path.read_text(errors="replace")
    assert worker.events("settings")[0]["kafka"]["sasl.password"] == "***"
    report = audit(plain, topics)
    assert report.lost == [] and report.misrouted == [], report.summary()
    assert sum(map(len, report.dead.values())) == malformed

    dry_run = _cli("replay", "--from-beginning", "--dry-run", "--json", env=by_env)
    _assert_ok_and_secret_free(dry_run, password)
    would = json.loads(dry_run.stdout)["would_replay"]
    assert len(would) == malformed

    before = sum(end_offsets(plain, topics.input).values())
    first = f"{would[0]['partition']}:{would[0]['offset']}"
    replayed = _cli("replay", "--offsets", first, "--json", *by_file, env=_topic_env(topics))
    _assert_ok_and_secret_free(replayed, password)
    assert json.loads(replayed.stdout)["counts"]["replayed"] == 1
    assert sum(end_offsets(plain, topics.input).values()) == before + 1

    # The broker got a salted credential at format time, and SCRAM never sends the password itself.
    state_dir = secure_broker.client_file.parent
    for path in [state_dir / "server.properties", *(state_dir / "logs").iterdir()]:
        assert password not in path.read_text(errors="replace"), path


@pytest.fixture(scope="module")
def foreign_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that did not sign the broker's certificate."""
    directory = tmp_path_factory.mktemp("foreign-tls")
    local_broker.generate_tls(directory)
    return directory / "ca.pem"


COMMANDS = {
    "topics create": ("topics", "create"),
    "produce-samples": ("produce-samples", "--count", "1"),
    "run": ("run", "--model", str(TINY_MODEL)),
    "replay": ("replay", "--from-beginning", "--dry-run"),
}


def _the_one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """stderr without the worker's start-up `settings` and `cascade_off` events and the notice of a slow
    connection (printed when the broker has not answered within half a second) must be exactly one line."""
    lines = [
        line
        for line in result.stderr.splitlines()
        if not re.search(r"\] (settings|cascade_off|waiting_for_kafka) |^waiting for Kafka at ", line)
    ]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_wrong_password_stops_the_command_at_start_in_one_line(
    secure_broker: SecureBroker, command: str
) -> None:
    wrong = f"not-{secure_broker.password}"
    started = time.monotonic()
    result = _cli(
        *COMMANDS[command], "--config", str(secure_broker.client_file), env={"KAFKA_SASL_PASSWORD": wrong}
    )

    assert time.monotonic() - started < START_FAILURE_S
    assert result.returncode == 2
    assert _the_one_error_line(result) == (
        f"triage-worker: error: authentication failed for user 'triage' (SASL/SCRAM-SHA-512) at "
        f"{secure_broker.bootstrap}: SASL authentication error: Authentication failed during authentication "
        "due to invalid credentials with SASL mechanism SCRAM-SHA-512"
    )
    assert wrong not in result.stdout + result.stderr
    assert secure_broker.password not in result.stdout + result.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_untrusted_certificate_stops_the_command_at_start_in_one_line(
    secure_broker: SecureBroker, foreign_ca: Path, command: str
) -> None:
    env = {**_env_config(secure_broker.client_config), "KAFKA_SSL_CA_LOCATION": str(foreign_ca)}
    started = time.monotonic()
    result = _cli(*COMMANDS[command], env=env)

    assert time.monotonic() - started < START_FAILURE_S
    assert result.returncode == 2
    assert re.fullmatch(
        rf"triage-worker: error: TLS handshake with {re.escape(secure_broker.bootstrap)} failed "
        rf"\(trusting {re.escape(str(foreign_ca))}\): .*certificate verify failed.*",
        _the_one_error_line(result),
    )
    assert secure_broker.password not in result.stdout + result.stderr


def test_refusal_exceptions_carry_no_secret_even_when_typed_in_the_wrong_field(
    secure_broker: SecureBroker,
) -> None:
    """A password pasted into sasl.username would be echoed by the "failed for user" line: it is masked."""
    password = secure_broker.password
    config = {**secure_broker.client_config, "sasl.username": password}

    with pytest.raises(UserError) as raised:
        check_cluster(config, timeout_s=10)

    assert "authentication failed for user '***'" in str(raised.value)
    assert password not in str(raised.value) + repr(raised.value)
    assert raised.value.__cause__ is None and raised.value.__context__ is None
    assert password not in repr(local_broker.SaslSsl(9093, {"triage": password}))


def test_sasl_options_without_a_sasl_protocol_get_librdkafkas_hint(secure_broker: SecureBroker) -> None:
    config = {**secure_broker.client_config, "security.protocol": "PLAINTEXT"}

    with pytest.raises(UserError) as raised:
        check_cluster(config, timeout_s=3)

    assert str(raised.value).startswith(f"cannot reach Kafka at {secure_broker.bootstrap}: ")
    assert "recommend setting `security.protocol` to SASL_SSL or SASL_PLAINTEXT" in str(raised.value)
