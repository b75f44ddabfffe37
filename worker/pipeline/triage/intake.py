"""A record taken from Kafka becomes a ticket ready for the model, or the reason it is a dead letter.

`Intake.ticket(work, decoded, now, wall)` runs once per taken record, on the loop's thread:

- a key over `MAX_KEY_BYTES` is refused unread (results are keyed by the input key: the bound keeps every
  result small, see `guarantees.smaller`);
- the value is decoded: plain JSON by `decode_ticket`, or what the registry-aware decoder made of it
  (`decoded`, decoded before the record was taken so that one the registry cannot answer for is not taken);
- the ticket's deadline: the loop's (`work.deadline`, from its door's `Limits`), or the producer's earlier
  `deadline_at` (`deadlines.py`);
- its personal data is looked for once (every copy made of it later takes this scan), and with
  `inference.redact_input` the model, the shadow and the cascade get the redacted text.

Whatever a library raises on a record is a dead letter (`internal_error`): no record may stop the worker.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import structlog

from worker.decoding import DecodeError, decode_ticket
from worker.messages import TicketEvent
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.triage.deadlines import ticket_deadline
from worker.pipeline.work import Work
from worker.settings import PipelineSettings, PrivacySettings

_log = structlog.get_logger("worker.pipeline")

MAX_KEY_BYTES = 4096

# Why a record is a dead letter: (error type, message).
Rejection = tuple[str, str]


class TicketDecoding(Protocol):
    """What the pipeline needs of `worker.contracts.input.TicketDecoder` (built by the app room from
    `input.*` and `schema_registry.*`): a TicketEvent, or DecodeError (dead letter), or RegistryUnavailable
    (the record is retried, see registry_wait.py)."""

    def decode(self, value: bytes | None, topic: str) -> TicketEvent: ...


class Intake:
    """Reads taken records into tickets (values up to `pipeline.max_value_bytes`, each with the deadline the
    loop gave it, or its producer's earlier one); scans each for `privacy`'s kinds, counting those found in
    `metrics`, and gives the model the ticket redacted when `redact_input` (`inference.redact_input`)."""

    def __init__(
        self,
        pipeline: PipelineSettings,
        privacy: PrivacySettings,
        redact_input: bool,
        metrics: PipelineMetrics,
    ) -> None:
        self._max_value_bytes = pipeline.max_value_bytes
        self.redact_as(privacy, redact_input)
        self._metrics = metrics

    def redact_as(self, privacy: PrivacySettings, redact_input: bool) -> None:
        """Scan the records taken from now on as `privacy` and `redact_input` say (a hot reload's, from its
        thread): one reference replaced, so a record is scanned wholly as before or wholly as after."""
        self._scanning = (privacy.redactor(), redact_input)

    def ticket(
        self, work: Work, decoded: TicketEvent | DecodeError | None, now: float, wall: float
    ) -> Rejection | None:
        """Sets `work.event`, `.scan` and `.deadline` (the loop's, or the producer's earlier `deadline_at`);
        or returns why the record is a dead letter."""
        if work.key is not None and len(work.key) > MAX_KEY_BYTES:
            return "key_too_large", f"key is {len(work.key)} bytes, over the {MAX_KEY_BYTES}-byte limit"
        try:
            if decoded is None:
                event = decode_ticket(work.value, self._max_value_bytes)
            elif isinstance(decoded, DecodeError):
                raise decoded
            else:
                event = decoded
            deadline = ticket_deadline(now, wall, work.deadline, event.metadata)
        except DecodeError as problem:
            return problem.error_type, problem.message
        except Exception as error:  # no record may stop the worker, whatever a library raises
            # The log's redacting processor masks the ticket's personal data in the traceback's messages.
            _log.exception("record_failed", topic=work.topic, partition=work.partition, offset=work.offset)
            return "internal_error", f"{type(error).__name__}: {error}"
        redactor, redact_input = self._scanning
        scan = work.scan = redactor.scan(event.subject, event.body)
        if scan.kinds:
            self._metrics.pii_tickets += 1
            self._metrics.pii_found.update(dict(scan.counts))
        if redact_input:
            event = msgspec.structs.replace(event, subject=scan.subject, body=scan.body)
        work.event = event
        work.deadline = deadline
        return None
