"""What a hot reload (SIGHUP, `POST /reload`) does with each setting, declared in one place (`RELOAD`), and
the comparison of the running settings with the configured ones that a reload acts on (`changed_settings`).

Every setting is one of:

- ``live``: a reload applies it (the model and its pool, the redaction of every copy of a ticket, which
  results go to review), or `run` does not read it at all (so a reload has nothing to wait for);
- ``restart``: it is read once, where the worker starts the part that uses it; a reload that changes it
  names it (`reload_needs_restart`, values masked where secret) and goes on, the running value stays and
  readiness and metrics say a restart is pending;
- ``refused``: a reload that changes it fails (`reload_failed`, the reason naming it) and applies nothing:
  for a setting that only a restart can apply and whose change must never go unapplied in silence (what is
  kept of personal data), the running settings stay until it is set back or the worker restarts.

`tests/settings/test_reloads.py` walks every field of `Settings` and fails on one with no declaration, so a
new setting cannot go undeclared; `docs/configuration.md` shows each setting's class (`make docs`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from worker.settings.masking import MASK, SECRET_SETTINGS, is_secret_key, masked_url
from worker.settings.sections import Settings

ReloadClass = Literal["live", "restart", "refused"]


@dataclass(frozen=True)
class Declared:
    """One setting's reload class, and why (one line: required for restart and refused)."""

    reload: ReloadClass
    why: str = ""


def _live(why: str = "") -> Declared:
    return Declared("live", why)


def _restart(why: str) -> Declared:
    return Declared("restart", why)


def _refused(why: str) -> Declared:
    return Declared("refused", why)


_NOT_RUN = _live("not read by `run`")
_LOOP = "the consumer loop's bounds are fixed when it starts"
_SHADOW = _restart("the shadow's pool and producer are started once and not reloaded")
_STAGE = _restart("the cascade's escalation stage is started once and not reloaded")
_POOL = _live("a reload opens a new pool with it")
_REDACTION = _live("the next ticket taken and every copy written after the switch are redacted as it says")
_DECODER = _restart("the input's decoder and its registry client are built at start")
_REGISTRY = _restart("the registry clients are created, and the output schema registered, at start")
_TRACING = _restart("the tracer and its exporter are created at start")
_REVIEW = _live("the running review applies it; turning review on where it was off needs a restart")
_LOG = _restart("logging is configured once at start, in the worker and in each model process")

# Keyed by dotted field path as `setting_paths` walks `Settings`: "section.field"; the `[kafka]` table (and
# each table of strings) is one setting, its entries compared one by one.
RELOAD: dict[str, Declared] = {
    "kafka": _restart(
        "librdkafka options are read when the consumer, producers and admin clients are created"
    ),
    "topics.input": _restart("the consumer subscribes to it at start"),
    "topics.output": _restart("checked at start (it exists, its record limit) and held by the outputs"),
    "topics.dead_letter": _restart("checked at start (it exists, its record limit) and held by the outputs"),
    "topics.shadow": _restart("the shadow's producer writes it from start"),
    "topics.review": _restart("checked at start and written by the review's producer from start"),
    "topics.feedback": _NOT_RUN,
    "topics.partitions": _NOT_RUN,
    "topics.replication_factor": _NOT_RUN,
    "pipeline.group_id": _restart("the consumer (or share) group is joined at start"),
    "pipeline.max_in_flight": _restart(_LOOP),
    "pipeline.resume_below": _restart(_LOOP),
    "pipeline.deadline_ms": _restart(_LOOP + ", and the latency histograms' buckets with it"),
    "pipeline.poll_batch_size": _restart(_LOOP),
    "pipeline.poll_timeout_ms": _restart(_LOOP),
    "pipeline.commit_interval_ms": _restart("the settlement's commit cadence is set when it is built"),
    "pipeline.revoke_timeout_ms": _restart("the source's rebalance handling is built at start"),
    "pipeline.shutdown_timeout_ms": _restart(_LOOP),
    "pipeline.max_value_bytes": _restart("the intake and the input's decoder take it at start"),
    "pipeline.max_header_bytes": _restart("the outputs take it at start"),
    "pipeline.guarantee": _restart("the settlement (transactions or not) is built at start"),
    "pipeline.transactional_id": _restart("the transactional producer is created at start"),
    "pipeline.scheduling": _restart("the dispatch queue is built at start"),
    "pipeline.consume": _restart("the door (consumer group or share group) is built at start"),
    "pipeline.delivery_count_limit": _restart("the share group's limit is read at start"),
    "inference.model": _POOL,
    "inference.taxonomy": _live("a reload opens a new pool with it (its fallback label must stay the same)"),
    "inference.provider": _POOL,
    "inference.provider_options": _POOL,
    "inference.intra_op_num_threads": _POOL,
    "inference.mode": _POOL,
    "inference.pool": _live("a reload opens a new pool with it (the dispatch window stays the start's)"),
    "inference.pool_size": _live("a reload opens a new pool with it (the dispatch window stays the start's)"),
    "inference.batch_size": _live(
        "a reload opens a new pool with it (the dispatch window stays the start's)"
    ),
    "inference.max_ticket_tokens": _POOL,
    "inference.redact_input": _REDACTION,
    "inference.shadow_model": _SHADOW,
    "inference.shadow_taxonomy": _SHADOW,
    "inference.shadow_mode": _SHADOW,
    "inference.shadow_pool_size": _SHADOW,
    "inference.escalation": _STAGE,
    "inference.escalate_below": _STAGE,
    "inference.escalation_pool_size": _STAGE,
    "inference.escalation_llm": _STAGE,
    "inference.escalation_top_k": _STAGE,
    "review.threshold": _REVIEW,
    "review.fallbacks": _REVIEW,
    "privacy.detect": _REDACTION,
    "privacy.keep": _REDACTION,
    "privacy.phone_region": _refused(
        "the logs of every process (the shadow's and the escalation stage's are not reloaded) find the phone "
        "numbers of the region they started with"
    ),
    "privacy.carry_headers": _REDACTION,
    "dead_letter.redact": _REDACTION,
    "log.level": _LOG,
    "log.format": _LOG,
    "metrics.port": _restart("the HTTP endpoint is bound at start"),
    "metrics.host": _restart("the HTTP endpoint is bound at start"),
    "metrics.stall_timeout_ms": _restart("the liveness probe takes it at start"),
    "metrics.reload_token_file": _restart("the token is read at start"),
    "input.format": _DECODER,
    "input.fields": _DECODER,
    "input.protobuf_message": _DECODER,
    "output.format": _REGISTRY,
    "schema_registry.url": _REGISTRY,
    "schema_registry.basic_auth_user_info": _REGISTRY,
    "schema_registry.ssl_ca_location": _REGISTRY,
    "schema_registry.timeout_ms": _REGISTRY,
    "tracing.exporter": _TRACING,
    "tracing.endpoint": _TRACING,
    "tracing.protocol": _TRACING,
    "tracing.sample_ratio": _TRACING,
}


