"""Shared fixtures: one real Kafka broker per test session, and uniquely named topics per test.

The broker comes from, in order (tests/kafka_source.py decides; `TRIAGE_TEST_BROKER` insists on one):
`KAFKA_BOOTSTRAP_SERVERS` (a broker you already run), a container that testcontainers starts when a Docker
API answers (`TRIAGE_KAFKA_IMAGE`, default apache/kafka:4.4.0, set up like the compose file's broker), else
the project's own local broker (`worker/dev/local_broker.py`: Apache Kafka from Maven-resolved jars) on a
free port with a fresh log dir, stopped when the session ends. The same tests run against any of the three.
`TRIAGE_KAFKA_VERSION=3.9.2` runs another release (the local broker's jars, the default image's tag); `make
test-brokers` (tools/broker_matrix.py) runs the accounting tests so against each supported release.

Queue mode's tests need share groups (Kafka >= 4.2): `share_group_bootstrap` is
`KAFKA_SHARE_BOOTSTRAP_SERVERS` when set, else the session's local broker when its release has them (the
default, 4.4.0, does), else a second local broker, Kafka 4.4.0, started once for the session.

Tests that name a Schema Registry share one: `schema_registry`, a local in-memory Apicurio Registry started
once for the session (each test registers its own subjects, so the tests do not see each other's schemas).
"""

from __future__ import annotations

import os
import shutil
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import kafka_source
import pytest
import yaml
from testcontainers.core.container import DockerContainer
from testcontainers.core.wait_strategies import LogMessageWaitStrategy

from tools.harness import wait_until_served
from worker.dev import local_broker
from worker.dev.local_registry import LocalRegistry
from worker.kafka.admin import TopicSpec, create_topics


@dataclass
class _BrokerSource:
    description: str = ""
    local: local_broker.LocalBroker | None = None


_SOURCE = _BrokerSource()
REPO = Path(__file__).resolve().parents[1]


def _start_kafka_container(image: str) -> tuple[DockerContainer, str]:
    """One KRaft node in a container, with the compose file's broker settings (apache/kafka's KAFKA_*
    environment) and its client listener published on a free host port, advertised as such."""
    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yml").read_text())
    environment = {key: str(value) for key, value in compose["services"]["kafka"]["environment"].items()}
    container = DockerContainer(image)
    host, port = container.get_docker_client().host(), local_broker.free_port()
    # Clients reach PLAINTEXT through the published port; the broker reaches itself on INTERNAL.
    environment["KAFKA_ADVERTISED_LISTENERS"] = f"PLAINTEXT://{host}:{port},INTERNAL://localhost:19092"
    for key, value in environment.items():
        container.with_env(key, value)
    container.with_bind_ports(9092, port)
    container.waiting_for(LogMessageWaitStrategy(local_broker.READY_LINE).with_startup_timeout(180))
    container.start()
    return container, f"{host}:{port}"


def _announce(config: pytest.Config, line: str) -> None:
    _SOURCE.description = line
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # fixture setup output is captured otherwise
            reporter.write_line(f"\n[kafka] {line}")


