"""The container tooling's own decisions, checked without an engine: which engine and which test broker are
used and what a user is told when there is none, the compose override for machines without a registry, and
the names that the Makefile, the override and the broker image must agree on. The tooling itself runs for
real in `make image-check`, `make compose-check` and `make test-containers` (CI runs all three)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import jsonschema
import kafka_source
import pytest
import yaml

from tools import REPO
from worker.dev.local_broker import KAFKA_VERSION

DEPLOY = REPO / "deploy"
OVERRIDE = DEPLOY / "compose.maven-broker.yml"


@pytest.fixture
def deploy_tools(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    """deploy/container_engine.py and deploy/container_checks.py, imported the way the scripts do."""
    monkeypatch.syspath_prepend(str(DEPLOY))
    import container_checks
    import container_engine

    return container_engine, container_checks


def _engine_command(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEPLOY / "container_engine.py"), "engine"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_without_an_engine_one_line_says_what_to_install(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CONTAINER_ENGINE"}
    result = _engine_command({**env, "PATH": str(tmp_path)})  # neither podman nor docker on PATH

    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "no container engine answers (`podman info`, `docker info`): install Podman (e.g. `apt-get install "
        "podman`) or Docker (https://docs.docker.com/engine/install/)"
    ]


def test_an_engine_name_that_is_not_one_is_refused(tmp_path: Path) -> None:
    result = _engine_command({**os.environ, "CONTAINER_ENGINE": "lxc"})

    assert result.returncode == 1
    assert result.stderr.strip() == "CONTAINER_ENGINE=lxc: expected one of podman, docker"


def test_sandbox_failures_get_the_containers_conf_hint(deploy_tools: tuple[ModuleType, ModuleType]) -> None:
    container_engine, _ = deploy_tools
    crun = "Error: OCI runtime error: crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted"

    explained = container_engine.explain(crun)

    assert explained.startswith(crun)
    conf = DEPLOY / "podman" / "containers.conf"
    assert f"CONTAINERS_CONF={conf}" in explained
    settings = conf.read_text()
    assert re.search(r'^runtime = "runc"$', settings, re.MULTILINE)
    assert re.search(r"^default_ulimits = \[\]$", settings, re.MULTILINE)
    # Other errors are passed on as they are.
    assert container_engine.explain("Error: image not known") == "Error: image not known"


def test_the_test_broker_is_given_local_or_a_container(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")  # no Docker API answers
    monkeypatch.delenv("TRIAGE_TEST_BROKER", raising=False)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "broker:9092")
    assert kafka_source.choose() == "given"

    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    assert kafka_source.choose() == "local"

    monkeypatch.setenv("TRIAGE_TEST_BROKER", "container")
    with pytest.raises(kafka_source.SourceError, match=r"no Docker API answers.*podman system service"):
        kafka_source.choose()

    monkeypatch.setenv("TRIAGE_TEST_BROKER", "docker")
    with pytest.raises(kafka_source.SourceError, match="expected container or local"):
        kafka_source.choose()


def test_make_test_is_told_whether_the_local_broker_and_its_jars_are_needed() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "TRIAGE_TEST_BROKER")}
    asked = [sys.executable, str(REPO / "tests" / "kafka_source.py")]

    without_api = {**env, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    with_broker = {**without_api, "KAFKA_BOOTSTRAP_SERVERS": "broker:9092"}
    for environment, expected in ((without_api, "local"), (with_broker, "given")):
        answer = subprocess.run(
            asked, env=environment, capture_output=True, text=True, check=True, timeout=60
        )
        assert answer.stdout.strip() == expected


def test_the_default_test_broker_image_is_the_one_compose_and_the_local_broker_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRIAGE_KAFKA_IMAGE", raising=False)
    monkeypatch.delenv("TRIAGE_KAFKA_VERSION", raising=False)  # a matrix run's release, not the default
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())

    assert (
        kafka_source.kafka_image() == f"apache/kafka:{KAFKA_VERSION}" == compose["services"]["kafka"]["image"]
    )
    monkeypatch.setenv("TRIAGE_KAFKA_IMAGE", "localhost/triage-kafka:4.1.1")
    assert kafka_source.kafka_image() == "localhost/triage-kafka:4.1.1"


def test_a_changed_host_port_is_also_the_advertised_one() -> None:
    kafka = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["kafka"]

    assert kafka["ports"] == ["127.0.0.1:${BROKER_HOST_PORT:-9092}:9092"]
    assert (
        "PLAINTEXT://localhost:${BROKER_HOST_PORT:-9092}"
        in kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    )


def test_the_maven_broker_override_replaces_the_image_and_its_healthcheck(
    deploy_tools: tuple[ModuleType, ModuleType],
) -> None:
    container_engine, container_checks = deploy_tools
    override = yaml.load(OVERRIDE.read_text(), container_checks.ComposeLoader)
    schema = json.loads((DEPLOY / "compose-spec" / "compose-spec.json").read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(override)) == []
    # `!override`: Compose would otherwise append this test to apache/kafka's (podman-compose does).
    assert re.search(r"^\s+test: !override \[", OVERRIDE.read_text(), re.MULTILINE)
    kafka = override["services"]["kafka"]
    script = kafka["healthcheck"]["test"][-1]
    assert kafka["healthcheck"]["test"] == ["CMD", "/opt/kafka/bin/broker-ready.sh"]
    assert (DEPLOY / "kafka" / Path(script).name).is_file()
    assert Path(script).name in (DEPLOY / "kafka" / "Dockerfile").read_text()

    # One name for the image in the Makefile, the build script and the override; the image is never pulled.
    makefile = (REPO / "Makefile").read_text()
    assert f"BROKER_IMAGE ?= {kafka['image']}" in makefile
    assert kafka["image"] == f"localhost/triage-kafka:{KAFKA_VERSION}"
    assert f'default="{kafka["image"]}"' in (DEPLOY / "container_engine.py").read_text()
    assert kafka["pull_policy"] == "never"
    compose_files = [DEPLOY / "docker-compose.yml", OVERRIDE]
    assert container_checks.local_images(compose_files) == [kafka["image"], "triage-worker:local"]
    assert container_engine.REPO == REPO
