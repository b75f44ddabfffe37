"""A real Schema Registry for development and tests, without Docker: Apicurio Registry, whose
Confluent-compatible API (`/apis/ccompat/v7`) confluent-kafka's `SchemaRegistryClient` speaks.

Maven Central holds Apicurio's application jars but no runnable build, so the pom in `deploy/registry/` runs
Quarkus's build over them once, into the cache (`registry_home`): a runner jar and its `lib/`. The registry
then runs as a detached JVM on 127.0.0.1, like the local broker (`worker/dev/local_broker.py`), with
`registry.pid`, `registry.port` and `logs/stdout.log` in its state directory.

Storage is the app's in-memory H2 database: schemas last as long as the process, so a stopped registry
starts empty (ids it gave out before are then unknown). Nothing is kept in Kafka, hence no bootstrap servers.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from worker.cache import cache_root
from worker.dev.local_broker import (
    Echo,
    _pid_alive,
    _print,
    _tail,
    _terminate,
    port_open,
    require_java,
    require_tool,
)
from worker.errors import UserError
from worker.shipped import SOURCE_ROOT, checkout_file

APICURIO_VERSION = "2.4.2.Final"
DEFAULT_PORT = 8081  # Confluent Schema Registry's port, which clients and docs assume.
CCOMPAT_PATH = "/apis/ccompat/v7"
HEAP_OPTS = ("-Xms64m", "-Xmx512m")
_STOP_TIMEOUT_S = 30.0

POM_FILE = "deploy/registry/pom.xml"
MAVEN_SETTINGS = "deploy/registry/settings.xml"
_CHECKOUT_ONLY = "the local Schema Registry"
_INSTEAD = "name a Schema Registry with schema_registry.url"
# Apicurio's jars that hold CDI beans but no index: Quarkus's build must be told to scan them.
_INDEXED_ARTIFACTS = (
    "apicurio-registry-app",
    "apicurio-registry-schema-util-provider",
    "apicurio-registry-utils-import-export",
    "apicurio-registry-utils-kafka",
)
RUNNER_JAR = "schema-registry-1-runner.jar"


def registry_home() -> Path:
    """Where the built registry is cached: `~/.cache/triage-worker/schema-registry/<version>`."""
    return cache_root() / "schema-registry" / APICURIO_VERSION


def default_state_dir() -> Path:
    """One per checkout, as for the broker: `~/.cache/triage-worker/registry/<checkout>-<8 hex digits>`."""
    digest = hashlib.sha256(str(SOURCE_ROOT).encode()).hexdigest()[:8]
    return cache_root() / "registry" / f"{SOURCE_ROOT.name}-{digest}"


def _pom_digest() -> str:
    return hashlib.sha256(checkout_file(POM_FILE, _CHECKOUT_ONLY, _INSTEAD).read_bytes()).hexdigest()


def build_ready(home: Path | None = None) -> bool:
    home = home or registry_home()
    marker = home / ".complete"
    return marker.is_file() and marker.read_text().strip() == _pom_digest()


def build_registry(home: Path | None = None, echo: Echo = _print) -> Path:
    """Build the runnable registry into the cache once (Maven resolves ~300 jars; minutes the first time);
    returns the runner jar. Built in a staging folder and renamed into place, with a marker naming the pom it
    came from, so an interrupted or outdated build is never taken for a complete one."""
    home = home or registry_home()
    runner = home / "app" / RUNNER_JAR
    if build_ready(home):
        return runner
    mvn = require_tool("mvn", "install Apache Maven 3.8+, e.g. `apt-get install maven`")
    require_java()
    echo(f"Building Apicurio Registry {APICURIO_VERSION} from Maven Central jars into {home} (once)")
    home.mkdir(parents=True, exist_ok=True)
    staging = home / "build.partial"
    shutil.rmtree(staging, ignore_errors=True)
    index = [
        option
        for artifact in _INDEXED_ARTIFACTS
        for option in (
            f"-Dquarkus.index-dependency.{artifact.replace('-', '_')}.group-id=io.apicurio",
            f"-Dquarkus.index-dependency.{artifact.replace('-', '_')}.artifact-id={artifact}",
        )
    ]
    command = [
        mvn,
        "--batch-mode",
        "-Dstyle.color=never",
        "-s",
        str(checkout_file(MAVEN_SETTINGS, _CHECKOUT_ONLY, _INSTEAD)),
        "-f",
        str(checkout_file(POM_FILE, _CHECKOUT_ONLY, _INSTEAD)),
        "package",
        "-DskipTests",
        f"-Dregistry.build.dir={staging}",
        *index,
    ]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not (staging / RUNNER_JAR).is_file():
        tail = "\n".join(result.stdout.splitlines()[-25:])
        raise UserError(f"Maven could not build the Schema Registry (`{' '.join(command)}`):\n{tail}")
    shutil.rmtree(home / "app", ignore_errors=True)
    (home / "app").mkdir()
    (staging / RUNNER_JAR).rename(runner)
    (staging / "lib").rename(home / "app" / "lib")  # the runner jar's manifest names lib/ beside it
    shutil.rmtree(staging, ignore_errors=True)
    (home / ".complete").write_text(_pom_digest() + "\n")
    echo(f"Built the Schema Registry in {time.monotonic() - started:.0f}s")
    return runner


@dataclass(frozen=True)
class RegistryStatus:
    running: bool
    pid: int | None
    port: int | None
    state_dir: Path
    log_file: Path

    @property
    def url(self) -> str | None:
        """What `schema_registry.url` (and confluent-kafka's client) takes; None when stopped."""
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}" if self.port is not None else None