@pytest.fixture(scope="session")
def kafka_bootstrap(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Bootstrap servers (`host:port`) of a real Kafka broker shared by the whole session."""
    source = kafka_source.choose()
    if source == "given":
        given = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        _announce(request.config, f"using the broker given by KAFKA_BOOTSTRAP_SERVERS={given}")
        yield given
        return

    if source == "container":
        image = kafka_source.kafka_image()
        started = time.monotonic()
        container, bootstrap = _start_kafka_container(image)
        try:
            _announce(
                request.config,
                f"broker came up in a container via testcontainers ({image}) at {bootstrap} "
                f"in {time.monotonic() - started:.1f}s",
            )
            yield bootstrap
        finally:
            container.stop()
        return

    broker = local_broker.LocalBroker(tmp_path_factory.mktemp("kafka-broker"), port=local_broker.free_port())
    started = time.monotonic()
    broker.start(fresh=True, echo=lambda _line: None)
    _SOURCE.local = broker
    _announce(
        request.config,
        f"Kafka {broker.kafka_version} broker came up from the Maven-resolved jars at "
        f"{local_broker.jars_dir(broker.home)} on {broker.bootstrap} in {time.monotonic() - started:.1f}s "
        f"(log {broker.log_file})",
    )
    try:
        yield broker.bootstrap
    finally:
        broker.stop()
        _SOURCE.local = None


@pytest.fixture(scope="session")
def local_kafka_broker(kafka_bootstrap: str) -> local_broker.LocalBroker:
    """The session's broker when it is the project's local one, for tests that stop and restart it.

    Skips when the session uses an external broker or a container, which tests must not stop.
    """
    if _SOURCE.local is None:
        pytest.skip("needs the project's local broker (the session uses an external broker or a container)")
    return _SOURCE.local


@dataclass(frozen=True)
class SecureBroker:
    """A second local broker with a SASL_SSL listener, from `triage-worker broker start --sasl-ssl-port`.

    `client_file` is the TOML `[kafka]` table that command wrote (SCRAM-SHA-512 user, password, CA file);
    `plain_bootstrap` is its PLAINTEXT listener, for test checks that need no credentials.
    """

    plain_bootstrap: str
    client_file: Path
    client_config: dict[str, str]

    @property
    def bootstrap(self) -> str:
        return self.client_config["bootstrap.servers"]

    @property
    def password(self) -> str:
        return self.client_config["sasl.password"]


@pytest.fixture(scope="session")
def secure_broker(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    """SASL_SSL on the project's local broker (certificates made at start, gone with the temp dir).

    Skips where the session's broker is given or runs in a container: starting a second, local one needs the
    Java runtime and Maven-resolved jars those machines may not have.
    """
    if _SOURCE.local is None:
        pytest.skip("SASL/TLS tests start a second local broker; this session uses another broker")
    from worker.cli import broker_command
    from worker.cli.cli import main

    state_dir = tmp_path_factory.mktemp("kafka-secure")
    port, secure_port = local_broker.free_port(), local_broker.free_port()
    start = ["broker", "start", "--fresh", "--state-dir", str(state_dir), "--port", str(port)]
    assert main([*start, "--sasl-ssl-port", str(secure_port)]) == 0
    try:
        client_file = state_dir / broker_command.SASL_CLIENT_FILE
        with client_file.open("rb") as handle:
            client_config = tomllib.load(handle)["kafka"]
        yield SecureBroker(f"127.0.0.1:{port}", client_file, client_config)
    finally:
        main(["broker", "stop", "--state-dir", str(state_dir)])


# Queue mode needs share groups: Kafka >= 4.2 (a fresh 4.4.0 format turns them on, no broker config).
SHARE_GROUP_KAFKA_VERSION = "4.4.0"


def _has_share_groups(kafka_version: str) -> bool:
    major, minor = (int(part) for part in kafka_version.split(".")[:2])
    return (major, minor) >= (4, 2)


@pytest.fixture(scope="session")
def share_group_bootstrap(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Bootstrap servers of a broker with share groups, for queue-mode tests: `KAFKA_SHARE_BOOTSTRAP_SERVERS`
    when set; else the session's local broker when its release has them (>= 4.2); else a local Kafka 4.4.0
    broker of the session's own. Skips where the session may not start a local broker (a given broker or a
    container)."""
    given = os.environ.get("KAFKA_SHARE_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    if kafka_source.choose() != "local":
        pytest.skip("queue mode needs a broker with share groups: set KAFKA_SHARE_BOOTSTRAP_SERVERS")
    session_bootstrap = request.getfixturevalue("kafka_bootstrap")
    session_broker = _SOURCE.local
    if session_broker is not None and _has_share_groups(session_broker.kafka_version):
        yield session_bootstrap
        return
    broker = local_broker.LocalBroker(
        tmp_path_factory.mktemp("kafka-share-broker"),
        port=local_broker.free_port(),
        kafka_version=SHARE_GROUP_KAFKA_VERSION,
    )
    started = time.monotonic()
    broker.start(fresh=True, echo=lambda _line: None)
    _announce(
        request.config,
        f"Kafka {broker.kafka_version} broker (share groups) on {broker.bootstrap} in "
        f"{time.monotonic() - started:.1f}s (log {broker.log_file})",
    )
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def share_topic(share_group_bootstrap: str, request: pytest.FixtureRequest) -> Callable[..., str]:
    """`unique_topic` on the share-group broker."""
    test_name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]

    def create(name: str, partitions: int = 1) -> str:
        topic = f"test.{test_name}.{name}.{uuid.uuid4().hex[:8]}"
        create_topics({"bootstrap.servers": share_group_bootstrap}, [TopicSpec(topic, partitions, 1)])
        wait_until_served(share_group_bootstrap, topic, partitions)
        return topic

    return create


@pytest.fixture
def kafka_config(kafka_bootstrap: str) -> dict[str, str]:
    """Base librdkafka options for the session broker; a fresh dict per test, safe to extend."""
    return {"bootstrap.servers": kafka_bootstrap}


@pytest.fixture
def unique_topic(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Callable[..., str]:
    """Factory: `unique_topic("name", partitions=3)` creates a topic no other test (or run) uses."""
    test_name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]

    def create(name: str, partitions: int = 3) -> str:
        topic = f"test.{test_name}.{name}.{uuid.uuid4().hex[:8]}"
        create_topics({"bootstrap.servers": kafka_bootstrap}, [TopicSpec(topic, partitions, 1)])
        wait_until_served(kafka_bootstrap, topic, partitions)
        return topic

    return create


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _SOURCE.description:
        terminalreporter.write_sep("-", "kafka")
        terminalreporter.write_line(_SOURCE.description)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """One local Schema Registry (in-memory Apicurio, its Confluent-compatible API) for the session: a
    registry JVM starts in tens of seconds, so the suites share it rather than start one each."""
    if shutil.which("java") is None or shutil.which("mvn") is None:
        pytest.skip("the local Schema Registry needs java and mvn")
    started = LocalRegistry(Path(tmp_path_factory.mktemp("registry")), port=local_broker.free_port())
    started.start(echo=lambda _line: None)
    try:
        yield started
    finally:
        started.stop()
