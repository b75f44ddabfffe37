"""The container image and the compose file, checked without a Docker engine (none exists where these run):
the Dockerfile's shape and settings, its build steps replayed in a venv (deploy/build_check.py), and the
compose file against the Compose Specification's JSON Schema plus what the services promise each other."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml

from tools import REPO
from worker.dev.local_broker import KAFKA_VERSION
from worker.settings import load_settings

DEPLOY = REPO / "deploy"


def _build_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_check", DEPLOY / "build_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


build_check = _build_check()


def _instructions() -> list[Any]:
    return list(build_check.parse_dockerfile((REPO / "Dockerfile").read_text()))


def _runtime_env() -> dict[str, str]:
    """ENV of the last stage, as `KEY: value`."""
    stages: list[dict[str, str]] = []
    for item in _instructions():
        if item.keyword == "FROM":
            stages.append({})
        elif item.keyword == "ENV":
            stages[-1].update(build_check._env_pairs(item.args))
    return stages[-1]


def _default_bases() -> list[str]:
    """Each stage's FROM with the build arguments at their defaults (as `docker build .` resolves them)."""
    args: dict[str, str] = {}
    bases: list[str] = []
    for item in _instructions():
        if item.keyword == "ARG" and not bases:
            name, _, default = item.args.partition("=")
            args[name] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], default)
        elif item.keyword == "FROM":
            bases.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], item.args.split()[0]))
    return bases


def test_dockerfile_is_multi_stage_slim_non_root_with_a_healthcheck() -> None:
    instructions = _instructions()
    bases = _default_bases()
    assert len(bases) >= 2 and all("-slim" in base for base in bases)
    # One BASE_IMAGE argument replaces every stage's base (the air-gapped build).
    assert all(item.args.startswith("${BASE_IMAGE} ") for item in instructions if item.keyword == "FROM")
    by_keyword = {item.keyword: item.args for item in instructions}  # the last of each
    user = by_keyword["USER"].split(":")[0]
    assert user.isdigit() and user != "0"
    assert json.loads(by_keyword["ENTRYPOINT"]) == ["triage-worker"]
    assert json.loads(by_keyword["CMD"]) == ["run"]
    assert "/healthz" in by_keyword["HEALTHCHECK"]
    assert by_keyword["EXPOSE"] == _runtime_env()["TRIAGE_METRICS__PORT"]


def test_dockerfile_copies_only_what_exists_and_survives_dockerignore(tmp_path: Path) -> None:
    ignore = build_check.DockerIgnore((REPO / ".dockerignore").read_text())
    context = tmp_path / "context"
    build_check.build_context(REPO, ignore, context)  # what Docker would send
    for item in _instructions():
        if item.keyword != "COPY" or "--from=" in item.args:
            continue
        *sources, _ = item.args.split()
        for source in sources:
            assert (REPO / source).exists(), f"Dockerfile:{item.line}: {source} does not exist"
            path = context / source
            kept = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            assert kept, f"Dockerfile:{item.line}: .dockerignore drops all of {source}"
    # The wheel is built from the context: the package and its metadata are in it.
    assert (context / "pyproject.toml").is_file() and (context / "worker" / "__init__.py").is_file()
    # Heavy or private things stay out of the build context.
    for path in (".venv/bin/python", "data/banking77/train.csv", "tests/conftest.py", ".git/HEAD"):
        assert ignore.excluded(path), path


def test_image_settings_are_accepted_and_point_at_the_copied_model() -> None:
    env = _runtime_env()
    settings = load_settings(env={k: v for k, v in env.items() if k.startswith("TRIAGE_")})
    copies = {
        item.args.split()[-1].rstrip("/"): item.args.split()[0].rstrip("/")
        for item in _instructions()
        if item.keyword == "COPY" and "--from=" not in item.args
    }
    # The model the image runs is the embedded one, copied from the repository.
    source = copies[settings.inference.model]
    assert (REPO / source / "genai_config.json").is_file()
    assert settings.metrics.port == 9400 and settings.log.format == "json"


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()))


def test_compose_file_follows_the_compose_specification() -> None:
    schema = json.loads((DEPLOY / "compose-spec" / "compose-spec.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(_compose()), key=str)
    assert errors == [], [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_compose_runs_two_workers_in_one_group_after_the_topics_exist() -> None:
    services = _compose()["services"]
    assert set(services) >= {"kafka", "topics", "worker", "producer", "prometheus"}
    # The same Kafka as the local broker of the tests.
    assert services["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"
    worker = services["worker"]
    assert worker["deploy"]["replicas"] == 2
    assert worker["command"] == ["run"]
    assert worker["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert services["topics"]["command"] == ["topics", "create"]
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["producer"]["profiles"] == ["demo"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    settings = load_settings(env={**_runtime_env(), **worker["environment"]})
    # Every process that reads the settings sees the same group and broker.
    for name in ("topics", "worker", "producer"):
        assert services[name]["environment"] == worker["environment"]
    assert settings.kafka["bootstrap.servers"] == "kafka:19092"
    assert "INTERNAL://kafka:19092" in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    grace = int(worker["stop_grace_period"].rstrip("s"))
    assert grace * 1000 > settings.pipeline.shutdown_timeout_ms + 5000
    # Prometheus scrapes every replica on the metrics port.
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    target = prometheus["scrape_configs"][0]["dns_sd_configs"][0]
    assert target["names"] == ["worker"] and target["port"] == settings.metrics.port


def test_the_image_and_every_compose_service_of_it_turn_the_model_libraries_telemetry_off() -> None:
    """docs/privacy.md: no process in the image sends onnxruntime's or onnxruntime-genai's telemetry."""
    assert _runtime_env()["ORT_DISABLE_TELEMETRY"] == "1"
    services = _compose()["services"]
    of_the_image = [name for name, each in services.items() if each.get("image") == "triage-worker:local"]
    assert {"topics", "worker", "lag-exporter", "producer"} <= set(of_the_image)
    for name in of_the_image:
        assert services[name]["environment"]["ORT_DISABLE_TELEMETRY"] == "1", name


def test_compose_references_only_files_that_exist() -> None:
    for name, service in _compose()["services"].items():
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"


@pytest.mark.kafka
@pytest.mark.release
def test_dockerfile_steps_build_a_working_worker(kafka_bootstrap: str) -> None:
    """The build stage's RUN in a fresh venv, then the result started as the image would start it."""
    checked = subprocess.run(
        [sys.executable, str(DEPLOY / "build_check.py"), "--bootstrap", kafka_bootstrap],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "image: classify → " in checked.stdout
    assert "HEALTHCHECK passes" in checked.stdout
    assert "not run here: Dockerfile" in checked.stdout  # useradd, reported rather than silently skipped
