"""The built images, run for real with Podman or Docker against a real broker; each prints what it saw and
exits 1 on the first broken promise.

    .venv/bin/python deploy/container_checks.py image [--image triage-worker:local] [--tickets 100]
    .venv/bin/python deploy/container_checks.py compose [--override deploy/compose.maven-broker.yml]

image (`make image-check`): the worker image against the local broker (or KAFKA_BOOTSTRAP_SERVERS), every
container with a read-only root filesystem (a small /tmp, as the Deployment mounts), as the image's non-root
user, on the host network (the local broker listens and advertises on 127.0.0.1). `topics create` and
`produce-samples` run from the image too; the worker classifies every ticket (one result each on the output
topic, no dead letter), `/readyz` turns 200 and the HEALTHCHECK passes, and SIGTERM drains and exits 0.

compose (`make compose-check`): deploy/docker-compose.yml with the `demo` profile under `docker compose` or
`podman-compose`, as its own project with the broker on a free host port: the broker, the topics one-shot, two
workers from the built image sharing the input partitions, the lag exporter and the sample producer; results
appear on the output topic, the exporter serves the group's lag; `down` leaves no container, network or
volume of the project behind.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import container_engine
import msgspec
import yaml
from confluent_kafka import ConsumerGroupState
from confluent_kafka.admin import AdminClient
from container_engine import EngineError

from worker.dev import local_broker
from worker.messages import TriageResult

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
# Podman before 4.6 ignores `condition: service_healthy` (podman-compose warns and goes on), and before 5.6
# cannot start a container whose running dependency has a dependency of its own (containers/podman#26193).
PODMAN_COMPOSE_ORDERS_ITSELF = (5, 6)


def say(line: str) -> None:
    print(line, flush=True)


def fail(message: str) -> None:
    raise EngineError(f"FAILED: {message}")


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, every_s: float = 15.0) -> float:
    """Polls `ready` until true; a progress line every `every_s`; returns the seconds it took."""
    started = last = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now - started > timeout_s:
            fail(f"{what}: not within {timeout_s:.0f}s")
        if now - last >= every_s:
            say(f"  ... still waiting for {what} ({now - started:.0f}s)")
            last = now
        time.sleep(1.0)
    return time.monotonic() - started


def read_results(bootstrap: str, topic: str, want: int, timeout_s: float) -> dict[str, TriageResult]:
    """Results on `topic` by ticket id, read from the beginning until `want` distinct tickets have one."""
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"container-check-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    decoder = msgspec.json.Decoder(TriageResult)
    results: dict[str, TriageResult] = {}
    consumer.subscribe([topic])
    started = last = time.monotonic()
    try:
        while len(results) < want:
            if time.monotonic() - started > timeout_s:
                fail(f"{len(results)}/{want} results on {topic} within {timeout_s:.0f}s")
            if time.monotonic() - last >= 15:
                say(f"  ... {len(results)}/{want} results so far ({time.monotonic() - started:.0f}s)")
                last = time.monotonic()
            message = consumer.poll(1.0)
            if message is None or message.error() is not None or (value := message.value()) is None:
                continue
            result = decoder.decode(value)
            results[result.ticket_id] = result
    finally:
        consumer.close()
    return results


def describe(results: dict[str, TriageResult]) -> str:
    priorities = collections.Counter(result.priority for result in results.values())
    reasons = collections.Counter(result.fallback_reason for result in results.values() if result.fallback)
    models = sorted({result.model for result in results.values()})
    fallbacks = ", ".join(f"{reason} {count}" for reason, count in reasons.most_common()) or "none"
    return (
        f"priorities {dict(sorted(priorities.items()))}; model {', '.join(models)}; "
        f"classified {len(results) - sum(reasons.values())}, fallbacks: {fallbacks}"
    )


def record_count(bootstrap: str, topic: str) -> int:
    """Records on `topic` (sum of its partitions' end minus start offsets)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = admin.list_topics(topic, timeout=15).topics[topic].partitions
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "container-check"})
    try:
        total = 0
        for partition in partitions:
            low, high = consumer.get_watermark_offsets(
                confluent_kafka.TopicPartition(topic, partition), timeout=15
            )
            total += high - low
        return total
    finally:
        consumer.close()


# -- image ------------------------------------------------------------------------------------------------


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def _running(tool: str, name: str) -> bool:
    state = container_engine.run([tool, "inspect", "--format", "{{.State.Running}}", name], check=False)
    return state.stdout.strip() == "true"


