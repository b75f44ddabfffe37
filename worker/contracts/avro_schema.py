"""Avro schemas generated from the msgspec contracts (`worker/messages.py`), as the JSON Schemas in `schemas/`
are: the record a registry-format output topic carries is registered with exactly this schema.

Mapping, chosen so that the evolutions the contracts make stay BACKWARD compatible (a consumer on the new
schema reads records written with the old one):
- str → string, int → long, float → double, bool → boolean, list[X] → array of X, dict[str, X] → map of X,
  a Struct → a named record (namespace `triage`);
- a `Literal` of strings → string, not an Avro enum: adding a fallback reason or a stage must not make the
  records of older workers unreadable, and an Avro enum reader fails on a symbol it lacks;
- `X | None` → ["null", X]; a field with a default (the optional fields at the end of `TriageResult`) gets
  `"default": null`, so a field added that way is a compatible change and a required field added is not.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

NAMESPACE = "triage"


def _avro_type(info: msgspec.inspect.Type, named: dict[str, Any]) -> Any:
    if isinstance(info, msgspec.inspect.Metadata):
        return _avro_type(info.type, named)
    if isinstance(info, msgspec.inspect.StrType):
        return "string"
    if isinstance(info, msgspec.inspect.BoolType):
        return "boolean"
    if isinstance(info, msgspec.inspect.IntType):
        return "long"
    if isinstance(info, msgspec.inspect.FloatType):
        return "double"
    if isinstance(info, msgspec.inspect.LiteralType) and all(isinstance(v, str) for v in info.values):
        return "string"
    if isinstance(info, msgspec.inspect.ListType):
        return {"type": "array", "items": _avro_type(info.item_type, named)}
    if isinstance(info, msgspec.inspect.DictType) and isinstance(info.key_type, msgspec.inspect.StrType):
        return {"type": "map", "values": _avro_type(info.value_type, named)}
    if isinstance(info, msgspec.inspect.UnionType):
        others = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(others) == 1 and info.includes_none:
            return ["null", _avro_type(others[0], named)]
    if isinstance(info, msgspec.inspect.StructType):
        return _record(info, named)
    raise TypeError(f"no Avro mapping for {info!r}: extend worker/contracts/avro_schema.py")


def _record(info: msgspec.inspect.StructType, named: dict[str, Any]) -> Any:
    name = info.cls.__name__
    if name in named:  # Avro names a record once; later uses refer to it by name
        return f"{NAMESPACE}.{name}"
    named[name] = True
    fields: list[dict[str, Any]] = []
    for field in info.fields:
        avro_field: dict[str, Any] = {"name": field.encode_name, "type": _avro_type(field.type, named)}
        if not field.required:
            if field.default is not None:
                raise TypeError(f"{name}.{field.name}: only None defaults have an Avro mapping")
            avro_field["default"] = None
        fields.append(avro_field)
    doc = (info.cls.__doc__ or "").strip().split("\n\n")[0]
    return {
        "type": "record",
        "name": name,
        "namespace": NAMESPACE,
        "doc": " ".join(doc.split()),
        "fields": fields,
    }


def avro_schema(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """The Avro schema (parsed JSON) of a msgspec Struct contract; TypeError for a type with no mapping."""
    schema: dict[str, Any] = _record(msgspec.inspect.type_info(struct), {})  # type: ignore[arg-type]
    return schema


def avro_schema_text(struct: type[msgspec.Struct]) -> str:
    """`avro_schema` as the file `schemas/` holds (stable key order, one trailing newline)."""
    return json.dumps(avro_schema(struct), indent=2) + "\n"
