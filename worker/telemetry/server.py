"""The HTTP side of telemetry: `/metrics`, `/healthz`, `/readyz` (and the worker's `POST /reload`, for
holders of its token only: see access.py) on a threading WSGI server in a daemon thread, never on the
consumer's thread; `Probes` is what a process answers.

Each connection has a thread of its own, so a client that connects and says nothing, or sends its request a
byte at a time, would hold one for as long as it likes, and enough of them would exhaust the process's
threads (a pod's pid limit) and with them the worker's own. Hence: a connection idle for `IDLE_TIMEOUT_S` is
closed, one still unanswered `REQUEST_DEADLINE_S` after it was accepted is cut off, and at most
`MAX_CONNECTIONS` are open at once (one more is closed at once, logged once per interval). A scrape or a probe
sends its request at once and is answered in milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import sys
import threading
import time
import wsgiref.simple_server
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from worker.errors import UserError
from worker.logs import Throttle
from worker.settings import MetricsSettings
from worker.telemetry.access import Refusal, ReloadAccess

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

_log = structlog.get_logger("worker.telemetry")
# Longer than any scraper or prober takes to send its request (kubelet probes time out after 3 s here).
IDLE_TIMEOUT_S = 5.0
# From accept to the answer sent: Prometheus' own scrape timeout is 10 s.
REQUEST_DEADLINE_S = 10.0
# Prometheus (a pair for HA), the kubelet's probes and an operator's curl need a handful.
MAX_CONNECTIONS = 64
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
                settings.host, settings.port, self._app, _BoundedServer, handler_class=_QuietHandler
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


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most `MAX_CONNECTIONS` at once, each cut off `REQUEST_DEADLINE_S` after it
    was accepted (the handler's socket timeout closes idle ones sooner)."""

    # The listen backlog (socketserver's is 5): a burst of connections waits in the kernel's queue for its
    # accept instead of having its SYNs dropped and retried a second later.
    request_queue_size = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # each open connection → when it is cut off
        self._refusals = Throttle()

    def server_bind(self) -> None:
        """As http.server's, less its `socket.getfqdn` of the address: a name look-up (the host's own name, by
        DNS where /etc/hosts lacks it, for the default 0.0.0.0) that a worker which connects nowhere but its
        broker, its registry and this port must not make. SERVER_NAME is the address it listens on."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.socket.getsockname()[:2]
        self.server_name, self.server_port = host, port
        self.setup_environ()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._deadlines) >= MAX_CONNECTIONS
            if not full:
                self._deadlines[request] = time.monotonic() + REQUEST_DEADLINE_S
        if full:
            self.shutdown_request(request)
            suppressed = self._refusals.admit("connections")
            if suppressed is not None:
                _log.warning(
                    "telemetry_connection_refused",
                    reason=f"{MAX_CONNECTIONS} connections are open, the most the port serves at once",
                    client=client_address[0],
                    suppressed_since_last=suppressed,
                )
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread was started; the caller closes the connection
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def service_actions(self) -> None:
        """Runs on the serving thread between accepts (at least every half second): a shutdown wakes the
        connection's thread from its read or write, which then ends."""
        now = time.monotonic()
        with self._lock:
            late = [connection for connection, deadline in self._deadlines.items() if deadline <= now]
        for connection in late:
            with contextlib.suppress(OSError):  # closed meanwhile
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out, was cut off or reset is the client's doing: it is closed, and that
        is all (the default prints a traceback). Anything else is still reported."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def _forget(self, request: Any) -> None:
        with self._lock:
            self._deadlines.pop(request, None)


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    """No access log: probes every few seconds would drown the worker's own events. Every read and write
    on the connection waits at most `IDLE_TIMEOUT_S`."""

    timeout = IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


def new_registry() -> CollectorRegistry:
    """A registry with the process (CPU, RSS, open fds) and Python platform collectors, and nothing global."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
