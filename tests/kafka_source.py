"""Which real Kafka broker a test session uses; tests/conftest.py and `make test` (which fetches the local
broker's jars only when that broker will run) decide it here, the same way:

1. `given`: `KAFKA_BOOTSTRAP_SERVERS` names a broker you already run.
2. `container`: a Docker API answers (Docker, or Podman's socket named by DOCKER_HOST), so testcontainers
   starts `TRIAGE_KAFKA_IMAGE` (default apache/kafka:<the local broker's version>).
3. `local`: the project's local broker from Maven-resolved jars (Java 17+ and Maven).

`TRIAGE_TEST_BROKER=container` or `=local` insists on one: a Docker API that does not answer is then an error,
not a fallback to the local broker.

    python tests/kafka_source.py    # prints given, container or local
"""

from __future__ import annotations

import os
import sys

from worker.kafka.local_broker import KAFKA_VERSION

SOURCES = ("given", "container", "local")
DEFAULT_IMAGE = f"apache/kafka:{KAFKA_VERSION}"


class SourceError(Exception):
    """The broker asked for cannot be had; the message says how to get it."""


def kafka_image() -> str:
    return os.environ.get("TRIAGE_KAFKA_IMAGE") or DEFAULT_IMAGE


def docker_api_answers() -> bool:
    """A ping: instant failure where no engine listens; a busy Podman service may take seconds to answer."""
    try:
        import docker

        client = docker.from_env(timeout=15)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


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