def _events(tool: str, name: str) -> list[dict[str, Any]]:
    """The worker's JSON log lines (it logs JSON in the image)."""
    logs = container_engine.run([tool, "logs", name], check=False)
    events = []
    for line in (logs.stdout + logs.stderr).splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and "event" in event:
                events.append(event)
    return events


def _logs_tail(tool: str, name: str, lines: int = 25) -> str:
    logs = container_engine.run([tool, "logs", "--tail", str(lines), name], check=False)
    return (logs.stdout + logs.stderr).strip()


def _healthcheck(tool: str, name: str) -> None:
    """The image's HEALTHCHECK, passing. Podman without systemd schedules no checks: run it on demand, and as
    the engine would, call the container unhealthy only after the image's `--retries` failures in a row."""
    if tool == "podman":
        retries = int(
            container_engine.run(
                ["podman", "inspect", "--format", "{{.Config.Healthcheck.Retries}}", name]
            ).stdout.strip()
            or 1
        )
        for attempt in range(1, retries + 1):
            checked = container_engine.run(["podman", "healthcheck", "run", name], check=False)
            if checked.returncode == 0:
                tries = "" if attempt == 1 else f", on try {attempt} of {retries}"
                say(f"    HEALTHCHECK: healthy (podman healthcheck run{tries})")
                return
            output = f"{checked.stdout.strip()} {checked.stderr.strip()}".strip()
            say(f"    HEALTHCHECK try {attempt} of {retries}: {output}")
            time.sleep(2)
        fail(f"HEALTHCHECK: unhealthy after {retries} tries in a row")

    def healthy() -> bool:
        state = container_engine.run(
            [tool, "inspect", "--format", "{{.State.Health.Status}}", name], check=False
        )
        return state.stdout.strip() == "healthy"

    took = wait_for("the HEALTHCHECK to pass", healthy, timeout_s=120)
    say(f"    HEALTHCHECK: healthy after {took:.0f}s more")


@contextlib.contextmanager
def _broker(given: str | None) -> Iterator[str]:
    if given:
        say(f"broker: {given} (KAFKA_BOOTSTRAP_SERVERS)")
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="image-check-broker-") as state:
        broker = local_broker.LocalBroker(Path(state), port=local_broker.free_port())
        broker.start(fresh=True, echo=lambda line: say(f"broker: {line}"))
        try:
            say(f"broker: local Kafka {broker.kafka_version} at {broker.bootstrap}")
            yield broker.bootstrap
        finally:
            broker.stop()


def check_image(image: str, tickets: int) -> None:
    tool = container_engine.engine()
    inspect = container_engine.run([tool, "image", "inspect", image], check=False)
    if inspect.returncode != 0:
        fail(f"image {image} is not built: `make image` first")
    inspected = json.loads(inspect.stdout)[0]
    config = inspected.get("Config") or {}
    user = str(config.get("User") or "")
    healthcheck = config.get("Healthcheck") or inspected.get("Healthcheck")
    say(f"image: {image} ({tool}), user {user or 'root'}, HEALTHCHECK {'set' if healthcheck else 'missing'}")
    if not user or user.split(":")[0] in ("0", "root"):
        fail(f"the image runs as {user or 'root'}, not as a non-root user")
    if not healthcheck:
        fail("the image has no HEALTHCHECK (Podman keeps it only with --format docker)")

    run = uuid.uuid4().hex[:8]
    metrics_port = local_broker.free_port()
    name = f"triage-image-check-{run}"
    topics = {key: f"image-check.{run}.{key}" for key in ("input", "output", "dead_letter")}
    with _broker(os.environ.get("KAFKA_BOOTSTRAP_SERVERS")) as bootstrap:
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            **{f"TRIAGE_TOPICS__{key.upper()}": topic for key, topic in topics.items()},
            "TRIAGE_TOPICS__PARTITIONS": "3",
            "TRIAGE_PIPELINE__GROUP_ID": f"image-check-{run}",
            "TRIAGE_METRICS__PORT": str(metrics_port),  # the host network: keep clear of other 9400s
            "TRIAGE_INFERENCE__POOL_SIZE": "1",
        }
        # As Kubernetes runs it: read-only root, a 64 MiB /tmp (the Deployment's emptyDir). Podman would add
        # writable /run, /tmp and /var/tmp on its own; that is switched off so the check is as strict.
        flags = ["--read-only", "--tmpfs", "/tmp:size=64m", "--network", "host"]
        if tool == "podman":
            flags.append("--read-only-tmpfs=false")
        for key, value in env.items():
            flags += ["-e", f"{key}={value}"]

        created = container_engine.run([tool, "run", "--rm", *flags, image, "topics", "create"])
        for line in created.stdout.strip().splitlines():
            say(f"  topics create: {line}")

        container_engine.run([tool, "run", "-d", "--name", name, *flags, image])
        try:
            _check_worker(tool, name, image, flags, bootstrap, topics, metrics_port, tickets)
        finally:
            container_engine.run([tool, "rm", "-f", name], check=False)


