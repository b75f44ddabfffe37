"""A producer's Protobuf ticket, importable by name as the worker's `input.protobuf_message`
("helpdesk_proto:HelpdeskTicket"; tests/ is on the test session's path). Built at import from a descriptor, so
that no protoc is needed: helpdesk.HelpdeskTicket {string id = 1; string description = 2; Requester requester
= 3;} with Requester {string email = 1;}."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_STRING, _MESSAGE, _OPTIONAL = 9, 11, 1  # FieldDescriptorProto type and label numbers


def _build() -> Any:
    proto = descriptor_pb2.FileDescriptorProto(name="helpdesk_e2e.proto", package="helpdesk", syntax="proto3")
    proto.message_type.add(name="Requester").field.add(name="email", number=1, type=_STRING, label=_OPTIONAL)
    ticket = proto.message_type.add(name="HelpdeskTicket")
    ticket.field.add(name="id", number=1, type=_STRING, label=_OPTIONAL)
    ticket.field.add(name="description", number=2, type=_STRING, label=_OPTIONAL)
    ticket.field.add(
        name="requester", number=3, type=_MESSAGE, label=_OPTIONAL, type_name=".helpdesk.Requester"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("helpdesk.HelpdeskTicket"))


HelpdeskTicket = _build()
