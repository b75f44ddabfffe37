"""A real Apache Kafka broker for development and tests, without Docker.

Machines this project targets have Java and Maven but often no Docker engine, and no Kafka package exists in
Debian or PyPI. So the broker's jars are resolved from Maven Central with the small pom in `deploy/kafka/`
(cached outside the repo), and one KRaft node (broker + controller) is started on 127.0.0.1 as a detached
JVM. Its state lives in one directory (by default one per checkout, see `default_state_dir`):
`server.properties`, `data/` (the log dir), `logs/server.log`, `logs/stdout.log`, `broker.pid`,
`broker.port` and the marker `.triage-worker-broker`, written when the broker makes the directory.

`start(fresh=True)` wipes that directory, so it first makes sure the directory is the broker's own: it carries
the marker (or, from before the marker, a `server.properties` this module wrote) and holds nothing but what
the broker writes there. Any other folder (`--state-dir ~`, a project folder) is refused in one line, never
deleted.

A stopped broker can be started again on the same data (`start(fresh=False)`), which tests use to prove the
worker survives a broker restart.

Any Kafka release from 3.9.0 on can be run (`kafka_version`, else `$TRIAGE_KAFKA_VERSION`, else
`KAFKA_VERSION`): Maven resolves the pom with `-Dkafka.version=V`, each version's jars have a cache folder of
their own, and the state directory records which version formatted its log dir, so a restart on the same data
never meets another release's metadata by accident. 3.9.0 is the floor because the single node is formatted
with `--standalone` and found through `controller.quorum.bootstrap.servers` (KIP-853, new in 3.9); from there
to 4.4 the same properties and commands start it. A release Maven Central does not have is one line of error.

With `sasl_ssl` it also serves a SASL_SSL listener, so authentication and encryption are tested against the
real broker: SCRAM-SHA-512 users are written into the metadata when the log dir is formatted, and a local CA
(`tls/ca.pem`, what clients trust) signs the broker's certificate for 127.0.0.1, both made with `openssl`.
The PLAINTEXT listener stays for the controller, inter-broker traffic and tools that need no credentials.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from worker.cache import cache_root
from worker.errors import UserError
from worker.shipped import SOURCE_ROOT, checkout_file

# The default release: deploy/kafka/pom.xml's kafka.version and the apache/kafka image tag in deploy/.
KAFKA_VERSION = "4.4.0"
KAFKA_VERSION_ENV = "TRIAGE_KAFKA_VERSION"
# The transaction protocol a fresh log dir is formatted with (`--feature transaction.version=N`); unset, the
# release's default (2, KIP-890 part 2, from 4.0 on). 1 is the protocol before KIP-890 part 2.
TRANSACTION_VERSION_ENV = "TRIAGE_KAFKA_TRANSACTION_VERSION"
OLDEST_KAFKA_VERSION = (3, 9, 0)
_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)")
DEFAULT_PORT = 9092
READY_LINE = "Kafka Server started"
JAVA_MIN_MAJOR = 17  # Kafka 4.x brokers need Java 17+.
HEAP_OPTS = ("-Xms128m", "-Xmx512m")
# How long a stop waits for a clean shutdown (SIGTERM) before SIGKILL.
_STOP_TIMEOUT_S = 30.0

POM_FILE = "deploy/kafka/pom.xml"
LOG4J_CONFIG = "deploy/kafka/log4j2.properties"
# With this variable at 1 the broker logs its transaction coordinator, marker channel and partition
# verification at DEBUG (deploy/kafka/log4j2-transactions.properties): a hanging transaction's evidence.
DEBUG_TRANSACTIONS_ENV = "TRIAGE_KAFKA_DEBUG_TRANSACTIONS"
LOG4J_TRANSACTIONS_CONFIG = "deploy/kafka/log4j2-transactions.properties"
_CHECKOUT_ONLY = "the local Kafka broker"
_INSTEAD = "name a Kafka with --bootstrap-servers or KAFKA_BOOTSTRAP_SERVERS"

# The file that says a state directory is the local broker's own (so `start(fresh=True)` may wipe it).
STATE_MARKER = ".triage-worker-broker"
# The SASL_SSL client settings `broker start --sasl-ssl-port` writes into the state directory.
SASL_CLIENT_FILE = "sasl-ssl-client.toml"
# Every entry the broker (and `broker start`) writes at the top of its state directory: a folder holding
# anything else is not wiped.
STATE_ENTRIES = frozenset(
    {
        STATE_MARKER,
        SASL_CLIENT_FILE,
        "server.properties",
        "data",
        "logs",
        "tls",
        "broker.pid",
        "broker.port",
        "kafka.version",
    }
)
# The demo's worker logs, which it wrote beside the broker's state before they went to `logs/`.
_DEMO_LOG = re.compile(r"demo-worker-[0-9a-f]{6}\.log")
_PROPERTIES_HEADER = "# Written by triage-worker (worker/dev/local_broker.py); rewritten on every start.\n"

SCRAM_MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192
TLS_DAYS = 30

Echo = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def parse_kafka_version(text: str, source: str = "Kafka version") -> str:
    """A release number the local broker can run (`4.4.0`), or a one-line UserError naming `source`."""
    match = _RELEASE.fullmatch(text.strip())
    if match is None:
        raise UserError(f"{source} {text!r}: expected a Kafka release such as {KAFKA_VERSION}")
    if tuple(int(part) for part in match.groups()) < OLDEST_KAFKA_VERSION:
        oldest = ".".join(map(str, OLDEST_KAFKA_VERSION))
        raise UserError(
            f"{source} {text.strip()}: the local broker needs Kafka {oldest} or later "
            "(it formats one KRaft node with --standalone, new in 3.9)"
        )
    return text.strip()


def configured_kafka_version(environ: Mapping[str, str] = os.environ) -> str:
    """`$TRIAGE_KAFKA_VERSION` when set (tests and tools run another release with it), else the default."""
    given = environ.get(KAFKA_VERSION_ENV, "").strip()
    return parse_kafka_version(given, KAFKA_VERSION_ENV) if given else KAFKA_VERSION


def configured_transaction_version(environ: Mapping[str, str] = os.environ) -> int | None:
    """`$TRIAGE_KAFKA_TRANSACTION_VERSION` (a level such as 1) when set, else None: the release's default.

    Whether the release knows the level is for its storage tool to say when it formats the log dir."""
    given = environ.get(TRANSACTION_VERSION_ENV, "").strip()
    if not given:
        return None
    if not given.isdigit():
        raise UserError(f"{TRANSACTION_VERSION_ENV} {given!r}: expected a feature level such as 1 or 2")
    return int(given)


def log4j_config(environ: Mapping[str, str] = os.environ) -> str:
    """The broker's log4j2 file: the transaction DEBUG one when `$TRIAGE_KAFKA_DEBUG_TRANSACTIONS` is 1."""
    return (
        LOG4J_TRANSACTIONS_CONFIG if environ.get(DEBUG_TRANSACTIONS_ENV, "").strip() == "1" else LOG4J_CONFIG
    )


