"""The project's local broker: survives a restart on the same data, and fails clearly when it cannot run."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from xml.etree import ElementTree

import kafka_source
import pytest
from confluent_kafka import Consumer, Message, Producer

from tools import REPO
from worker.cli.cli import main
from worker.dev import local_broker
from worker.errors import UserError
from worker.kafka.admin import TopicSpec, create_topics


@pytest.mark.kafka
def test_restart_on_the_same_log_dir_keeps_topics_and_records(
    local_kafka_broker: local_broker.LocalBroker,
) -> None:
    config = {"bootstrap.servers": local_kafka_broker.bootstrap}
    topic = f"test.restart.{uuid.uuid4().hex[:8]}"
    create_topics(config, [TopicSpec(topic, 1, 1)])
    producer = Producer(config)
    producer.produce(topic, key=b"k", value=b"before restart")
    assert producer.flush(15) == 0

    assert local_kafka_broker.stop()
    assert not local_kafka_broker.status().running
    local_kafka_broker.start(fresh=False, echo=lambda _line: None)
    assert local_kafka_broker.status().running

    consumer = Consumer({**config, "group.id": f"test-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + 30
        message = None
        while message is None and time.monotonic() < deadline:
            message = consumer.poll(0.5)
    finally:
        consumer.close()
    assert message is not None and message.error() is None
    assert (message.key(), message.value()) == (b"k", b"before restart")


def test_missing_java_is_named_with_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(UserError, match=r"`java` was not found on PATH.*install a Java 17\+ runtime"):
        local_broker.require_java()


def test_missing_maven_is_named_when_jars_are_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(UserError, match=r"`mvn` was not found on PATH.*install Apache Maven"):
        local_broker.fetch_jars(tmp_path / "kafka-home", echo=lambda _line: None)


def test_start_refuses_a_port_that_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        with pytest.raises(UserError, match=f"port {port} .* already in use"):
            local_broker.LocalBroker(tmp_path / "state", port).start()


def test_status_command_reports_a_stopped_broker_and_its_log_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["broker", "status", "--state-dir", str(tmp_path)]) == 3

    out = capsys.readouterr().out
    assert "not running" in out
    assert str(tmp_path / "logs" / "server.log") in out


def test_each_checkout_has_a_broker_state_folder_of_its_own(tmp_path: Path) -> None:
    """All checkouts shared ~/.cache/triage-worker/broker, so one checkout's `broker start --fresh` wiped the
    topics of the broker another one ran."""
    other_checkout = tmp_path / "other-checkout"
    shutil.copytree(REPO / "worker", other_checkout / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def log_file_of(checkout: Path) -> Path:
        done = subprocess.run(
            [sys.executable, "-m", "worker", "broker", "status"],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 3, done.stderr  # not running
        return Path(done.stdout.split("log file:")[1].strip())

    mine, theirs = log_file_of(REPO), log_file_of(other_checkout)
    assert mine != theirs
    for state_dir, checkout in ((mine.parents[1], REPO), (theirs.parents[1], other_checkout)):
        assert state_dir.parent == tmp_path / "cache" / "triage-worker" / "broker"
        assert state_dir.name.startswith(f"{checkout.name}-")


class _ReachedTheJars(Exception):
    """What the stubbed `fetch_jars` raises: `start` got past its checks of the state folder."""


def _own_state_folder(state: Path, *, marker: bool = True) -> None:
    """A state folder as `start` leaves it (with the marker, or as one from before the marker)."""
    (state / "data").mkdir(parents=True)
    (state / "data" / "meta.properties").write_text("node.id=1\n")
    (state / "logs").mkdir()
    (state / "logs" / "server.log").write_text("Kafka Server started\n")
    (state / "kafka.version").write_text("4.4.0\n")
    (state / "server.properties").write_text(_HEADER + "node.id=1\n")
    if marker:
        (state / _MARKER).write_text("mine\n")


# Spelt out rather than taken from the module: what the broker writes is part of the promise.
_MARKER = ".triage-worker-broker"
_HEADER = "# Written by triage-worker (worker/dev/local_broker.py); rewritten on every start.\n"
_NOT_ITS_OWN = f"is not a folder the local broker made (no {_MARKER} in it)"


@pytest.fixture
def no_jars(monkeypatch: pytest.MonkeyPatch) -> None:
    def reached(*_args: object, **_kwargs: object) -> Path:
        raise _ReachedTheJars

    monkeypatch.setattr(local_broker, "fetch_jars", reached)


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ("home", _NOT_ITS_OWN),
        ("project-with-data-and-logs", _NOT_ITS_OWN),
        ("own-plus-a-file", "holds notes.txt, which the local broker did not write"),
        ("legacy-parent", _NOT_ITS_OWN),
    ],
)
def test_broker_start_fresh_wipes_only_a_folder_the_broker_made(
    tmp_path: Path, layout: str, why: str, no_jars: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`broker start --fresh --state-dir DIR` deleted DIR whatever it held (issue 55)."""
    state = tmp_path / "state"
    state.mkdir()
    if layout == "home":
        (state / ".bashrc").write_text("export A=1\n")
        (state / "work").mkdir()
    elif layout == "project-with-data-and-logs":  # names the broker uses too, but not its folder
        (state / "data").mkdir()
        (state / "data" / "tickets.csv").write_text("a,b\n")
        (state / "logs").mkdir()
    elif layout == "own-plus-a-file":
        _own_state_folder(state)
        (state / "notes.txt").write_text("keep me\n")
    else:  # `--state-dir ~/.cache/triage-worker/broker`: every checkout's broker folder under it
        _own_state_folder(state / "my-checkout-1a2b3c4d")
    before = sorted(str(path.relative_to(state)) for path in state.rglob("*"))

    code = main(
        ["broker", "start", "--fresh", "--state-dir", str(state), "--port", str(local_broker.free_port())]
    )

    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"triage-worker: error: broker start --fresh: refusing to wipe {state}: it {why}; "
        "pick another --state-dir, or empty it yourself"
    ]
    assert sorted(str(path.relative_to(state)) for path in state.rglob("*")) == before