def _is_registry_process(pid: int) -> bool:
    """Guard against a stale pid file whose pid now belongs to an unrelated process."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        return _pid_alive(pid)
    try:
        return RUNNER_JAR.encode() in cmdline.read_bytes()
    except OSError:
        return False


class LocalRegistry:
    """One in-memory Apicurio Registry whose pid, port and logs live in `state_dir`."""

    def __init__(self, state_dir: Path | None = None, port: int = DEFAULT_PORT, home: Path | None = None):
        self.state_dir = state_dir or default_state_dir()
        self.port = port
        self.home = home or registry_home()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "logs" / "stdout.log"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "registry.pid"

    @property
    def _port_file(self) -> Path:
        return self.state_dir / "registry.port"

    def _recorded_pid(self) -> int | None:
        try:
            pid = int(self._pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) and _is_registry_process(pid) else None

    def status(self) -> RegistryStatus:
        pid = self._recorded_pid()
        port: int | None = None
        if pid is not None:
            try:
                port = int(self._port_file.read_text().strip())
            except (OSError, ValueError):
                port = None
        return RegistryStatus(pid is not None, pid, port, self.state_dir, self.log_file)

    def start(self, timeout_s: float = 180.0, echo: Echo = _print) -> RegistryStatus:
        """Start the registry detached and wait until its Confluent API answers; a running one is kept."""
        current = self.status()
        if current.running:
            return current
        if port_open(self.port):
            raise UserError(f"port {self.port} on 127.0.0.1 is already in use; pick another with --port")
        runner = build_registry(self.home, echo)
        java = require_java()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        command = [
            java,
            *HEAP_OPTS,
            f"-Dquarkus.http.port={self.port}",
            "-Dquarkus.http.host=127.0.0.1",
            "-jar",
            str(runner),
        ]
        started = time.monotonic()
        with self.log_file.open("ab") as stdout:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                start_new_session=True,  # survives the shell (and Ctrl-C) that started it
            )
        try:
            self._pid_file.write_text(f"{process.pid}\n")
            self._port_file.write_text(f"{self.port}\n")
            self._wait_ready(process, started + timeout_s)
        except BaseException:  # not ready in time, or Ctrl-C: a half-started registry nobody would stop
            if process.poll() is None:
                _terminate(process.pid, _STOP_TIMEOUT_S)
            self._forget()
            raise
        echo(f"Schema Registry ready in {time.monotonic() - started:.1f}s (pid {process.pid})")
        return self.status()

    def _wait_ready(self, process: subprocess.Popen[bytes], deadline: float) -> None:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise UserError(
                    f"the Schema Registry exited with code {process.returncode} while starting; "
                    f"log {self.log_file}:\n{_tail(self.log_file)}"
                )
            if self.answers():
                return
            time.sleep(0.5)
        raise UserError(
            f"the Schema Registry did not answer on {self.url} in time; log {self.log_file}:\n"
            f"{_tail(self.log_file)}"
        )

    def answers(self) -> bool:
        """Whether the Confluent API lists subjects (what every client call needs), not just an open port."""
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _forget(self) -> None:
        self._pid_file.unlink(missing_ok=True)
        self._port_file.unlink(missing_ok=True)

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> bool:
        """SIGTERM, then SIGKILL after `timeout_s`; False if it was not running."""
        pid = self._recorded_pid()
        if pid is not None:
            _terminate(pid, timeout_s)
        self._forget()
        return pid is not None
