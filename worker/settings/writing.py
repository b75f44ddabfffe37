"""Settings written back as a TOML file (`config show`), secrets masked, unset keys explained."""

from __future__ import annotations

import msgspec

from worker.settings.masking import MASK, SECRET_SETTINGS, masked_kafka_config
from worker.settings.sections import SECTIONS, Settings


def toml_value(value: object) -> str:
    """`value` (a string, number or boolean) written as TOML."""
    # JSON string escapes are valid TOML basic-string escapes.
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_UNSET_HINTS = {
    "pipeline.resume_below": "half of max_in_flight",
    "pipeline.transactional_id": "<group_id>-<host name>",
    "inference.taxonomy": "the model's own taxonomy.toml",
    "inference.pool": "the provider's default pool",
    "inference.pool_size": "chosen from the CPU count",
    "inference.shadow_model": "no shadow, or the primary's model if another shadow_* key is set",
    "inference.shadow_taxonomy": "the shadow model's taxonomy.toml",
    "inference.shadow_mode": "the primary's mode",
    "inference.escalation": "no cascade",
    "inference.escalate_below": "the model folder's choice (`model train`), else 0.8",
    "inference.escalation_llm": "the encoder stage's own answer",
    "review.threshold": "no result goes to review for its confidence",
    "metrics.port": "no HTTP endpoint",
    "metrics.reload_token_file": "POST /reload closed (SIGHUP reloads)",
    "input.protobuf_message": "needed by input.format protobuf",
    "schema_registry.url": "no registry (needed by the avro, json_schema and protobuf input formats)",
    "schema_registry.basic_auth_user_info": "no authentication",
    "schema_registry.ssl_ca_location": "the system's CA roots",
    "tracing.endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT, else the SDK's default",
    "tracing.protocol": "OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf",
    "tracing.sample_ratio": "OTEL_TRACES_SAMPLER(_ARG), else every ticket",
}


def unset_hint(key: str) -> str:
    """What an unset (None) setting means, e.g. ``half of max_in_flight`` for ``pipeline.resume_below``."""
    return _UNSET_HINTS.get(key, "unset")


def settings_to_toml(settings: Settings) -> str:
    """Effective settings as a TOML file `--config` accepts back, with kafka secrets masked."""
    lines = ["[kafka]"]
    lines += [f"{toml_value(k)} = {toml_value(v)}" for k, v in masked_kafka_config(settings.kafka).items()]
    for section in SECTIONS:
        values = msgspec.structs.asdict(getattr(settings, section))
        lines += ["", f"[{section}]"]
        tables: list[str] = []
        for name, value in values.items():
            if value is not None and f"{section}.{name}" in SECRET_SETTINGS:
                lines.append(f"{name} = {toml_value(MASK)}")
            elif section == "schema_registry" and name == "url" and value is not None:
                lines.append(f"{name} = {toml_value(settings.schema_registry.masked_url())}")
            elif value is None:
                hint = unset_hint(f"{section}.{name}")
                lines.append(f"# {name}: not set ({hint})")
            elif isinstance(value, dict):
                tables += ["", f"[{section}.{name}]"]
                tables += [f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items()]
            else:
                lines.append(f"{name} = {toml_value(value)}")
        lines += tables
    return "\n".join(lines) + "\n"
