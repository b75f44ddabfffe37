"""Redaction: the text of every copy the worker makes of a ticket, with its personal data replaced.

A `Redactor` is built once from the settings' kinds (`privacy.detect`, `privacy.keep`, `privacy.phone_region`)
and used for each ticket once (`scan`): the resulting `TicketScan` carries the kinds found (a result's `pii`)
and the redacted subject and body, which the review record, the model (with `inference.redact_input`) and
the dead letter (with `dead_letter.redact`) all take from it, so no ticket is searched twice.

Placeholders name the kind and never carry enough to recover the value: a card keeps its last four digits,
the most PCI DSS requirement 3.4 lets a display show without a business need for more.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass

from worker.privacy.detector import KINDS, Finding, Kind, find

_PLACEHOLDERS: dict[Kind, str] = {
    "email": "[email]",
    "iban": "[iban]",
    "us_ssn": "[ssn]",
    "phone": "[phone]",
}


def placeholder(finding: Finding, text: str) -> str:
    """What replaces `finding` in `text`: `[card ••••1234]` for a card, `[kind]` for the others."""
    if finding.kind == "card_number":
        digits = [char for char in text[finding.start : finding.end] if char.isdigit()]
        return f"[card ••••{''.join(digits[-4:])}]"
    return _PLACEHOLDERS[finding.kind]


def redact_findings(text: str, findings: Iterable[Finding]) -> str:
    """`text` with each of `findings` (left to right, not overlapping) replaced by its placeholder."""
    parts: list[str] = []
    at = 0
    for finding in findings:
        parts.append(text[at : finding.start])
        parts.append(placeholder(finding, text))
        at = finding.end
    parts.append(text[at:])
    return "".join(parts)


# The escapes of JSON strings and of Python's reprs (`\u0034`, `\x34`, `\n`, ...): a raw value, an error
# message or a log line quoting one may hold identifiers behind them.
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x([0-9a-fA-F]{2})|(.))", re.DOTALL)
_SINGLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f"}


@dataclass(frozen=True, slots=True)
class _Unescaped:
    """`text` with its escapes decoded, and where each of its positions came from: position `p` of `text`
    is `origin_at[i] + (p - decoded_at[i])` of the original, `i` the last anchor at or before `p` (an
    escape decodes to one character, so anchors sit on both sides of each)."""

    text: str
    decoded_at: list[int]
    origin_at: list[int]

    def origin(self, position: int) -> int:
        anchor = bisect.bisect_right(self.decoded_at, position) - 1
        return self.origin_at[anchor] + position - self.decoded_at[anchor]


def _unescaped(text: str) -> _Unescaped:
    parts: list[str] = []
    decoded_at, origin_at = [0], [0]
    at = length = 0
    for escape in _ESCAPE.finditer(text):
        hex_digits = escape[1] or escape[2] or escape[3]
        if hex_digits is None:
            char = _SINGLE_ESCAPES.get(escape[4], escape[4])
        elif int(hex_digits, 16) <= 0x10FFFF:
            char = chr(int(hex_digits, 16))
        else:
            continue  # no character: left as written
        parts += (text[at : escape.start()], char)
        length += escape.start() - at
        decoded_at += (length, length + 1)
        origin_at += (escape.start(), escape.end())
        length += 1
        at = escape.end()
    parts.append(text[at:])
    return _Unescaped("".join(parts), decoded_at, origin_at)


@dataclass(frozen=True, slots=True)
class TicketScan:
    """One ticket's personal data: `kinds` found (in `KINDS` order, each once; what a result's `pii` lists),
    `counts` of each, and the subject and body with every kind not kept in clear redacted."""

    kinds: tuple[Kind, ...]
    counts: tuple[tuple[Kind, int], ...]
    subject: str | None
    body: str


class Redactor:
    """Detects `detect` kinds and redacts those not in `keep`; `region` is the country of phone numbers
    written without a country code (None: only numbers with a +prefix are found)."""

    def __init__(
        self,
        detect: Iterable[Kind] = KINDS,
        keep: Iterable[Kind] = (),
        region: str | None = "US",
    ) -> None:
        self._detect = frozenset(detect)
        self._keep = frozenset(keep)
        self._region = region

    def findings(self, text: str) -> list[Finding]:
        return find(text, self._region, self._detect) if self._detect else []

    def to_hide(self, text: str) -> list[Finding]:
        """The findings in `text` that are not of a kind kept in clear: what `redact` replaces."""
        return [f for f in self.findings(text) if f.kind not in self._keep]

    def redact(self, text: str) -> str:
        """`text` with the detected kinds not kept replaced (the text itself when there are none). Escapes
        (JSON's `\\u0034`, Python's `\\x34`, `\\n`, ...) are decoded before the text is searched, so that
        a raw value or a message quoting one hides nothing behind them; what is found is replaced where it
        was written, escapes and all."""
        if "\\" in text:
            unescaped = _unescaped(text)
            if unescaped.text != text:
                return self._redact_unescaped(text, unescaped)
        findings = self.to_hide(text)
        return redact_findings(text, findings) if findings else text

    def _redact_unescaped(self, text: str, unescaped: _Unescaped) -> str:
        parts: list[str] = []
        at = 0
        for finding in self.to_hide(unescaped.text):
            start, end = unescaped.origin(finding.start), unescaped.origin(finding.end)
            parts += (text[at:start], placeholder(finding, unescaped.text))
            at = end
        parts.append(text[at:])
        return "".join(parts)

    def scan(self, subject: str | None, body: str) -> TicketScan:
        """A ticket's kinds and its redacted subject and body, from one pass over each."""
        counts: dict[Kind, int] = {}
        redacted: list[str | None] = []
        for text in (subject, body):
            if not text:
                redacted.append(text)
                continue
            findings = self.findings(text)
            for finding in findings:
                counts[finding.kind] = counts.get(finding.kind, 0) + 1
            hidden = [f for f in findings if f.kind not in self._keep]
            redacted.append(redact_findings(text, hidden) if hidden else text)
        kinds = tuple(kind for kind in KINDS if kind in counts)
        return TicketScan(
            kinds, tuple((kind, counts[kind]) for kind in kinds), redacted[0], redacted[1] or ""
        )
