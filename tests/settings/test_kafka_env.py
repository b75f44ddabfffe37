"""`KAFKA_*` variables as a Kubernetes pod gets them: service links ignored with a warning, a typo stopped at
start in one line naming it, and the list of librdkafka's properties kept equal to the installed client's."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tools import librdkafka_properties
from tools.harness import TINY_MODEL, Worker, audit, make_topics, publish, wait_until_committed
from worker.cli.cli import main
from worker.errors import UserError
from worker.librdkafka import LIBRDKAFKA_VERSION, PROPERTIES
from worker.settings import load_settings, loading


def service_links(name: str, host: str, port: int, port_name: str = "tcp-client") -> dict[str, str]:
    """What the kubelet injects into every pod of the namespace for a Service `name` with one TCP port
    (Kubernetes' Docker-links-compatible variables, as documented for `enableServiceLinks`)."""
    prefix = name.upper().replace("-", "_")
    url = f"tcp://{host}:{port}"
    return {
        f"{prefix}_SERVICE_HOST": host,
        f"{prefix}_SERVICE_PORT": str(port),
        f"{prefix}_SERVICE_PORT_{port_name.upper().replace('-', '_')}": str(port),
        f"{prefix}_PORT": url,
        f"{prefix}_PORT_{port}_TCP": url,
        f"{prefix}_PORT_{port}_TCP_PROTO": "tcp",
        f"{prefix}_PORT_{port}_TCP_PORT": str(port),
        f"{prefix}_PORT_{port}_TCP_ADDR": host,
    }


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning is printed once per process; each test here is a new start."""
    monkeypatch.setattr(loading, "_warned_service_links", set())


def test_service_link_variables_are_ignored_with_one_warning(capsys: pytest.CaptureFixture[str]) -> None:
    links = {**service_links("kafka", "10.96.0.10", 9092), **service_links("kafka-ui", "10.96.0.11", 8080)}
    settings = load_settings(env={**links, "KAFKA_BOOTSTRAP_SERVERS": "kafka:9092", "KAFKA_LINGER_MS": "5"})
    assert settings.kafka == {"bootstrap.servers": "kafka:9092", "linger.ms": "5"}
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("triage-worker: warning: ignoring KAFKA_PORT, ")
    assert all(name in warning[0] for name in links) and "enableServiceLinks: false" in warning[0]
    load_settings(env=links)  # a reload reads the environment again: no second warning
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("variable", "expected"),
    [
        (
            "KAFKA_BOOTSTRAP_SERVER",
            "config error: KAFKA_BOOTSTRAP_SERVER: librdkafka has no option bootstrap.server; did you mean "
            "bootstrap.servers (KAFKA_BOOTSTRAP_SERVERS)?",
        ),
        (
            "KAFKA_SASL_PASWORD",
            "config error: KAFKA_SASL_PASWORD: librdkafka has no option sasl.pasword; did you mean "
            "sasl.password (KAFKA_SASL_PASSWORD)?",
        ),
        ("KAFKA_XYZZY", "config error: KAFKA_XYZZY: librdkafka has no option xyzzy"),
        (
            "KAFKA_LOG_LEVEL",
            "config error: KAFKA_LOG_LEVEL: librdkafka has no option log.level; did you mean log_level "
            "(settable only in a --config file's [kafka] table)?",
        ),
    ],
)
def test_an_unknown_kafka_variable_stops_with_one_line_naming_it(variable: str, expected: str) -> None:
    with pytest.raises(UserError) as caught:
        load_settings(env={variable: "hunter2"})
    assert str(caught.value) == expected  # the value (a password, maybe) is never shown


def test_an_unknown_option_from_a_file_or_flag_names_its_origin(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text('[kafka]\n"bootstrap.server" = "broker:9092"\n', encoding="utf-8")
    with pytest.raises(
        UserError, match=rf"kafka.bootstrap.server: .* did you mean bootstrap.servers\? \(from {path}"
    ):
        load_settings(path, env={})
    with pytest.raises(UserError, match=r"kafka.lingr.ms: .* did you mean linger.ms\? \(from command line\)"):
        load_settings(env={}, overrides={"kafka.lingr.ms": "5"})


def test_an_option_missing_from_the_list_passes_when_the_installed_client_knows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As with a newer confluent-kafka than the list was made from: the installed client is asked."""
    monkeypatch.setattr(loading, "LIBRDKAFKA_PROPERTIES", PROPERTIES - {"linger.ms"})
    assert load_settings(env={"KAFKA_LINGER_MS": "5"}).kafka["linger.ms"] == "5"
    with pytest.raises(UserError, match=r"no option lingr\.ms"):
        load_settings(env={"KAFKA_LINGR_MS": "5"})


def test_config_show_catches_a_typo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVER", "broker:9092")
    assert main(["config", "show"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "KAFKA_BOOTSTRAP_SERVER:" in captured.err


def test_the_property_list_is_the_installed_librdkafkas() -> None:
    library = librdkafka_properties.library_path()
    if library is None:
        pytest.skip("no librdkafka shared library found to read the property table from (non-Linux wheel?)")
    installed = librdkafka_properties.installed_properties(library)
    assert len(installed) > 150  # the table was read, not an empty file
    assert installed == PROPERTIES, (
        f"worker/librdkafka.py lists librdkafka {LIBRDKAFKA_VERSION}; the installed one differs: "
        "run `python -m tools.librdkafka_properties --write`"
    )


@pytest.mark.kafka
def test_the_worker_starts_and_works_with_the_environment_kubernetes_injects_for_a_service_named_kafka(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """As in a namespace with a Service `kafka` in front of the broker (the Bitnami chart's default name),
    without enableServiceLinks: false: the service links point at the real broker, the ConfigMap's
    KAFKA_BOOTSTRAP_SERVERS names it, and the topics Job and the worker both start and do their work."""
    host, port = kafka_bootstrap.rsplit(":", 1)
    env = {**service_links("kafka", host, int(port)), "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    topics = make_topics(unique_topic)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "TRIAGE_"))}
    created = subprocess.run(
        [sys.executable, "-m", "worker", "topics", "create", f"--set=topics.input={topics.input}"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert created.returncode == 0, created.stderr
    assert "warning: ignoring KAFKA_PORT" in created.stderr

    group = f"service-links-{uuid.uuid4().hex[:8]}"
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, env=env, model=TINY_MODEL)
    try:
        worker.wait_for("pipeline_started", timeout=120)
        publish(kafka_bootstrap, topics, 20, malformed_ratio=0.0)
        wait_until_committed(kafka_bootstrap, group, topics.input, 120, worker=worker)
        assert worker.stop() == 0
    finally:
        worker.kill()
    found = audit(kafka_bootstrap, topics)
    assert len(found.inputs) == 20 and found.lost == [] and found.duplicates == 0
    assert any(not result.fallback for results in found.results.values() for result in results)
    assert "warning: ignoring KAFKA_PORT" in worker.log_path.read_text()
