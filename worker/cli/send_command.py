"""`triage-worker send`: publish one ticket (or one raw value, to see what a broken record becomes) to the
input topic, and say where it landed."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import confluent_kafka
import msgspec

from worker.cli.arguments import checked_argument_text
from worker.decoding import DecodeError, decode_ticket
from worker.errors import UserError
from worker.kafka.admin import check_cluster
from worker.kafka.clients import create_producer, produce, producer_config
from worker.messages import TicketEvent, utc_timestamp
from worker.settings import add_config_argument, settings_from_args

_DELIVERY_TIMEOUT_S = 30.0


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "send",
        help="publish one ticket (or one raw value) to the input topic",
        description=(
            "Publish TEXT as a ticket (JSON TicketEvent with a new ticket_id), or --raw VALUE exactly as "
            "given (e.g. broken JSON, to see its dead letter), and print its topic, partition and offset."
        ),
    )
    add_config_argument(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("text", nargs="?", help="the ticket's body")
    what.add_argument("--raw", metavar="VALUE", help="publish this value as is, not as a ticket")
    parser.add_argument("--subject", help="the ticket's subject")
    parser.add_argument("--ticket-id", help="default: t-<8 random hex digits> (an empty one is refused)")
    parser.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers")
    parser.add_argument("--topic", help="default: topics.input")
    parser.set_defaults(handler=send)


def send(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, {"kafka.bootstrap.servers": args.bootstrap_servers})
    topic = args.topic or settings.topics.input
    if args.raw is not None:
        # Bytes that were not UTF-8 on the command line go out as they were typed: that is the point of --raw.
        value = args.raw.encode("utf-8", "surrogateescape")
        what = f"{len(value)} bytes"
    else:
        ticket_id = f"t-{uuid.uuid4().hex[:8]}" if args.ticket_id is None else args.ticket_id
        event = TicketEvent(
            ticket_id=checked_argument_text(ticket_id, "--ticket-id"),
            body=checked_argument_text(args.text, "the ticket text"),
            subject=checked_argument_text(args.subject, "--subject") if args.subject is not None else None,
            created_at=utc_timestamp(),
        )
        value = msgspec.json.encode(event)
        _refuse_a_dead_letter(value, settings.pipeline.max_value_bytes)
        what = f"ticket {ticket_id}"
    check_cluster(producer_config(settings.kafka))
    producer = create_producer(settings.kafka)
    outcome: list[Any] = []
    try:
        produce(producer, topic, value, None, None, lambda error, message: outcome.append((error, message)))
    except confluent_kafka.KafkaException as refused:  # refused by the client itself, e.g. too large
        raise UserError(f"{topic}: the record was not sent: {refused.args[0].str()}") from None
    producer.flush(_DELIVERY_TIMEOUT_S)
    if not outcome:
        raise UserError(f"{topic}: no acknowledgement within {_DELIVERY_TIMEOUT_S:.0f} s")
    error, message = outcome[0]
    if error is not None:
        print(f"triage-worker: error: {topic} refused the record: {error.str()}", file=sys.stderr)
        return 1
    print(f"sent {what} to {topic} (partition {message.partition()}, offset {message.offset()})")
    return 0


def _refuse_a_dead_letter(value: bytes, max_value_bytes: int) -> None:
    """A ticket built from the arguments is checked as the worker will decode it: `send ""` or
    `--ticket-id ""` would only make a dead letter (on purpose, that is what --raw is for)."""
    try:
        decode_ticket(value, max_value_bytes)
    except DecodeError as error:
        raise UserError(
            f"send: the worker would dead-letter this ticket ({error}); fix it, or send such a value on "
            "purpose with --raw"
        ) from None
