"""Who may `POST /reload`: whoever presents the token the operator put in `metrics.reload_token_file`.

The endpoint shares its port with `/metrics` and the probes, which stay open for scraping, and that port binds
0.0.0.0 by default; every reload starts a new pool of model processes. So without a configured token the
endpoint is closed (SIGHUP still reloads), and with one a request must carry `Authorization: Bearer <token>`:

- no token configured: 403, whatever the request carries;
- no bearer credentials: 401 with `WWW-Authenticate` (ask again with the token);
- a wrong token: 403.

The token is read once at start (a new one needs a restart, as every `metrics` setting does) and only its
SHA-256 digest is kept; a presented token is hashed the same way and the digests compared with
`hmac.compare_digest`, so the time a comparison takes says nothing about the token, not even its length.
Neither the token nor a presented credential is ever logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from worker.errors import UserError
from worker.settings import MetricsSettings

MIN_TOKEN_CHARS = 16
# A token file is a line; anything larger is the wrong file (and /dev/zero must not be read without end).
MAX_TOKEN_FILE_BYTES = 4096
_KEY = "metrics.reload_token_file"


@dataclass(frozen=True)
class Refusal:
    """Why a request may not reload: the HTTP status line and a reason that names no credential."""

    status: str
    reason: str
    # 401 only: tells the client which credentials to send.
    challenge: bool = False


CLOSED = Refusal(
    "403 Forbidden",
    f"POST /reload is closed: no {_KEY} is configured; reload with SIGHUP, or configure a token file",
)
NO_CREDENTIALS = Refusal(
    "401 Unauthorized",
    f"POST /reload needs the token in {_KEY}: send Authorization: Bearer <token>",
    challenge=True,
)
WRONG_TOKEN = Refusal("403 Forbidden", "POST /reload refused: wrong token")


class ReloadAccess:
    """Checks a request's `Authorization` header against the configured token's digest (None: closed)."""

    def __init__(self, token: bytes | None) -> None:
        self._digest = None if token is None else hashlib.sha256(token).digest()

    @classmethod
    def configured(cls, settings: MetricsSettings) -> ReloadAccess:
        """From `metrics.reload_token_file`; UserError (one line, no content of the file) when it is unfit."""
        path = settings.reload_token_file
        return cls(None if path is None else read_token(Path(path)))

    @property
    def closed(self) -> bool:
        return self._digest is None

    def refusal(self, authorization: str | None) -> Refusal | None:
        """None when `authorization` (the header's value, as WSGI gives it) carries the token."""
        if self._digest is None:
            return CLOSED
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return NO_CREDENTIALS
        # WSGI decodes header bytes as latin-1: encoding back gives the bytes the client sent.
        presented = hashlib.sha256(credentials.strip().encode("latin-1")).digest()
        return None if hmac.compare_digest(presented, self._digest) else WRONG_TOKEN


def read_token(path: Path) -> bytes:
    """The token in `path` (surrounding whitespace, e.g. the newline of `echo`, removed), or UserError.

    Refused: a path that is not a regular file or cannot be read; a file other users may read or write (the
    token would not be a secret; on POSIX systems only); more than `MAX_TOKEN_FILE_BYTES`; a token shorter
    than `MIN_TOKEN_CHARS` or holding anything but printable ASCII without spaces (it travels in a header).
    """
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise _unfit(path, "is not a regular file")
        if os.name == "posix" and info.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            raise _unfit(
                path,
                f"can be read or written by any user (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"chmod o-rw {path}",
            )
        with path.open("rb") as handle:
            content = handle.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as error:
        raise _unfit(path, f"cannot be read: {error.strerror or error}") from None
    if len(content) > MAX_TOKEN_FILE_BYTES:
        raise _unfit(path, f"is larger than {MAX_TOKEN_FILE_BYTES} bytes: not a token file")
    token = content.strip()
    if not token:
        raise _unfit(path, f"is empty{_TOKEN_HINT}")
    if not all(0x21 <= byte <= 0x7E for byte in token):
        raise _unfit(path, f"holds a space, a line break or a character outside printable ASCII{_TOKEN_HINT}")
    if len(token) < MIN_TOKEN_CHARS:
        raise _unfit(path, f"holds fewer than {MIN_TOKEN_CHARS} characters{_TOKEN_HINT}")
    return token


_TOKEN_HINT = (
    f"; it must hold one token of at least {MIN_TOKEN_CHARS} characters, e.g. `openssl rand -hex 32`"
)


def _unfit(path: Path, problem: str) -> UserError:
    return UserError(f"config error: {_KEY}: {path} {problem}")
