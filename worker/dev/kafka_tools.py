"""Kafka's own transaction tool (`kafka-transactions.sh`'s TransactionsCommand) run from Maven Central jars:
what `triage-worker broker transactions` hands its arguments to.

librdkafka has no describe-producers, list-transactions or abort-transaction call (KIP-664 is not in it;
docs/guarantees.md), so a hanging transaction the worker suspects
(worker/pipeline/hanging.py) is found and ended with the Java tool: `find-hanging`, `describe-producers`,
`list`, `describe` and `abort`. Needs Java 17+ and Maven on the operator's machine, as the local broker
does; the jars (org.apache.kafka:kafka-tools, deploy/kafka/tools-pom.xml) are resolved once into
`~/.cache/triage-worker/kafka-tools/<version>/libs`.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from worker.cache import cache_root
from worker.dev.local_broker import Echo, configured_kafka_version, require_java, require_tool
from worker.errors import UserError
from worker.shipped import checkout_file

TOOLS_POM_FILE = "deploy/kafka/tools-pom.xml"
MAIN_CLASS = "org.apache.kafka.tools.TransactionsCommand"
_CHECKOUT_ONLY = "Kafka's transaction tool"
_INSTEAD = "run kafka-transactions.sh from a Kafka download"


def _print(line: str) -> None:
    print(line, flush=True)  # before the tool's own output


def tools_home(version: str) -> Path:
    return cache_root() / "kafka-tools" / version


def _pom() -> Path:
    return checkout_file(TOOLS_POM_FILE, _CHECKOUT_ONLY, _INSTEAD)


def fetch_tools(version: str, echo: Echo) -> Path:
    """The tool's jars for `version`, resolved by Maven once (a marker names the pom they came from)."""
    home = tools_home(version)
    libs, marker = home / "libs", home / ".complete"
    digest = hashlib.sha256(_pom().read_bytes()).hexdigest()
    if (
        marker.is_file()
        and marker.read_text().strip() == digest
        and (libs / f"kafka-tools-{version}.jar").is_file()
    ):
        return libs
    mvn = require_tool("mvn", "install Apache Maven 3.8+, e.g. `apt-get install maven`")
    echo(f"Fetching Kafka {version}'s tools from Maven Central into {libs} (once)")
    staging = home / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    command = [
        mvn,
        "--batch-mode",
        "-q",
        "-f",
        str(_pom()),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging}",
        "-DincludeScope=runtime",
        f"-Dkafka.version={version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-20:])
        raise UserError(f"Maven could not resolve org.apache.kafka:kafka-tools:{version}:\n{tail}")
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    marker.write_text(digest + "\n")
    return libs


def transactions_command(
    bootstrap: str, arguments: Sequence[str], version: str | None = None, echo: Echo = _print
) -> list[str]:
    """The java command line that runs TransactionsCommand against `bootstrap` with `arguments` (an action
    and its options, as kafka-transactions.sh takes them)."""
    version = version or configured_kafka_version()
    java = require_java(version)
    libs = fetch_tools(version, echo)
    return [java, "-Xmx256m", "-cp", str(libs / "*"), MAIN_CLASS, "--bootstrap-server", bootstrap, *arguments]


def run_transactions(bootstrap: str, arguments: Sequence[str], version: str | None = None) -> int:
    """Run TransactionsCommand with the terminal's output; its exit code."""
    if not arguments:
        raise UserError("name an action: list, describe, describe-producers, find-hanging or abort")
    return subprocess.run(transactions_command(bootstrap, arguments, version), check=False).returncode
