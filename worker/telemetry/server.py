"""The HTTP side of telemetry: `/metrics`, `/healthz`, `/readyz` (and the worker's `POST /reload`) on a
threading WSGI server in a daemon thread, never on the consumer's thread; `Probes` is what a process
answers."""

from __future__ import annotations

import json
import threading
import wsgiref.simple_server
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from worker.config import MetricsSettings
from worker.errors import UserError

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment


@dataclass(frozen=True)
class Check:
    ok: bool
    detail: str


def report(checks: dict[str, Check]) -> tuple[bool, dict[str, Any]]:
    ok = all(check.ok for check in checks.values())
    return ok, {
        "status": "ok" if ok else "fail",
        "checks": {name: {"ok": check.ok, "detail": check.detail} for name, check in checks.items()},
    }


class Probes:
    """What /healthz and /readyz answer; this default (short-lived commands such as replay) is always ok."""

    def live(self) -> tuple[bool, dict[str, Any]]:
        return report({})

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return report({})


class TelemetryServer:
    """/metrics, /healthz and /readyz on a threading WSGI server in a daemon thread."""

    def __init__(self, settings: MetricsSettings, registry: CollectorRegistry, probes: Probes) -> None:
        assert settings.port is not None
        self._metrics_app = make_wsgi_app(registry)
        self._probes = probes
        # What `POST /reload` calls (it must not block); None: the path does not exist.
        self.reload: Callable[[], None] | None = None
        try:
            self._server = wsgiref.simple_server.make_server(
                settings.host, settings.port, self._app, ThreadingWSGIServer, handler_class=_QuietHandler
            )
        except OSError as error:
            raise UserError(
                f"cannot serve metrics on {settings.host}:{settings.port}: {error.strerror or error}"
            ) from None
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="telemetry", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> TelemetryServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path == "/reload" and self.reload is not None:
            if environ.get("REQUEST_METHOD") != "POST":
                start_response("405 Method Not Allowed", [("Allow", "POST"), ("Content-Type", "text/plain")])
                return [b"POST /reload starts a reload\n"]
            self.reload()
            start_response("202 Accepted", [("Content-Type", "application/json")])
            return [b'{"status": "accepted", "outcome": "see the logs and triage_reloads_total"}\n']
        probe: Callable[[], tuple[bool, dict[str, Any]]] | None = {
            "/healthz": self._probes.live,
            "/readyz": self._probes.ready,
        }.get(path)
        if probe is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"try /metrics, /healthz or /readyz\n"]
        ok, body = probe()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [json.dumps(body).encode() + b"\n"]


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    """No access log: probes every few seconds would drown the worker's own events."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def new_registry() -> CollectorRegistry:
    """A registry with the process (CPU, RSS, open fds) and Python platform collectors, and nothing global."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
