"""Builds the project's images with Podman or Docker, whichever answers, and lends Podman's Docker API to
testcontainers. Standard library only for `engine` and `build`: an image builds without the project's venv.

    python3 deploy/container_engine.py engine              # prints podman or docker
    python3 deploy/container_engine.py build [--tag triage-worker:local] [--base-image IMAGE] [-- FLAGS...]
    python3 deploy/container_engine.py build-broker --jars DIR [--tag TAG] [--base-image IMAGE]
    python3 deploy/container_engine.py with-docker-api -- COMMAND...

`CONTAINER_ENGINE=docker|podman` picks one; with neither, one line says what to install (nothing is installed
here). `build` passes the CA bundle your pip trusts (`$PIP_CERT`, or --ca-bundle) as the build secret
`pip-ca`, so `pip install` in the build trusts a private index or a TLS-inspecting proxy. `build-broker`
builds deploy/kafka/Dockerfile over the jars the local broker uses (`triage-worker broker fetch`).
`with-docker-api` runs COMMAND with a Docker API: the one DOCKER_HOST names or Docker's own, else a Podman
service on a private socket for the length of COMMAND (with TESTCONTAINERS_RYUK_DISABLED=true: Ryuk's image
is one more pull).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("podman", "docker")
INSTALL_HINT = (
    "install Podman (e.g. `apt-get install podman`) or Docker (https://docs.docker.com/engine/install/)"
)
# Failures that mean the sandbox, not the project: the fix is a setting, not a code change.
_SANDBOX_ERRORS = ("setrlimit", "cgroups in hybrid mode", 'OCI runtime "crun"')
SANDBOX_HINT = (
    "this looks like Podman in a restricted sandbox: export CONTAINERS_CONF="
    f"{REPO / 'deploy' / 'podman' / 'containers.conf'} (runc, no default ulimits; needs the `runc` package)"
)


class EngineError(SystemExit):
    """A failed engine step, as one readable message (exit status 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def _answers(engine: str) -> bool:
    if shutil.which(engine) is None:
        return False
    try:
        probe = subprocess.run([engine, "info"], capture_output=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


def engine() -> str:
    """`CONTAINER_ENGINE` if set (it must answer), else the first of podman, docker whose `info` succeeds."""
    chosen = os.environ.get("CONTAINER_ENGINE", "").strip()
    if chosen:
        if chosen not in ENGINES:
            raise EngineError(f"CONTAINER_ENGINE={chosen}: expected one of {', '.join(ENGINES)}")
        if not _answers(chosen):
            raise EngineError(
                f"CONTAINER_ENGINE={chosen}: `{chosen} info` fails; is it installed and running?"
            )
        return chosen
    for candidate in ENGINES:
        if _answers(candidate):
            return candidate
    raise EngineError(f"no container engine answers (`podman info`, `docker info`): {INSTALL_HINT}")


def explain(stderr: str) -> str:
    """The engine's error text, with the sandbox fix appended when it is one of the known sandbox failures."""
    text = stderr.strip()
    if any(marker in text for marker in _SANDBOX_ERRORS):
        text += f"\n{SANDBOX_HINT}"
    return text


def run(
    argv: list[str], *, check: bool = True, capture: bool = True, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """An engine command; a failure is an EngineError with the command and its (explained) error output."""
    result = subprocess.run(argv, capture_output=capture, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        detail = explain(result.stderr or "") if capture else "(output above)"
        raise EngineError(f"`{' '.join(argv)}` failed with exit code {result.returncode}:\n{detail}")
    return result


def build(
    tool: str,
    tag: str,
    context: Path,
    dockerfile: Path,
    base_image: str | None,
    ca_bundle: str | None,
    extra: list[str],
) -> None:
    argv = [tool, "build", "-t", tag, "-f", str(dockerfile)]
    if tool == "podman":
        argv += ["--format", "docker"]  # Podman's default (OCI) drops HEALTHCHECK
    if base_image:
        argv += ["--build-arg", f"BASE_IMAGE={base_image}"]
    if ca_bundle:
        if not Path(ca_bundle).is_file():
            raise EngineError(f"CA bundle {ca_bundle} (--ca-bundle or PIP_CERT) is not a file")
        argv += ["--secret", f"id=pip-ca,src={ca_bundle}"]
    argv += [*extra, str(context)]
    print(f"image: {' '.join(argv)}", flush=True)
    started = time.monotonic()
    # The build's progress goes to the terminal as it comes; its error output is kept to explain a failure.
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    errors: list[str] = []
    for line in process.stderr:
        sys.stderr.write(line)
        errors.append(line)
    if process.wait() != 0:
        raise EngineError(
            f"image: the build failed (exit code {process.returncode})\n{explain(''.join(errors[-20:]))}"
        )
    print(f"image: built {tag} with {tool} in {time.monotonic() - started:.0f}s", flush=True)


def build_broker(tool: str, tag: str, jars: Path, base_image: str | None, extra: list[str]) -> None:
    """deploy/kafka/Dockerfile over a context of the resolved jars and the image's own scripts."""
    jar_files = sorted(jars.glob("*.jar"))
    if not any(path.name.startswith("kafka_2.13-") for path in jar_files):
        raise EngineError(f"{jars} holds no Kafka broker jars: run `triage-worker broker fetch` first")
    kafka_dir = REPO / "deploy" / "kafka"
    with tempfile.TemporaryDirectory(prefix="triage-broker-image-") as scratch:
        context = Path(scratch)
        (context / "libs").mkdir()
        for path in jar_files:
            shutil.copy2(path, context / "libs" / path.name)
        for name in ("run-broker.sh", "broker-ready.sh", "log4j2-container.properties"):
            shutil.copy2(kafka_dir / name, context / name)
        build(tool, tag, context, kafka_dir / "Dockerfile", base_image, None, extra)


def docker_api_answers(env: dict[str, str], timeout_s: float = 15) -> bool:
    """What testcontainers will find with `env`: DOCKER_HOST, else Docker's default socket. Fails at once
    where nothing listens; a busy Podman service may take seconds to answer. tests/kafka_source.py asks it."""
    import docker  # the project's venv has it (testcontainers); `engine` and `build` need no venv

    try:
        client = docker.from_env(timeout=round(timeout_s), environment=env)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def with_docker_api(command: list[str]) -> int:
    env = dict(os.environ)
    if docker_api_answers(env):
        where = env.get("DOCKER_HOST", "Docker's default socket")
        print(f"docker api: {where} answers", flush=True)
        return subprocess.run(command, env=env, check=False).returncode
    if not _answers("podman"):
        raise EngineError(
            f"no Docker API answers (DOCKER_HOST, /var/run/docker.sock) and no Podman: {INSTALL_HINT}"
        )
    with tempfile.TemporaryDirectory(prefix="triage-podman-api-") as scratch:
        socket_url = f"unix://{scratch}/podman.sock"
        service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", socket_url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the command only; the service is ours to end
        )
        try:
            env["DOCKER_HOST"] = socket_url
            env.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
            deadline = time.monotonic() + 30
            while not docker_api_answers(env):
                if service.poll() is not None or time.monotonic() > deadline:
                    error = (
                        service.stderr.read().decode()
                        if service.poll() is not None and service.stderr
                        else ""
                    )
                    raise EngineError(
                        f"`podman system service` did not answer on {socket_url}\n{explain(error)}"
                    )
                time.sleep(0.3)
            print(f"docker api: Podman's, served on {socket_url} for this command", flush=True)
            return subprocess.run(command, env=env, check=False).returncode
        finally:
            os.killpg(service.pid, signal.SIGTERM)
            service.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("engine", help="print the engine that will be used")
    worker = commands.add_parser("build", help="build the worker image (the repository's Dockerfile)")
    worker.add_argument("--tag", default="triage-worker:local")
    worker.add_argument("--base-image", help="BASE_IMAGE build argument (default: the Dockerfile's)")
    worker.add_argument(
        "--ca-bundle", default=os.environ.get("PIP_CERT"), help="CA bundle for pip in the build ($PIP_CERT)"
    )
    broker = commands.add_parser("build-broker", help="build the Kafka image from the Maven-resolved jars")
    broker.add_argument("--jars", type=Path, required=True, help="the jars' folder (`broker fetch` fills it)")
    # localhost/: the same name under Docker and Podman (Podman puts unqualified local names there).
    broker.add_argument("--tag", default="localhost/triage-kafka:4.4.0")
    broker.add_argument("--base-image", help="BASE_IMAGE build argument: any image with Java 17+ and bash")
    for sub in (worker, broker):
        sub.add_argument("extra", nargs="*", help="more build flags, after `--` (e.g. --network host)")
    api = commands.add_parser("with-docker-api", help="run a command with a Docker API (Podman's if needed)")
    api.add_argument("argv", nargs="+", help="the command, after `--`")
    options = parser.parse_args()

    if options.command == "with-docker-api":
        return with_docker_api(options.argv)
    tool = engine()
    if options.command == "engine":
        print(tool)
    elif options.command == "build":
        build(
            tool, options.tag, REPO, REPO / "Dockerfile", options.base_image, options.ca_bundle, options.extra
        )
    else:
        build_broker(tool, options.tag, options.jars, options.base_image, options.extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