def kafka_home(version: str | None = None) -> Path:
    """Where the jars are cached: `$TRIAGE_KAFKA_HOME`, else `~/.cache/triage-worker/kafka/<version>`."""
    override = os.environ.get("TRIAGE_KAFKA_HOME")
    return Path(override) if override else cache_root() / "kafka" / (version or configured_kafka_version())


def default_state_dir() -> Path:
    """`~/.cache/triage-worker/broker/<checkout folder>-<8 hex digits of its path>`: one per checkout, so that
    one checkout's `broker start --fresh` never wipes the topics of a broker another checkout runs (they
    all shared `broker/` before)."""
    digest = hashlib.sha256(str(SOURCE_ROOT).encode()).hexdigest()[:8]
    return cache_root() / "broker" / f"{SOURCE_ROOT.name}-{digest}"


def require_tool(name: str, install_hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(f"`{name}` was not found on PATH; the local Kafka broker needs it ({install_hint})")
    return path


def require_java(version: str = KAFKA_VERSION) -> str:
    java = require_tool(
        "java", f"install a Java {JAVA_MIN_MAJOR}+ runtime, e.g. `apt-get install openjdk-17-jre`"
    )
    # `java -version` prints e.g. `openjdk version "17.0.15" 2025-04-15` (or "1.8.0_392" for Java 8).
    result = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(?:1\.)?(\d+)', result.stderr)
    if match is None or int(match.group(1)) < JAVA_MIN_MAJOR:
        found = result.stderr.splitlines()[0] if result.stderr else "unknown version"
        raise UserError(f"Kafka {version} needs Java {JAVA_MIN_MAJOR}+, found: {found}")
    return java


def _pom_digest() -> str:
    return hashlib.sha256(checkout_file(POM_FILE, _CHECKOUT_ONLY, _INSTEAD).read_bytes()).hexdigest()


def jars_dir(home: Path | None = None) -> Path:
    return (home or kafka_home()) / "libs"


def _core_jar(version: str) -> str:
    return f"kafka_2.13-{version}.jar"


def jars_ready(home: Path | None = None, version: str | None = None) -> bool:
    version = version or configured_kafka_version()
    home = home or kafka_home(version)
    marker = home / ".complete"
    # The core jar's name tells the release apart where one TRIAGE_KAFKA_HOME served another version before.
    return (
        marker.is_file()
        and marker.read_text().strip() == _pom_digest()
        and (jars_dir(home) / _core_jar(version)).is_file()
    )


def _missing_release(version: str, maven_output: list[str]) -> bool:
    """Maven's words when Central has no such kafka_2.13 (worded otherwise once the miss is cached)."""
    artifact = rf"org\.apache\.kafka:kafka_2\.13:\w+:{re.escape(version)}\b"
    wanted = re.compile(rf"(Could not find artifact|Failure to find) {artifact}|{artifact} was not found")
    return any(wanted.search(line) for line in maven_output)


def fetch_jars(home: Path | None = None, echo: Echo = _print, version: str | None = None) -> Path:
    """Resolve the broker's jars for `version` (default: `configured_kafka_version()`) into the cache once;
    later calls return at once.

    The jars are copied into a temporary folder and renamed into place, and a marker records which pom they
    came from, so an interrupted or outdated fetch is never mistaken for a complete one.
    """
    version = version or configured_kafka_version()
    home = home or kafka_home(version)
    libs = jars_dir(home)
    if jars_ready(home, version):
        return libs
    mvn = require_tool("mvn", "install Apache Maven 3.8+, e.g. `apt-get install maven`")
    require_java(version)
    echo(f"Fetching Kafka {version} jars from Maven Central into {libs} (once; takes about a minute)")
    home.mkdir(parents=True, exist_ok=True)
    staging = home / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    command = [
        mvn,
        "--batch-mode",
        "-Dstyle.color=never",
        "-f",
        str(checkout_file(POM_FILE, _CHECKOUT_ONLY, _INSTEAD)),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging}",
        "-DincludeScope=runtime",
        # Overrides the pom's kafka.version (the default release), so one pom serves every release.
        f"-Dkafka.version={version}",
    ]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    output: list[str] = []
    try:
        for line in process.stdout:
            output.append(line.rstrip())
            # One line per downloaded jar: progress without Maven's noise (nothing when ~/.m2 has them).
            match = re.search(r"Downloaded from \S+: (\S+\.jar) ", line)
            if match:
                echo("  downloaded " + match.group(1).rsplit("/", 1)[-1])
    except BaseException:  # Ctrl-C, or the reader of `echo` gone: Maven must not go on alone
        process.kill()
        process.wait()
        raise
    if process.wait() != 0:
        shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            home.rmdir()  # only if the failed fetch left it empty: no folder for a release that is not there
        if _missing_release(version, output):
            raise UserError(
                f"Kafka {version} is not on Maven Central (no org.apache.kafka:kafka_2.13:{version})"
            )
        tail = "\n".join(output[-25:])
        raise UserError(f"Maven could not resolve the Kafka jars (`{' '.join(command)}`):\n{tail}")
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    (home / ".complete").write_text(_pom_digest() + "\n")
    echo(f"Fetched {len(list(libs.glob('*.jar')))} jars in {time.monotonic() - started:.0f}s")
    return libs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        # Reap it first if it is our own child that already exited, or kill(0) would see a zombie.
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_kafka_process(pid: int) -> bool:
    """Guard against a stale pid file whose pid now belongs to an unrelated process."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        return _pid_alive(pid)  # No procfs (macOS): trust the pid.
    try:
        return b"kafka.Kafka" in cmdline.read_bytes()
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    if not path.is_file():
        return f"({path} does not exist)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _cluster_id() -> str:
    """Same format as `kafka-storage random-uuid`, without paying for a JVM start."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass(frozen=True)