def test_broker_start_fresh_refuses_a_file_or_a_link(tmp_path: Path, no_jars: None) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep\n")
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("keep\n")
    link = tmp_path / "link"
    link.symlink_to(target)

    with pytest.raises(UserError, match=f"refusing to wipe {afile}: it is not a folder"):
        local_broker.LocalBroker(afile, local_broker.free_port()).start(fresh=True)
    with pytest.raises(UserError, match=f"refusing to wipe {link}: it is a symbolic link"):
        local_broker.LocalBroker(link, local_broker.free_port()).start(fresh=True)
    assert afile.read_text() == "keep\n" and (target / "keep.txt").is_file()


@pytest.mark.kafka
def test_a_folder_the_broker_made_is_marked_and_wiped_by_the_next_fresh_start(tmp_path: Path) -> None:
    if kafka_source.choose() != "local":
        pytest.skip("starts a second local broker; this session uses another broker")
    state = tmp_path / "broker"
    broker = local_broker.LocalBroker(state, local_broker.free_port())
    broker.start(fresh=True, echo=lambda _line: None)
    broker.stop()
    assert (state / _MARKER).is_file()
    (state / "logs" / "server.log").write_text("from the first run\n")

    broker.start(fresh=True, echo=lambda _line: None)
    try:
        assert "from the first run" not in (state / "logs" / "server.log").read_text()
        assert (state / _MARKER).is_file()
    finally:
        broker.stop()