def _check_worker(
    tool: str,
    name: str,
    image: str,
    flags: list[str],
    bootstrap: str,
    topics: dict[str, str],
    metrics_port: int,
    tickets: int,
) -> None:
    say(f"worker: {name} started (`run`), /readyz on 127.0.0.1:{metrics_port}")
    readyz = f"http://127.0.0.1:{metrics_port}/readyz"

    def ready() -> bool:
        if not _running(tool, name):
            fail(f"the worker exited before it was ready:\n{_logs_tail(tool, name)}")
        return _http_status(readyz) == 200

    took = wait_for("/readyz to answer 200", ready, timeout_s=300)
    say(f"  /readyz: 200 after {took:.0f}s")
    _healthcheck(tool, name)
    # The cascade is on by default: its escalation stage (and its encoder) must come with the image.
    cascade = [e for e in _events(tool, name) if e["event"] in ("cascade_started", "cascade_off")]
    if not cascade or cascade[-1]["event"] != "cascade_started":
        fail(f"the image's worker runs without its default cascade: {cascade[-1] if cascade else 'no log'}")
    say(f"  cascade: escalation stage {cascade[-1]['escalation']}, below {cascade[-1]['escalate_below']}")

    probe = (
        "import os\n"
        "print('uid', os.getuid(), 'gid', os.getgid())\n"
        "try:\n"
        "    open('/app/probe', 'w')\n"
        "    print('root filesystem WRITABLE')\n"
        "except OSError as error:\n"
        "    print('root filesystem:', error.strerror)\n"
    )
    seen = container_engine.run([tool, "exec", name, "python", "-c", probe]).stdout.split("\n")
    say(f"  process: {seen[0]}; {seen[1]} (writing /app)")
    uid = int(seen[0].split()[1])
    if uid == 0 or "Read-only file system" not in seen[1]:
        fail(f"expected a non-root user and a read-only root filesystem, saw: {seen[0]}; {seen[1]}")

    started = time.monotonic()
    samples = ["--count", str(tickets), "--rate", "0", "--malformed-ratio", "0", "--seed", "7"]
    produced = container_engine.run([tool, "run", "--rm", *flags, image, "produce-samples", *samples])
    output = (produced.stdout + produced.stderr).strip().splitlines()
    say(f"producer: {output[-1] if output else 'done'}")
    results = read_results(bootstrap, topics["output"], tickets, timeout_s=600)
    say(
        f"results: {len(results)}/{tickets} tickets have a result on {topics['output']} "
        f"{time.monotonic() - started:.0f}s after the producer started"
    )
    say(f"  {describe(results)}")
    if all(result.fallback for result in results.values()):
        fail("every result is a fallback: the model in the image classified nothing")
    dead = record_count(bootstrap, topics["dead_letter"])
    say(f"  dead letters: {dead}")
    if dead:
        fail(f"{dead} well-formed tickets were dead-lettered")

    container_engine.run([tool, "kill", "--signal", "TERM", name])
    waited = container_engine.run([tool, "wait", name], timeout=120)
    exit_code = int(waited.stdout.strip().splitlines()[-1])
    events = {event["event"]: event for event in _events(tool, name)}
    shutdown = [
        f"{key}({', '.join(f'{k}={events[key][k]}' for k in fields if k in events[key])})"
        for key, fields in (
            ("stop_requested", ("signal",)),
            ("pipeline_stopping", ("in_flight", "reason")),
            ("pipeline_stopped", ()),
        )
        if key in events
    ]
    say(f"SIGTERM: exit code {exit_code}; logged {' → '.join(shutdown) or 'nothing'}")
    if exit_code != 0 or "pipeline_stopped" not in events:
        fail(f"SIGTERM should drain and exit 0:\n{_logs_tail(tool, name)}")
    say("image check passed")


# -- compose ----------------------------------------------------------------------------------------------