class SaslSsl:
    """A SASL_SSL listener on `port`: SCRAM-SHA-512 `users` (name → password) over TLS."""

    port: int
    # Kept out of repr: a SaslSsl in a traceback or log line must not show a password.
    users: Mapping[str, str] = field(repr=False)


def _scram_credential(name: str, password: str) -> str:
    """`--add-scram` argument holding the salted password (RFC 5802 Hi()), never the password itself: the
    format command line is visible to every process on the machine while it runs."""
    salt = secrets.token_bytes(32)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, SCRAM_ITERATIONS)
    salt_b64, salted_b64 = base64.b64encode(salt).decode(), base64.b64encode(salted).decode()
    return (
        f'{SCRAM_MECHANISM}=[name="{name}",salt="{salt_b64}",saltedpassword="{salted_b64}",'
        f"iterations={SCRAM_ITERATIONS}]"
    )


def _openssl(*args: str) -> None:
    openssl = require_tool("openssl", "install OpenSSL, e.g. `apt-get install openssl`")
    result = subprocess.run([openssl, *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise UserError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def generate_tls(directory: Path) -> None:
    """A throwaway CA (`ca.pem`) and a broker key + certificate chain for 127.0.0.1/localhost signed by it
    (`broker.pem`, the PEM keystore Kafka reads). EC P-256 keys: instant to make on a slow machine."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key, ca_cert = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / "broker.key", directory / "broker.csr", directory / "broker.crt"
    extensions = directory / "broker.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    days = ("-days", str(TLS_DAYS))
    _openssl(
        "req",
        "-x509",
        *curve,
        *days,
        "-keyout",
        str(ca_key),
        "-out",
        str(ca_cert),
        "-subj",
        "/CN=triage-worker local broker CA",
    )
    _openssl("req", *curve, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca_cert),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        *days,
        "-extfile",
        str(extensions),
        "-out",
        str(cert),
    )
    keystore = directory / "broker.pem"
    keystore.touch(mode=0o600)
    keystore.write_text(key.read_text() + cert.read_text() + ca_cert.read_text())
    # Only the CA certificate (for clients) and the keystore (for the broker) are needed from here on; the
    # CA key would let anyone who reads the folder mint certificates clients trust.
    for path in (ca_key, key, csr, cert, extensions, directory / "ca.srl"):
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    port: int | None
    state_dir: Path
    log_file: Path
    # The release that formatted the log dir; None before the first start (or for a dir from before it was
    # recorded).
    kafka_version: str | None = None

    @property
    def bootstrap(self) -> str | None:
        return f"127.0.0.1:{self.port}" if self.port is not None else None


@dataclass(frozen=True)
class Launch:
    """A broker JVM just started: its process, where its log stood before it (readiness is read from there
    on) and when it was started."""

    process: subprocess.Popen[bytes]
    log_offset: int
    started: float


class LocalBroker:
    """One single-node KRaft broker of release `kafka_version` (default `configured_kafka_version()`) whose
    whole state lives in `state_dir`. `transaction_version` (default `configured_transaction_version()`)
    is the transaction.version a fresh log dir is formatted with; None keeps the release's default."""

    def __init__(
        self,
        state_dir: Path | None = None,
        port: int = DEFAULT_PORT,
        home: Path | None = None,
        sasl_ssl: SaslSsl | None = None,
        kafka_version: str | None = None,
        transaction_version: int | None = None,
    ):
        self.state_dir = state_dir or default_state_dir()
        self.port = port
        self.kafka_version = (
            parse_kafka_version(kafka_version) if kafka_version else configured_kafka_version()
        )
        self.home = home or kafka_home(self.kafka_version)
        self.sasl_ssl = sasl_ssl
        self.transaction_version = (
            transaction_version if transaction_version is not None else configured_transaction_version()
        )

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sasl_ssl_bootstrap(self) -> str:
        if self.sasl_ssl is None:
            raise ValueError("this broker has no SASL_SSL listener")
        return f"127.0.0.1:{self.sasl_ssl.port}"

    def sasl_ssl_client_config(self, user: str) -> dict[str, str]:
        """librdkafka options with which `user` reaches the SASL_SSL listener."""
        if self.sasl_ssl is None or user not in self.sasl_ssl.users:
            raise ValueError(f"this broker has no SASL_SSL user {user!r}")
        return {
            "bootstrap.servers": self.sasl_ssl_bootstrap,
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": SCRAM_MECHANISM,
            "sasl.username": user,
            "sasl.password": self.sasl_ssl.users[user],
            "ssl.ca.location": str(self.ca_file),
        }

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    @property
    def ca_file(self) -> Path:
        """The CA that signed the broker's certificate: what a SASL_SSL client's `ssl.ca.location` names."""
        return self.tls_dir / "ca.pem"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def log_file(self) -> Path:
        return self.log_dir / "server.log"

    @property
    def stdout_file(self) -> Path:
        return self.log_dir / "stdout.log"

    @property
    def properties_file(self) -> Path:
        return self.state_dir / "server.properties"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "broker.pid"

    @property
    def _port_file(self) -> Path:
        return self.state_dir / "broker.port"

    @property
    def _version_file(self) -> Path:
        return self.state_dir / "kafka.version"

    @property
    def _marker_file(self) -> Path:
        return self.state_dir / STATE_MARKER

    def _check_wipeable(self) -> None:
        """Refuse (one line naming the folder and why) to wipe a state directory that is not the broker's own.

        A folder that does not exist or is empty has nothing to lose. Otherwise it must carry the marker, or
        (a state directory from before the marker) a `server.properties` this module wrote, and hold nothing
        but `STATE_ENTRIES`; a symbolic link is refused too (wiping it would not empty what it points to)."""
        state_dir = self.state_dir
        why = "pick another --state-dir, or empty it yourself"
        if state_dir.is_symlink():
            raise UserError(
                f"broker start --fresh: refusing to wipe {state_dir}: it is a symbolic link, "
                f"not a folder the local broker made; {why}"
            )
        if not state_dir.exists():
            return
        if not state_dir.is_dir():
            raise UserError(f"broker start --fresh: refusing to wipe {state_dir}: it is not a folder; {why}")
        entries = sorted(entry.name for entry in state_dir.iterdir())
        if not entries:
            return
        if not (self._marker_file.is_file() or _written_by_us(self.properties_file)):
            raise UserError(
                f"broker start --fresh: refusing to wipe {state_dir}: it is not a folder the local broker "
                f"made (no {STATE_MARKER} in it); {why}"
            )
        foreign = [name for name in entries if name not in STATE_ENTRIES and not _DEMO_LOG.fullmatch(name)]
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise UserError(
                f"broker start --fresh: refusing to wipe {state_dir}: it holds {shown}, which the local "
                f"broker did not write; {why}"
            )

    def _recorded_version(self) -> str | None:
        try:
            return self._version_file.read_text().strip() or None
        except OSError:
            return None

    def _recorded_pid(self) -> int | None:
        try:
            pid = int(self._pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) and _is_kafka_process(pid) else None

    def status(self) -> BrokerStatus:
        pid = self._recorded_pid()
        port: int | None = None
        if pid is not None:
            try:
                port = int(self._port_file.read_text().strip())
            except (OSError, ValueError):
                port = None
        return BrokerStatus(
            pid is not None, pid, port, self.state_dir, self.log_file, self._recorded_version()
        )

    def _classpath(self) -> str:
        return str(jars_dir(self.home) / "*")

    def _java_command(self, java: str, main_class: str, *args: str) -> list[str]:
        return [
            java,
            *HEAP_OPTS,
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.log_dir}",
            f"-Dlog4j2.configurationFile={checkout_file(log4j_config(), _CHECKOUT_ONLY, _INSTEAD)}",
            "-cp",
            self._classpath(),
            main_class,
            *args,
        ]

    def _controller_port(self) -> int:
        """Keep the controller port of an existing log dir: `--standalone` recorded it in the metadata."""
        if self.properties_file.is_file():
            match = re.search(r"CONTROLLER://127\.0\.0\.1:(\d+)", self.properties_file.read_text())
            if match is not None:
                return int(match.group(1))
        return free_port()

    def _write_properties(self, controller_port: int) -> None:
        text = _PROPERTIES_HEADER
        text += "".join(f"{key}={value}\n" for key, value in self._properties(controller_port).items())
        self.properties_file.write_text(text)

    def _properties(self, controller_port: int) -> dict[str, str]:
        """server.properties of the single combined node (a cluster's node changes the quorum and the
        replication of the internal topics)."""
        listeners = f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller_port}"
        protocols = "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
        secure: dict[str, str] = {}
        if self.sasl_ssl is not None:
            listeners += f",SASL_SSL://127.0.0.1:{self.sasl_ssl.port}"
            protocols += ",SASL_SSL:SASL_SSL"
            prefix = "listener.name.sasl_ssl."
            secure = {
                "sasl.enabled.mechanisms": SCRAM_MECHANISM,
                # Passwords are checked against the SCRAM credentials in the metadata; this enables SCRAM.
                f"{prefix}{SCRAM_MECHANISM.lower()}.sasl.jaas.config": (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                ),
                f"{prefix}ssl.keystore.type": "PEM",
                f"{prefix}ssl.keystore.location": str(self.tls_dir / "broker.pem"),
            }
        properties: dict[str, str] = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}",
            "listeners": listeners,
            # Pinned to 127.0.0.1: --standalone records the advertised controller address in the metadata.
            "advertised.listeners": listeners,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": protocols,
            "log.dirs": str(self.data_dir),
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # The default 3 s delay before the first group rebalance makes every consumer test slower.
            "group.initial.rebalance.delay.ms": "0",
            **secure,
        }
        return properties

    def _quorum_format_args(self) -> tuple[str, ...]:
        """How format learns the controller quorum: the single node is its own (KIP-853 `--standalone`)."""
        return ("--standalone",)

    def _format_cluster_id(self) -> str:
        """The cluster id a fresh log dir is formatted with: a new one (a cluster's nodes share one)."""
        return _cluster_id()

    def _format(self, java: str) -> None:
        command = self._java_command(
            java,
            "kafka.tools.StorageTool",
            "format",
            *self._quorum_format_args(),
            "-t",
            self._format_cluster_id(),
            "-c",
            str(self.properties_file),
            *(
                arg
                for name, password in (self.sasl_ssl.users.items() if self.sasl_ssl else ())
                for arg in ("--add-scram", _scram_credential(name, password))
            ),
            *(
                ("--feature", f"transaction.version={self.transaction_version}")
                if self.transaction_version is not None
                else ()
            ),
        )
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise UserError(
                f"formatting the Kafka log dir {self.data_dir} failed:\n{result.stdout}{result.stderr}"
            )

    def start(self, fresh: bool = True, timeout_s: float = 90.0, echo: Echo = _print) -> BrokerStatus:
        """Start the broker detached and wait until it serves clients.

        `fresh=True` wipes the state directory first; `fresh=False` keeps topics, messages and committed
        offsets of an earlier run (formatting only if the log dir was never formatted).
        """
        launched = self.launch(fresh, echo)
        if isinstance(launched, BrokerStatus):
            return launched
        self.await_ready(launched, timeout_s, echo)
        return self.status()

    def launch(self, fresh: bool = True, echo: Echo = _print) -> BrokerStatus | Launch:
        """Everything `start` does before it waits: the running broker's status if one runs already, else
        the JVM just started (a cluster's nodes are all launched before any can be ready: each waits for a
        controller quorum)."""
        current = self.status()
        if current.running:
            if fresh:
                raise UserError(
                    f"a local broker is already running (pid {current.pid}); stop it before a fresh start"
                )
            if current.kafka_version not in (None, self.kafka_version):
                raise UserError(
                    f"a local Kafka {current.kafka_version} broker is already running (pid {current.pid}); "
                    f"stop it before starting Kafka {self.kafka_version}"
                )
            return current
        if fresh:
            self._check_wipeable()
        if port_open(self.port):
            raise UserError(f"port {self.port} on 127.0.0.1 is already in use; pick another with --port")
        if self.sasl_ssl is not None and port_open(self.sasl_ssl.port):
            raise UserError(f"port {self.sasl_ssl.port} on 127.0.0.1 is already in use; pick another")
        fetch_jars(self.home, echo, self.kafka_version)
        java = require_java(self.kafka_version)
        if fresh:
            self._check_wipeable()  # again: the folder may have changed while the jars were fetched
            shutil.rmtree(self.state_dir, ignore_errors=True)
        make_state_dir(self.state_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        formatted = (self.data_dir / "meta.properties").is_file()
        formatted_by = self._recorded_version()
        if formatted and formatted_by not in (None, self.kafka_version):
            # Another release on the same metadata is an upgrade or downgrade to plan, not a restart.
            raise UserError(
                f"the log dir {self.data_dir} was formatted by Kafka {formatted_by}; "
                f"start Kafka {self.kafka_version} with --fresh (a new, empty log dir)"
            )
        if self.sasl_ssl is not None:
            if formatted and not self.ca_file.is_file():
                raise UserError(
                    f"the log dir {self.data_dir} was formatted without SASL_SSL users; "
                    "start it with --fresh to add them"
                )
            if not self.ca_file.is_file():
                generate_tls(self.tls_dir)
        self._write_properties(self._controller_port())
        if not formatted:
            self._format(java)
            self._version_file.write_text(f"{self.kafka_version}\n")

        started = time.monotonic()
        log_offset = self.log_file.stat().st_size if self.log_file.is_file() else 0
        with self.stdout_file.open("ab") as stdout:
            process = subprocess.Popen(
                self._java_command(java, "kafka.Kafka", str(self.properties_file)),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Survives the shell (and Ctrl-C) that started it.
            )
        self._pid_file.write_text(f"{process.pid}\n")
        self._port_file.write_text(f"{self.port}\n")
        return Launch(process, log_offset, started)

    def await_ready(self, launched: Launch, timeout_s: float = 90.0, echo: Echo = _print) -> None:
        """Wait until the launched JVM serves clients; stopped and forgotten if it does not in `timeout_s`."""
        process = launched.process
        try:
            self._wait_ready(process, launched.log_offset, launched.started + timeout_s)
        except BaseException:  # not ready in time, or Ctrl-C: a half-started broker that nobody would stop
            if process.poll() is None:
                _terminate(process.pid, _STOP_TIMEOUT_S)
            self._forget()
            raise
        took = time.monotonic() - launched.started
        echo(f"Kafka {self.kafka_version} broker ready in {took:.1f}s (pid {process.pid})")

    def _wait_ready(self, process: subprocess.Popen[bytes], log_offset: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise UserError(
                    f"the Kafka broker exited with code {process.returncode} while starting; "
                    f"log {self.log_file}:\n{_tail(self.log_file)}\n{_tail(self.stdout_file, 10)}"
                )
            if self._logged_ready(log_offset) and port_open(self.port):
                return
            time.sleep(0.2)
        raise UserError(
            f"the Kafka broker did not become ready on {self.bootstrap} in time; "
            f"log {self.log_file}:\n{_tail(self.log_file)}\n{_tail(self.stdout_file, 10)}"
        )

    def _logged_ready(self, offset: int) -> bool:
        try:
            with self.log_file.open("rb") as log:
                log.seek(offset)
                return READY_LINE.encode() in log.read()
        except OSError:
            return False

    def _forget(self) -> None:
        self._pid_file.unlink(missing_ok=True)
        self._port_file.unlink(missing_ok=True)

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> bool:
        """SIGTERM (a clean shutdown flushes logs), then SIGKILL after `timeout_s`; False if not running."""
        pid = self._recorded_pid()
        if pid is not None:
            _terminate(pid, timeout_s)
        self._forget()
        return pid is not None


def make_state_dir(state_dir: Path) -> None:
    """Make `state_dir` and mark it as the broker's own (`STATE_MARKER`): only a folder that did not exist or
    was empty is marked, so `start(fresh=True)` never takes a folder it merely wrote into for its own."""
    if state_dir.is_dir() and any(state_dir.iterdir()):
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / STATE_MARKER).write_text("A local Kafka broker's state (triage-worker broker start).\n")


def _written_by_us(properties_file: Path) -> bool:
    """Whether `properties_file` starts with the header `_write_properties` writes."""
    try:
        with properties_file.open(encoding="utf-8", errors="replace") as handle:
            return handle.readline() == _PROPERTIES_HEADER
    except OSError:
        return False


def _terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; returns once the process is gone."""
    with contextlib.suppress(ProcessLookupError):  # it may exit on its own meanwhile
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while _pid_alive(pid):
                time.sleep(0.05)
            return
        time.sleep(0.1)


# The three-node cluster (`LocalCluster`): combined broker+controller nodes, so that one JVM per node keeps
# the machine's load at three JVMs and a node's kill -9 also takes a controller (a quorum of three survives
# one lost voter, as a production KRaft quorum does). Static voters (controller.quorum.voters) need no
# directory ids at format time and let every node be formatted alike.
CLUSTER_SIZE = 3
CLUSTER_MIN_INSYNC = 2
CLUSTER_MARKER = ".triage-worker-cluster"
_NODE_DIR = re.compile(r"node-\d+")
# The partitions of __transaction_state (transaction.state.log.num.partitions' default), which decide a
# transactional id's coordinator.
TRANSACTION_STATE_PARTITIONS = 50


class ClusterNode(LocalBroker):
    """One node of a `LocalCluster`: a combined broker+controller whose quorum is the cluster's voters, and
    whose internal topics are replicated to every node with `CLUSTER_MIN_INSYNC` in sync."""

    def __init__(
        self,
        state_dir: Path,
        node_id: int,
        port: int,
        controller_port: int,
        voters: str,
        cluster_id: str,
        kafka_version: str | None = None,
        transaction_version: int | None = None,
    ):
        super().__init__(
            state_dir, port, kafka_version=kafka_version, transaction_version=transaction_version
        )
        self.node_id, self.controller_port, self.voters, self.cluster_id = (
            node_id,
            controller_port,
            voters,
            cluster_id,
        )

    def _controller_port(self) -> int:
        return self.controller_port

    def _quorum_format_args(self) -> tuple[str, ...]:
        return ()  # static voters: the quorum is in server.properties

    def _format_cluster_id(self) -> str:
        return self.cluster_id

    def _properties(self, controller_port: int) -> dict[str, str]:
        properties = super()._properties(controller_port)
        del properties["controller.quorum.bootstrap.servers"]
        replicas, insync = str(CLUSTER_SIZE), str(CLUSTER_MIN_INSYNC)
        return {
            **properties,
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters,
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "offsets.topic.replication.factor": replicas,
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": insync,
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": insync,
            # The worker's topics (created with the broker's default replication) as production has them.
            "default.replication.factor": replicas,
            "min.insync.replicas": insync,
            # A node back from a restart takes its partitions' leadership back within seconds, not 5 min.
            "leader.imbalance.check.interval.seconds": "10",
        }

    def kill(self) -> bool:
        """kill -9: no clean shutdown, no flushed log; False if it was not running."""
        pid = self._recorded_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while _pid_alive(pid):
                time.sleep(0.05)
        self._forget()
        return pid is not None


class LocalCluster:
    """Three local KRaft nodes (`ClusterNode`) on 127.0.0.1, client ports `port`..`port + 2`, state in
    `state_dir/node-<id>/`: replication factor 3 and min.insync.replicas 2 for the internal topics (offsets,
    transaction state, share-group state) and for topics created with the broker's default, so one node may
    be down while producers with acks=all and transactions go on. Faults: `stop_node` (clean), `kill_node`
    (kill -9), `start_node`, `restart_all`; `leader_of` and `coordinator_of` name the node a fault should hit.
    """

    def __init__(
        self,
        state_dir: Path | None = None,
        port: int | None = None,
        kafka_version: str | None = None,
        transaction_version: int | None = None,
    ):
        self.state_dir = state_dir or default_state_dir()
        # None: the first client port the cluster in `state_dir` recorded (for stop and status), else 9092.
        self.port = port if port is not None else int(self._layout().get("port", DEFAULT_PORT))
        ports = [self.port + index for index in range(CLUSTER_SIZE)]
        controllers = self._controller_ports()
        voters = ",".join(f"{n + 1}@127.0.0.1:{c}" for n, c in enumerate(controllers))
        cluster_id = self._cluster_id()
        self.nodes = [
            ClusterNode(
                self.state_dir / f"node-{n + 1}",
                n + 1,
                ports[n],
                controllers[n],
                voters,
                cluster_id,
                kafka_version,
                transaction_version,
            )
            for n in range(CLUSTER_SIZE)
        ]
        self.kafka_version = self.nodes[0].kafka_version
        self.transaction_version = self.nodes[0].transaction_version

    @staticmethod
    def exists(state_dir: Path) -> bool:
        """Whether `state_dir` holds a cluster's nodes (so `broker stop|status` act on all of them)."""
        return (state_dir / CLUSTER_MARKER).is_file()

    @property
    def _layout_file(self) -> Path:
        return self.state_dir / "cluster.properties"

    def _layout(self) -> dict[str, str]:
        try:
            lines = self._layout_file.read_text().splitlines()
        except OSError:
            return {}
        return dict(line.split("=", 1) for line in lines if "=" in line)

    def _controller_ports(self) -> list[int]:
        """The controller ports an existing cluster recorded (its voters), else free ones."""
        recorded = self._layout().get("controller.ports")
        if recorded:
            return [int(port) for port in recorded.split(",")]
        base = free_port_block(CLUSTER_SIZE)
        return [base + index for index in range(CLUSTER_SIZE)]

    def _cluster_id(self) -> str:
        return self._layout().get("cluster.id") or _cluster_id()

    @property
    def bootstrap(self) -> str:
        """Every node's client address: a client reaches the cluster with any one of them down."""
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> ClusterNode:
        return self.nodes[node_id - 1]

    def running(self) -> list[int]:
        return [node.node_id for node in self.nodes if node.status().running]

    def _check_wipeable(self) -> None:
        """Refuse to wipe a folder that is not a cluster's own: only its marker, its layout and node folders
        that each pass the single broker's check."""
        if not self.state_dir.exists() or not any(self.state_dir.iterdir()):
            return
        if not self.exists(self.state_dir):
            raise UserError(
                f"broker start --fresh: refusing to wipe {self.state_dir}: it is not a folder the local "
                f"cluster made (no {CLUSTER_MARKER} in it); pick another --state-dir, or empty it yourself"
            )
        own = {CLUSTER_MARKER, self._layout_file.name}
        foreign = [
            e.name for e in self.state_dir.iterdir() if e.name not in own and not _NODE_DIR.fullmatch(e.name)
        ]
        if foreign:
            raise UserError(
                f"broker start --fresh: refusing to wipe {self.state_dir}: it holds "
                f"{', '.join(foreign[:3])}, which the local cluster did not write; pick another --state-dir, "
                "or empty it yourself"
            )
        for node in self.nodes:
            node._check_wipeable()

    def start(self, fresh: bool = True, timeout_s: float = 120.0, echo: Echo = _print) -> list[BrokerStatus]:
        """Launch every node, then wait until each serves clients (none can alone: a quorum needs two)."""
        if fresh:
            if self.running():
                raise UserError("a local cluster is already running; stop it before a fresh start")
            self._check_wipeable()
            shutil.rmtree(self.state_dir, ignore_errors=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / CLUSTER_MARKER).write_text(
            "A local Kafka cluster's state (triage-worker broker).\n"
        )
        controllers = ",".join(str(node.controller_port) for node in self.nodes)
        self._layout_file.write_text(
            f"cluster.id={self.nodes[0].cluster_id}\ncontroller.ports={controllers}\nport={self.port}\n"
        )
        self._start_nodes([node.node_id for node in self.nodes], timeout_s, echo)
        return [node.status() for node in self.nodes]

    def _start_nodes(self, node_ids: list[int], timeout_s: float, echo: Echo) -> None:
        launched = [(node, node.launch(fresh=False, echo=echo)) for node in map(self.node, node_ids)]
        try:
            for node, launch in launched:
                if isinstance(launch, Launch):
                    node.await_ready(launch, timeout_s, _prefixed(echo, f"node {node.node_id}: "))
        except BaseException:
            for node, _ in launched:
                node.stop()
            raise

    def stop(self) -> bool:
        """Stop every node (cleanly) at once, False if none was running: one by one, the last nodes would
        wait out their stop timeout for a quorum that left before them."""
        with concurrent.futures.ThreadPoolExecutor(CLUSTER_SIZE) as pool:
            return any(list(pool.map(lambda node: node.stop(), self.nodes)))

    def stop_node(self, node_id: int) -> None:
        """A clean shutdown of one node (a rolling restart's step): its leaderships move first."""
        self.node(node_id).stop()

    def kill_node(self, node_id: int) -> None:
        """kill -9 of one node: leaders, coordinators and a controller vanish without a word."""
        self.node(node_id).kill()

    def start_node(self, node_id: int, timeout_s: float = 120.0, echo: Echo = _print) -> None:
        """Start one stopped node on its data and wait until it serves clients."""
        self._start_nodes([node_id], timeout_s, echo)

    def restart_all(self, outage_s: float = 0.0, timeout_s: float = 120.0, echo: Echo = _print) -> None:
        """The whole-cluster outage: every node stopped, `outage_s` of nothing, every node started again."""
        self.stop()
        time.sleep(outage_s)
        self._start_nodes([node.node_id for node in self.nodes], timeout_s, echo)

    def leader_of(self, topic: str, partition: int, timeout_s: float = 10.0) -> int:
        """The node that leads `topic`'s `partition` (from the cluster's metadata)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        topics = admin.list_topics(topic, timeout=timeout_s).topics
        found = topics.get(topic)
        if found is None or partition not in found.partitions or found.partitions[partition].leader < 0:
            raise UserError(f"{topic}[{partition}] has no leader now")
        return int(found.partitions[partition].leader)

    def wait_fully_replicated(self, timeout_s: float = 120.0) -> bool:
        """Wait until every partition's in-sync replicas are all its replicas (what a rolling restart
        waits for before the next node); False if some are still behind after `timeout_s`."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # metadata not served yet: ask again
                topics = admin.list_topics(timeout=10).topics.values()
                if all(len(p.isrs) == len(p.replicas) for t in topics for p in t.partitions.values()):
                    return True
            time.sleep(1.0)
        return False

    def coordinator_of(self, transactional_id: str, timeout_s: float = 10.0) -> int:
        """The node that is the transaction coordinator for `transactional_id`: the leader of its
        __transaction_state partition (librdkafka offers no FindCoordinator call of its own)."""
        return self.leader_of("__transaction_state", transaction_state_partition(transactional_id), timeout_s)