@pytest.mark.parametrize(
    "layout", ["missing", "empty", "marked", "from-before-the-marker", "the-demo-against-another-kafka"]
)
def test_broker_start_fresh_goes_on_with_its_own_folder(tmp_path: Path, layout: str, no_jars: None) -> None:
    state = tmp_path / "state"
    if layout == "empty":
        state.mkdir()
    elif layout == "the-demo-against-another-kafka":  # only the demo's worker log, in a folder it made
        local_broker.make_state_dir(state)
        (state / "logs").mkdir()
        (state / "logs" / "demo-worker-0a1b2c.log").write_text("worker log\n")
    elif layout != "missing":
        (state / "demo-worker-3d4e5f.log").parent.mkdir(parents=True, exist_ok=True)
        (state / "demo-worker-3d4e5f.log").write_text("where the demo put them before\n")
        _own_state_folder(state, marker=layout == "marked")
        (state / "broker.port").write_text("9092\n")
        (state / "tls").mkdir()
        (state / "sasl-ssl-client.toml").write_text("[kafka]\n")

    with pytest.raises(_ReachedTheJars):
        local_broker.LocalBroker(state, local_broker.free_port()).start(fresh=True)


# --- Releases other than the default (issue #36's broker matrix) ---


@pytest.mark.parametrize("text", ["3.9.0", "3.9.2", "4.1.1", " 4.4.0 ", "10.0.0"])
def test_a_release_from_3_9_on_is_taken(text: str) -> None:
    assert local_broker.parse_kafka_version(text) == text.strip()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("latest", r"--kafka-version 'latest': expected a Kafka release such as 4\.4\.0"),
        ("4.4", r"--kafka-version '4\.4': expected a Kafka release"),
        ("4.2.0-rc1", r"expected a Kafka release"),
        ("3.8.1", r"--kafka-version 3\.8\.1: the local broker needs Kafka 3\.9\.0 or later .*--standalone"),
    ],
)
def test_a_version_the_local_broker_cannot_run_is_one_line_naming_where_it_came_from(
    text: str, said: str
) -> None:
    with pytest.raises(UserError, match=said) as raised:
        local_broker.parse_kafka_version(text, "--kafka-version")
    assert "\n" not in str(raised.value)


def test_the_release_comes_from_the_environment_else_the_default() -> None:
    assert local_broker.configured_kafka_version({}) == local_broker.KAFKA_VERSION
    assert local_broker.configured_kafka_version({"TRIAGE_KAFKA_VERSION": "4.4.0"}) == "4.4.0"
    with pytest.raises(UserError, match=r"^TRIAGE_KAFKA_VERSION 'x': expected"):
        local_broker.configured_kafka_version({"TRIAGE_KAFKA_VERSION": "x"})


def test_the_transaction_version_comes_from_the_environment_else_the_release_default() -> None:
    assert local_broker.configured_transaction_version({}) is None
    assert local_broker.configured_transaction_version({"TRIAGE_KAFKA_TRANSACTION_VERSION": " 1 "}) == 1
    with pytest.raises(UserError, match=r"^TRIAGE_KAFKA_TRANSACTION_VERSION 'v2': expected a feature level"):
        local_broker.configured_transaction_version({"TRIAGE_KAFKA_TRANSACTION_VERSION": "v2"})


def test_each_release_has_a_jar_cache_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TRIAGE_KAFKA_HOME", raising=False)
    monkeypatch.setenv("TRIAGE_KAFKA_VERSION", "3.9.2")

    assert local_broker.kafka_home() == tmp_path / "triage-worker" / "kafka" / "3.9.2"
    assert local_broker.kafka_home("4.4.0") == tmp_path / "triage-worker" / "kafka" / "4.4.0"
    assert local_broker.LocalBroker(tmp_path / "state").home.name == "3.9.2"
    assert local_broker.LocalBroker(tmp_path / "state", kafka_version="4.4.0").home.name == "4.4.0"


