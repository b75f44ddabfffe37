"""Redaction: the text of every copy the worker makes of a ticket, with its personal data replaced.

A `Redactor` is built once from the settings' kinds (`privacy.detect`, `privacy.keep`, `privacy.phone_region`)
and used for each ticket once (`scan`): the resulting `TicketScan` carries the kinds found (a result's `pii`)
and the redacted subject and body, which the review record, the model (with `inference.redact_input`) and
the dead letter (with `dead_letter.redact`) all take from it, so no ticket is searched twice.

Placeholders name the kind and never carry enough to recover the value: a card keeps its last four digits,
the most PCI DSS requirement 3.4 lets a display show without a business need for more.
"""

from __future__ import annotations

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

    def redact(self, text: str) -> str:
        """`text` with the detected kinds not kept replaced (the text itself when there are none)."""
        findings = [f for f in self.findings(text) if f.kind not in self._keep]
        return redact_findings(text, findings) if findings else text

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
