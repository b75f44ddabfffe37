"""The HTTP side of telemetry: `/metrics`, `/healthz`, `/readyz` (and the worker's `POST /reload`, for
holders of its token only: see access.py) on a threading WSGI server in a daemon thread, never on the
consumer's thread; `Probes` is what a process answers."""

from __future__ import annotations

import json
import threading
import wsgiref.simple_server
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from worker.config import MetricsSettings
from worker.errors import UserError
from worker.logs import Throttle
from worker.telemetry.access import Refusal, ReloadAccess

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

_log = structlog.get_logger("worker.telemetry")
_BUSY = (
    "a reload is already waiting or running, and reloads go one at a time: its outcome is logged "
    "(reload_succeeded or reload_failed) and counted in triage_reloads_total; ask again after it"
)


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
        # See `serve_reload`; None: the path does not exist.
        self._reload: tuple[Callable[[], bool], ReloadAccess] | None = None
        # Refused requests are logged once per reason and interval: knocking must not flood the log.
        self._refusals = Throttle()
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

    def serve_reload(self, request: Callable[[], bool], access: ReloadAccess) -> None:
        """Answer `POST /reload` from now on: `access` decides who may; `request` asks for a reload without
        blocking and says whether it was taken (False: one is already waiting or running, answered 409)."""
        self._reload = (request, access)

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
        if path == "/reload" and self._reload is not None:
            return self._answer_reload(environ, start_response, *self._reload)
        probe: Callable[[], tuple[bool, dict[str, Any]]] | None = {
            "/healthz": self._probes.live,
            "/readyz": self._probes.ready,
        }.get(path)
        if probe is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"try /metrics, /healthz or /readyz\n"]
        ok, body = probe()
        return _json(start_response, "200 OK" if ok else "503 Service Unavailable", body)

    def _answer_reload(
        self,
        environ: WSGIEnvironment,
        start_response: StartResponse,
        request: Callable[[], bool],
        access: ReloadAccess,
    ) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "POST":
            start_response("405 Method Not Allowed", [("Allow", "POST"), ("Content-Type", "text/plain")])
            return [b"POST /reload starts a reload\n"]
        refusal = access.refusal(environ.get("HTTP_AUTHORIZATION"))
        if refusal is not None:
            self._log_refusal(refusal, environ.get("REMOTE_ADDR", "?"))
            challenge = [("WWW-Authenticate", 'Bearer realm="reload"')] if refusal.challenge else []
            return _json(
                start_response, refusal.status, {"status": "refused", "reason": refusal.reason}, challenge
            )
        if not request():
            return _json(start_response, "409 Conflict", {"status": "busy", "reason": _BUSY})
        body = {"status": "accepted", "outcome": "see the logs and triage_reloads_total"}
        return _json(start_response, "202 Accepted", body)

    def _log_refusal(self, refusal: Refusal, client: str) -> None:
        suppressed = self._refusals.admit(refusal)
        if suppressed is not None:
            _log.warning(
                "reload_refused",
                status=refusal.status,
                reason=refusal.reason,
                client=client,
                suppressed_since_last=suppressed,
            )


def _json(
    start_response: StartResponse,
    status: str,
    body: dict[str, Any],
    headers: list[tuple[str, str]] | None = None,
) -> Iterable[bytes]:
    start_response(status, [("Content-Type", "application/json"), *(headers or [])])
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