def compose_command(tool: str) -> list[str]:
    """`docker compose` (or docker-compose) for Docker, podman-compose for Podman; none is installed here."""
    if tool == "docker":
        if container_engine.run(["docker", "compose", "version"], check=False).returncode == 0:
            return ["docker", "compose"]
        if shutil.which("docker-compose"):
            return ["docker-compose"]
        fail("Docker has no compose: install the compose plugin (https://docs.docker.com/compose/install/)")
    found = shutil.which("podman-compose") or shutil.which(
        "podman-compose", path=str(Path(sys.executable).parent)
    )
    if not found:
        fail("podman-compose is missing: `pip install podman-compose` or `apt-get install podman-compose`")
    return [str(found)]


def _podman_version() -> tuple[int, int]:
    version = container_engine.run(["podman", "version", "--format", "{{.Client.Version}}"]).stdout
    major, minor = re.findall(r"\d+", version)[:2]
    return int(major), int(minor)


def _project_leftovers(tool: str, project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    listings = {
        "containers": [tool, "ps", "-a", "--filter", label, "--format", "{{.Names}}"],
        "volumes": [tool, "volume", "ls", "--filter", label, "--format", "{{.Name}}"],
        "networks": [tool, "network", "ls", "--format", "{{.Name}}"],
    }
    found = {kind: container_engine.run(argv).stdout.split() for kind, argv in listings.items()}
    # Compose names its networks <project>_<name>; not every engine filters networks by label.
    found["networks"] = [name for name in found["networks"] if name.startswith(f"{project}_")]
    return found


class ComposeLoader(yaml.SafeLoader):
    """YAML as compose reads it: `!override` and `!reset` (merge tags) read as the value they carry."""


def _merge_tag(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    assert isinstance(node, yaml.ScalarNode)
    return loader.construct_scalar(node)


ComposeLoader.add_multi_constructor("!", _merge_tag)


def local_images(files: list[Path]) -> list[str]:
    """Images the files expect to find locally: built here, or never pulled (a later file's keys win)."""
    services: dict[str, dict[str, Any]] = collections.defaultdict(dict)
    for path in files:
        for name, service in (yaml.load(path.read_text(), ComposeLoader).get("services") or {}).items():
            services[name].update(service)
    return sorted(
        {
            service["image"]
            for service in services.values()
            if "image" in service and ("build" in service or service.get("pull_policy") == "never")
        }
    )


def check_compose(overrides: list[Path], want: int) -> None:
    tool = container_engine.engine()
    compose = compose_command(tool)
    for image in local_images([COMPOSE_FILE, *overrides]):
        if container_engine.run([tool, "image", "inspect", image], check=False).returncode != 0:
            hint = "make broker-image" if "kafka" in image else "make image"
            fail(f"image {image} is not built: `{hint}` first")
    project = f"triage-compose-check-{uuid.uuid4().hex[:6]}"
    port, lag_port = local_broker.free_port(), local_broker.free_port()
    files = [arg for path in [COMPOSE_FILE, *overrides] for arg in ("-f", str(path))]
    base = [*compose, "-p", project, *files, "--profile", "demo"]
    env = {**os.environ, "BROKER_HOST_PORT": str(port), "LAG_HOST_PORT": str(lag_port)}
    say(f"compose: {' '.join(compose)} with {', '.join(p.name for p in [COMPOSE_FILE, *overrides])}")
    say(f"  project {project}, broker on 127.0.0.1:{port}, lag exporter on 127.0.0.1:{lag_port}")

    def compose_run(*args: str, timeout: float = 600) -> None:
        done = subprocess.run([*base, *args], env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            output = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
            fail(f"`{' '.join(compose)} {' '.join(args)}` exited {done.returncode}:\n{output}")

    started = time.monotonic()
    try:
        if tool == "podman" and _podman_version() < PODMAN_COMPOSE_ORDERS_ITSELF:
            _up_in_order(tool, project, compose_run)
        else:
            compose_run("up", "-d")
        say(f"up: {time.monotonic() - started:.0f}s")
        bootstrap = f"127.0.0.1:{port}"
        results = read_results(bootstrap, "tickets.triaged", want, timeout_s=600)
        took = time.monotonic() - started
        say(f"results: {len(results)} tickets on tickets.triaged, {took:.0f}s after `up`")
        say(f"  {describe(results)}")
        _check_group(bootstrap)
        _check_lag_exporter(f"http://127.0.0.1:{lag_port}/metrics")
        project_label = f"label=com.docker.compose.project={project}"
        worker_label = "label=com.docker.compose.service=worker"
        workers = container_engine.run(
            [tool, "ps", "--filter", project_label, "--filter", worker_label, "--format", "{{.Names}}"]
        ).stdout.split()
        for worker in workers:
            say(f"  {worker}:")
            _healthcheck(tool, worker)
        states = container_engine.run(
            [tool, "ps", "-a", "--filter", project_label, "--format", "{{.Names}}: {{.Status}}"]
        ).stdout.split("\n")
        for line in filter(None, states):
            say(f"  {line}")
    finally:
        stopping = time.monotonic()
        compose_run("down", "--volumes", "--remove-orphans", timeout=300)
        leftovers = _project_leftovers(tool, project)
        say(
            f"down: {time.monotonic() - stopping:.0f}s; left behind: "
            + ", ".join(f"{len(names)} {kind}" for kind, names in leftovers.items())
        )
    if any(leftovers.values()):
        fail(f"`down` left {leftovers}")
    say("compose check passed")


def _up_in_order(tool: str, project: str, compose_run: Callable[..., None]) -> None:
    """Podman < 5.6: the file's dependency order, one step at a time (see PODMAN_COMPOSE_ORDERS_ITSELF)."""
    say("  Podman < 5.6: up in dependency order (kafka healthy → topics done → the rest)")
    compose_run("up", "-d", "kafka")
    kafka = f"{project}_kafka_1"

    def healthy() -> bool:
        return container_engine.run([tool, "healthcheck", "run", kafka], check=False).returncode == 0

    say(f"  kafka: healthy after {wait_for('the broker to turn healthy', healthy, timeout_s=300):.0f}s")
    compose_run("up", "-d", "--no-deps", "topics")
    topics = f"{project}_topics_1"
    exit_code = container_engine.run([tool, "wait", topics], timeout=300).stdout.strip()
    say(f"  topics: exited {exit_code}")
    if exit_code != "0":
        fail(f"topics create failed:\n{_logs_tail(tool, topics)}")
    compose_run("up", "-d", "--no-deps", "worker", "lag-exporter", "producer")


def _check_group(bootstrap: str) -> None:
    """Two workers in one consumer group, each with its own share of the input partitions, once a rebalance
    (the second worker joining) has settled."""
    # Quiet about the broker going away later: `down` follows.
    admin = AdminClient({"bootstrap.servers": bootstrap, "log.connection.close": False})
    shares: list[list[int]] = []

    def shared() -> bool:
        group = admin.describe_consumer_groups(["triage-worker"])["triage-worker"].result(timeout=15)
        shares[:] = [sorted(tp.partition for tp in m.assignment.topic_partitions) for m in group.members]
        return group.state == ConsumerGroupState.STABLE and len(shares) == 2 and all(shares)

    try:
        wait_for("two workers sharing the input partitions", shared, timeout_s=180)
    finally:
        say(f"  group triage-worker: {len(shares)} members, partitions {' | '.join(map(str, shares))}")


def _check_lag_exporter(url: str) -> None:
    """The lag exporter serves the group's lag on every input partition, read from the broker."""
    samples: dict[str, float] = {}

    def read_ok() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return False
        samples.clear()
        for line in text.splitlines():
            if line.startswith("triage_group_lag"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return any(
            name.startswith("triage_group_lag_read_ok") and value == 1 for name, value in samples.items()
        )

    wait_for("the lag exporter to read the group's lag", read_ok, timeout_s=120)
    lags = [value for name, value in samples.items() if name.startswith("triage_group_lag{")]
    if len(lags) != 6:
        fail(f"lag exporter: the lag of {len(lags)} partitions, not of the 6 input partitions: {samples}")
    say(f"  lag exporter: group triage-worker on tickets.raw, 6 partitions, lag {sum(lags):.0f} in all")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    checks = parser.add_subparsers(dest="check", required=True)
    image = checks.add_parser("image", help="run the worker image against a real broker")
    image.add_argument("--image", default="triage-worker:local")
    image.add_argument("--tickets", type=int, default=100)
    compose = checks.add_parser("compose", help="bring deploy/docker-compose.yml up and down")
    compose.add_argument("--override", type=Path, action="append", default=[], help="another compose file")
    compose.add_argument("--results", type=int, default=100, help="how many results to wait for")
    options = parser.parse_args()
    started = time.monotonic()
    if options.check == "image":
        check_image(options.image, options.tickets)
    else:
        check_compose(options.override, options.results)
    say(f"took {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