def setting_paths(struct: type[msgspec.Struct] = Settings, prefix: str = "") -> Iterator[str]:
    """Every setting of `struct` as a dotted path, recursively through nested structs (a table of strings,
    such as `kafka`, is one setting)."""
    for field in msgspec.structs.fields(struct):
        path = f"{prefix}{field.name}"
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            yield from setting_paths(field.type, f"{path}.")
        else:
            yield path


def declared(key: str) -> Declared:
    """The declaration of a changed setting as `changed_settings` names it (`kafka.sasl.password` is the
    `kafka` table's)."""
    return RELOAD["kafka" if key.startswith("kafka.") else key]


def _value_at(settings: Settings, path: str) -> Any:
    value: Any = settings
    for name in path.split("."):
        value = getattr(value, name)
    return value


def changed_settings(running: Settings, configured: Settings) -> dict[str, tuple[object, object]]:
    """The settings that differ, by dotted key (`kafka.<option>` for each librdkafka option), each with its
    running and configured value (None where a `[kafka]` option is unset)."""
    changed: dict[str, tuple[object, object]] = {}
    for path in setting_paths():
        before, after = _value_at(running, path), _value_at(configured, path)
        if before == after:
            continue
        if path == "kafka":
            for option in sorted(before.keys() | after.keys()):
                if before.get(option) != after.get(option):
                    changed[f"kafka.{option}"] = (before.get(option), after.get(option))
        else:
            changed[path] = (before, after)
    return changed


def masked_setting(key: str, value: object) -> object:
    """`value` of setting `key` as it may be logged: a secret one (a credential setting, a librdkafka or
    provider option named like a secret) as ``***``, a password written into a URL masked."""
    if value is None:
        return None
    if key in SECRET_SETTINGS or (key.startswith("kafka.") and is_secret_key(key.removeprefix("kafka."))):
        return MASK
    if isinstance(value, str):
        return masked_url(value)
    if isinstance(value, Mapping):
        return {
            name: MASK if is_secret_key(name) else masked_setting("", item) for name, item in value.items()
        }
    if isinstance(value, list):
        return [masked_setting("", item) for item in value]
    return value


def with_running(configured: Settings, running: Settings, keys: list[str]) -> Settings:
    """`configured` with the settings `keys` names (as `changed_settings` does) at their `running` values:
    what runs after a reload that applies the others."""
    sections: dict[str, dict[str, object]] = {}
    replaced: dict[str, object] = {}
    for key in keys:
        if key.startswith("kafka."):
            replaced["kafka"] = running.kafka
            continue
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = _value_at(running, key)
    for section, fields in sections.items():
        replaced[section] = msgspec.structs.replace(getattr(configured, section), **fields)
    return msgspec.structs.replace(configured, **replaced)
