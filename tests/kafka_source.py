"""Which real Kafka broker a test session uses; tests/conftest.py and `make test` (which fetches the local
broker's jars only when that broker will run) decide it here, the same way:

1. `given`: `KAFKA_BOOTSTRAP_SERVERS` names a broker you already run.
2. `container`: a Docker API answers (Docker, or Podman's socket named by DOCKER_HOST), so testcontainers
   starts `TRIAGE_KAFKA_IMAGE` (default apache/kafka:<the local broker's version>).
3. `local`: the project's local broker from Maven-resolved jars (Java 17+ and Maven).

`TRIAGE_KAFKA_VERSION` (e.g. 4.4.0) picks the release of the last two: the local broker's jars, and the
default image's tag.

`TRIAGE_TEST_BROKER=container` or `=local` insists on one: a Docker API that does not answer is then an error,
not a fallback to the local broker.

    python tests/kafka_source.py    # prints given, container or local
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from worker.dev.local_broker import configured_kafka_version

SOURCES = ("given", "container", "local")
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


class SourceError(Exception):
    """The broker asked for cannot be had; the message says how to get it."""


def kafka_image() -> str:
    return os.environ.get("TRIAGE_KAFKA_IMAGE") or f"apache/kafka:{configured_kafka_version()}"


def _container_engine() -> ModuleType:
    spec = importlib.util.spec_from_file_location("container_engine", DEPLOY / "container_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def docker_api_answers() -> bool:
    """The Docker API testcontainers would use (DOCKER_HOST, else Docker's socket) answers a ping."""
    return bool(_container_engine().docker_api_answers(dict(os.environ)))


def choose() -> str:
    wanted = os.environ.get("TRIAGE_TEST_BROKER", "").strip()
    if wanted and wanted not in ("container", "local"):
        raise SourceError(f"TRIAGE_TEST_BROKER={wanted}: expected container or local")
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS") and not wanted:
        return "given"
    if wanted == "local":
        return "local"
    if docker_api_answers():
        return "container"
    if wanted == "container":
        raise SourceError(
            "TRIAGE_TEST_BROKER=container but no Docker API answers: start Docker, or serve Podman's "
            "(`podman system service --time=0 unix:///run/podman/podman.sock &` and "
            "DOCKER_HOST=unix:///run/podman/podman.sock); `make test-containers` does that for you"
        )
    return "local"


if __name__ == "__main__":
    try:
        print(choose())
    except SourceError as error:
        sys.exit(f"error: {error}")
