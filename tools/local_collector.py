"""A real OpenTelemetry Collector for the tests: OTLP in (gRPC and HTTP), every span out to a file.

The Collector is built once from its Go modules (`tools/otelcol/`: the OTLP receiver and the file exporter,
nothing else; all collector modules at one release, `COLLECTOR_RELEASE`) with the Go toolchain into
`~/.cache/triage-worker/otelcol/<release>/`, as the local broker's jars are fetched once. Without Go, or
without the Go module proxy the first time, `collector_binary` raises `CollectorUnavailable` with the reason
(the tests skip with it).

`LocalCollector(binary, folder)` runs it on two free ports of 127.0.0.1 (`grpc_endpoint`, `http_endpoint`)
and `spans()` reads back what it exported (the file exporter's OTLP JSON lines), as plain dicts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from worker.cache import cache_root
from worker.dev.local_broker import free_port, port_open

COLLECTOR_RELEASE = "v0.161.0"  # tools/otelcol/go.mod's; contrib's file exporter has no newer tried release
SOURCE_DIR = Path(__file__).resolve().parent / "otelcol"
_GO_CANDIDATES = ("go", "/usr/local/go/bin/go")
_BUILD_TIMEOUT_S = 900.0
_START_TIMEOUT_S = 20.0


class CollectorUnavailable(Exception):
    """The Collector cannot be built here (no Go toolchain, no module proxy); the message says why."""


def collector_binary() -> Path:
    """The Collector built for `COLLECTOR_RELEASE`, building it the first time (a few minutes)."""
    target = cache_root() / "otelcol" / COLLECTOR_RELEASE / "otelcol-triage"
    if target.is_file():
        return target
    go = next((found for name in _GO_CANDIDATES if (found := shutil.which(name))), None)
    if go is None:
        raise CollectorUnavailable("no Go toolchain (go) to build the OpenTelemetry Collector with")
    target.parent.mkdir(parents=True, exist_ok=True)
    # A build of its own per process: two test processes may build at once (pytest-xdist), and a shared
    # partial file would be renamed away under the second one. The rename is atomic; the last one wins.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        built = subprocess.run(
            [go, "build", "-trimpath", "-o", str(partial), "."],
            cwd=SOURCE_DIR,
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise CollectorUnavailable(f"building the Collector took over {_BUILD_TIMEOUT_S:.0f} s") from None
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no output"])[-1]
        raise CollectorUnavailable(f"building the Collector failed: {last}")
    partial.replace(target)
    return target


class LocalCollector:
    """The Collector at `binary` run with its state in `folder` (config, exported spans, log)."""

    def __init__(self, binary: Path, folder: Path) -> None:
        self._binary = binary
        self._folder = folder
        self._grpc_port, self._http_port = free_port(), free_port()
        self._spans_file = folder / "spans.jsonl"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._http_port}"

    def __enter__(self) -> LocalCollector:
        config = self._folder / "collector.yaml"
        config.write_text(
            "\n".join(
                [
                    "receivers:",
                    "  otlp:",
                    "    protocols:",
                    f"      grpc: {{endpoint: '127.0.0.1:{self._grpc_port}'}}",
                    f"      http: {{endpoint: '127.0.0.1:{self._http_port}'}}",
                    "exporters:",
                    f"  file: {{path: '{self._spans_file}', flush_interval: 100ms}}",
                    "service:",
                    "  telemetry: {metrics: {level: none}, logs: {level: warn}}",
                    "  pipelines:",
                    "    traces: {receivers: [otlp], exporters: [file]}",
                    "",
                ]
            ),
            encoding="utf-8",
        )
        log = (self._folder / "collector.log").open("wb")
        self._process = subprocess.Popen(
            [str(self._binary), f"--config=file:{config}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not (port_open(self._grpc_port) and port_open(self._http_port)):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                tail = (self._folder / "collector.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the Collector did not start: {tail}")
            time.sleep(0.05)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def exported(self) -> str:
        """The file exporter's output so far, as written (OTLP JSON, one export a line)."""
        return self._spans_file.read_text(encoding="utf-8") if self._spans_file.exists() else ""

    def spans(self) -> list[dict[str, Any]]:
        """Every span exported so far (OTLP JSON: `traceId`, `spanId`, `parentSpanId`, `name`, `kind`,
        `attributes`, `events`, `status`), each with its resource's attributes under `resource`."""
        found: list[dict[str, Any]] = []
        for line in self.exported().splitlines():
            if not line.strip():
                continue
            for resource_spans in json.loads(line).get("resourceSpans", []):
                resource = resource_spans.get("resource", {}).get("attributes", [])
                for scope_spans in resource_spans.get("scopeSpans", []):
                    for span in scope_spans.get("spans", []):
                        found.append({**span, "resource": resource})
        return found


def attributes(item: dict[str, Any]) -> dict[str, Any]:
    """An OTLP JSON item's `attributes` as a plain dict (each value unwrapped from its typed form)."""
    return {entry["key"]: next(iter(entry["value"].values()), None) for entry in item.get("attributes", [])}