# Below Linux's ephemeral range (32768-60999): a port there may be taken by any outgoing connection while a
# killed node is down, and its restart then fails to bind (seen in a cluster chaos run).
_FIXED_PORTS = range(20000, 32000)


def free_port_block(count: int) -> int:
    """The first of `count` consecutive free ports below the ephemeral range (a cluster's nodes keep their
    ports across restarts), from a random start so that two clusters rarely race for one block."""
    start = secrets.randbelow(len(_FIXED_PORTS) - count)
    for offset in range(len(_FIXED_PORTS) - count):
        base = _FIXED_PORTS.start + (start + offset) % (len(_FIXED_PORTS) - count)
        if not any(port_open(base + index) for index in range(count)) and all(
            _bindable(base + index) for index in range(count)
        ):
            return base
    raise UserError(
        f"no {count} consecutive free ports on 127.0.0.1 in {_FIXED_PORTS.start}-{_FIXED_PORTS.stop}"
    )


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _prefixed(echo: Echo, prefix: str) -> Echo:
    """`echo` with each line starting with `prefix` (which node of a cluster said it)."""
    return lambda line: echo(prefix + line)


def transaction_state_partition(transactional_id: str, partitions: int = TRANSACTION_STATE_PARTITIONS) -> int:
    """The __transaction_state partition Kafka maps `transactional_id` to (TransactionStateManager's
    partitionFor): Java's String.hashCode over UTF-16 code units, Utils.abs (|n|, 0 for Integer.MIN_VALUE),
    modulo the partition count."""
    code = 0
    units = transactional_id.encode("utf-16-be")
    for index in range(0, len(units), 2):
        code = (31 * code + int.from_bytes(units[index : index + 2], "big")) & 0xFFFFFFFF
    signed = code - (1 << 32) if code >= 1 << 31 else code
    return (0 if signed == -(1 << 31) else abs(signed)) % partitions