def test_the_pom_pins_the_default_release() -> None:
    """Other releases override kafka.version on Maven's command line; the pom's own is the default."""
    namespace = {"pom": "http://maven.apache.org/POM/4.0.0"}
    pom = ElementTree.parse(REPO / local_broker.POM_FILE).getroot()
    assert (
        pom.findtext("pom:properties/pom:kafka.version", namespaces=namespace) == local_broker.KAFKA_VERSION
    )
    dependency = pom.find("pom:dependencies/pom:dependency[pom:artifactId='kafka_2.13']", namespace)
    assert dependency is not None
    assert dependency.findtext("pom:version", namespaces=namespace) == "${kafka.version}"


def _fake_tools(bin_dir: Path, maven_body: str) -> Path:
    """`java` that says 17 and an `mvn` running `maven_body` (bash; its arguments are logged to mvn.args), to
    go first on PATH."""
    bin_dir.mkdir()
    (bin_dir / "java").write_text("#!/bin/sh\necho 'openjdk version \"17.0.15\" 2025-04-15' >&2\n")
    (bin_dir / "mvn").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {bin_dir}/mvn.args\n{maven_body}\n')
    for tool in ("java", "mvn"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir / "mvn.args"


def test_fetch_asks_maven_for_the_release_and_keeps_it_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fake Maven "resolves" the core jar of the release it was asked for into -DoutputDirectory.
    body = """for arg in "$@"; do
  case $arg in -DoutputDirectory=*) out=${arg#*=};; -Dkafka.version=*) release=${arg#*=};; esac
done
mkdir -p "$out" && touch "$out/kafka_2.13-$release.jar" "$out/kafka-clients-$release.jar\""""
    maven_args = _fake_tools(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    home = tmp_path / "kafka-home"

    libs = local_broker.fetch_jars(home, echo=lambda _line: None, version="4.4.0")

    assert "-Dkafka.version=4.4.0" in maven_args.read_text().splitlines()
    assert (libs / "kafka_2.13-4.4.0.jar").is_file()
    assert local_broker.jars_ready(home, "4.4.0")
    # One TRIAGE_KAFKA_HOME that served 4.4.0 is not taken for 3.9.2's jars.
    assert not local_broker.jars_ready(home, "3.9.2")


def test_a_release_maven_central_does_not_have_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = (
        "echo '[ERROR] Failed to execute goal on project local-kafka-broker: Could not resolve dependencies "
        "for project dev.triage-worker:local-kafka-broker:pom:1: Could not find artifact "
        "org.apache.kafka:kafka_2.13:jar:4.9.7 in central (https://repo.maven.apache.org/maven2)'\n"
        "exit 1"
    )
    _fake_tools(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    home = tmp_path / "kafka" / "4.9.7"

    with pytest.raises(UserError) as raised:
        local_broker.fetch_jars(home, echo=lambda _line: None, version="4.9.7")

    assert str(raised.value) == "Kafka 4.9.7 is not on Maven Central (no org.apache.kafka:kafka_2.13:4.9.7)"
    assert not home.exists()  # no cache folder for a release that is not there


def test_a_log_dir_formatted_by_another_release_is_not_restarted_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting another release on old metadata is an upgrade or downgrade to plan, not a restart."""
    _fake_tools(tmp_path / "bin", "exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    home = tmp_path / "kafka-home"  # the 4.4.0 jars, as a finished fetch leaves them
    (home / "libs").mkdir(parents=True)
    (home / "libs" / "kafka_2.13-4.4.0.jar").touch()
    (home / ".complete").write_text(hashlib.sha256((REPO / local_broker.POM_FILE).read_bytes()).hexdigest())
    state = tmp_path / "state"
    (state / "data").mkdir(parents=True)
    (state / "data" / "meta.properties").touch()
    (state / "kafka.version").write_text("3.9.2\n")
    broker = local_broker.LocalBroker(state, local_broker.free_port(), home=home, kafka_version="4.4.0")

    assert broker.status().kafka_version == "3.9.2"
    with pytest.raises(UserError, match=r"formatted by Kafka 3\.9\.2; start Kafka 4\.4\.0 with --fresh"):
        broker.start(fresh=False, echo=lambda _line: None)


def test_broker_commands_refuse_a_version_they_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["broker", "fetch", "--kafka-version", "3.8.1"]) == 2
    assert main(["broker", "start", "--kafka-version", "four"]) == 2

    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        "triage-worker: error: --kafka-version 3.8.1: the local broker needs Kafka 3.9.0 or later "
        "(it formats one KRaft node with --standalone, new in 3.9)",
        "triage-worker: error: --kafka-version 'four': expected a Kafka release such as 4.4.0",
    ]


def _first_record(config: dict[str, str], topic: str) -> Message | None:
    """The first record a new group reads from `topic` within 30 s (None if none came)."""
    consumer = Consumer({**config, "group.id": f"test-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    try:
        deadline, message = time.monotonic() + 30, None
        while message is None and time.monotonic() < deadline:
            message = consumer.poll(0.5)
    finally:
        consumer.close()
    return message


@pytest.mark.kafka
@pytest.mark.release
def test_broker_start_runs_the_release_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The oldest supported release through the CLI, beside the session's broker: its own jars, its version in
    the broker's log and in `broker status`, and a record through it."""
    if kafka_source.choose() != "local":  # like the SASL/TLS tests: such sessions may have no Java or Maven
        pytest.skip("starts a second local broker; this session uses another broker")
    state, port = tmp_path / "broker", local_broker.free_port()
    start = ["broker", "start", "--fresh", "--kafka-version", "3.9.2", "--state-dir", str(state)]
    assert main([*start, "--port", str(port)]) == 0
    try:
        assert main(["broker", "status", "--state-dir", str(state)]) == 0
        assert "kafka:     3.9.2" in capsys.readouterr().out
        assert "Kafka version: 3.9.2" in (state / "logs" / "server.log").read_text()
        config = {"bootstrap.servers": f"127.0.0.1:{port}"}
        topic = f"test.release.{uuid.uuid4().hex[:8]}"
        create_topics(config, [TopicSpec(topic, 1, 1)])
        producer = Producer(config)
        producer.produce(topic, value=b"through 3.9.2")
        assert producer.flush(15) == 0
        message = _first_record(config, topic)
        assert message is not None and message.error() is None and message.value() == b"through 3.9.2"
    finally:
        main(["broker", "stop", "--state-dir", str(state)])


@pytest.mark.kafka
def test_a_fresh_log_dir_runs_the_transaction_version_asked_for(tmp_path: Path) -> None:
    """transaction.version=1 (before KIP-890 part 2) on the default release, beside the session's broker: the
    broker's log shows the level finalized, and a transaction commits through it."""
    if kafka_source.choose() != "local":  # like the SASL/TLS tests: such sessions may have no Java or Maven
        pytest.skip("starts a second local broker; this session uses another broker")
    broker = local_broker.LocalBroker(tmp_path / "broker", local_broker.free_port(), transaction_version=1)
    broker.start(fresh=True, echo=lambda _line: None)
    try:
        log = broker.log_file.read_text().splitlines()
        finalized = [line for line in log if "finalizedFeatures=" in line]
        assert finalized and all(re.search(r"transaction\.version=1\b", line) for line in finalized)
        config = {"bootstrap.servers": broker.bootstrap}
        topic = f"test.tv1.{uuid.uuid4().hex[:8]}"
        create_topics(config, [TopicSpec(topic, 1, 1)])
        producer = Producer({**config, "transactional.id": f"test-tv1-{uuid.uuid4().hex[:8]}"})
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"through transaction.version=1")
        producer.commit_transaction(30)
        message = _first_record({**config, "isolation.level": "read_committed"}, topic)
        assert message is not None and message.error() is None
        assert message.value() == b"through transaction.version=1"
    finally:
        broker.stop()
