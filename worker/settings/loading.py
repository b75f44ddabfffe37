"""Settings loaded in layers: defaults < TOML file < environment < command line.

Each layer is flattened into dotted keys (``pipeline.max_in_flight``, ``kafka.bootstrap.servers``) that
remember where they came from, so a bad value fails at start with one line naming the key, what was expected,
the value (never a secret one) and its origin. ``[kafka]`` options are librdkafka's own and pass through
untouched, which is what lets SASL/SSL and every other client option work without code here; only their names
are checked at start, so that a typo is one line naming it rather than a client that fails later.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from worker.errors import UserError
from worker.librdkafka import PROPERTIES as LIBRDKAFKA_PROPERTIES
from worker.settings.masking import MASK, SECRET_SETTINGS, masked_url
from worker.settings.sections import REGISTRY_FORMATS, SECTIONS, Settings, default_kafka
from worker.settings.writing import toml_value
from worker.small_files import read_small_file

_MAP_FIELDS = frozenset({("inference", "provider_options"), ("input", "fields")})
_FIELD_TYPES: dict[str, dict[str, Any]] = {
    name: {field.name: field.type for field in msgspec.structs.fields(cls)} for name, cls in SECTIONS.items()
}

# KAFKA_* variables that belong to Kafka's own scripts and Docker image, not to librdkafka.
_KAFKA_JVM_ENV = frozenset(
    {
        "KAFKA_HOME",
        "KAFKA_OPTS",
        "KAFKA_HEAP_OPTS",
        "KAFKA_LOG4J_OPTS",
        "KAFKA_JVM_PERFORMANCE_OPTS",
        "KAFKA_GC_LOG_OPTS",
        "KAFKA_JMX_OPTS",
        "KAFKA_DEBUG",
        "KAFKA_JMX_PORT",
        "KAFKA_LOG_DIR",
        "KAFKA_CLUSTER_ID",
        "KAFKA_VERSION",
    }
)
# What Kubernetes injects into every pod for each Service of its namespace (service links, on unless the pod
# sets enableServiceLinks: false): a Service `kafka` gives KAFKA_PORT=tcp://10.0.0.7:9092,
# KAFKA_PORT_9092_TCP(_PROTO|_PORT|_ADDR), KAFKA_SERVICE_HOST and KAFKA_SERVICE_PORT(_<port name>); one named
# `kafka-ui` the same with KAFKA_UI_. None of them is a librdkafka option.
# The same for a Service whose name starts with `triage` (TRIAGE_, TRIAGE_WORKER_METRICS_, ...).
_SERVICE_LINK = re.compile(
    r"(KAFKA|TRIAGE)(_[A-Z0-9_]+?)?_"
    r"(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)"
)
_warned_service_links: set[str] = set()
# TRIAGE_* variables that are not settings: read by the local broker (`worker/dev/local_broker.py`) and by
# the test session's broker choice (`tests/kafka_source.py`). Any other TRIAGE_* must name a setting.
_TOOL_VARIABLES = frozenset(
    {
        "TRIAGE_KAFKA_HOME",
        "TRIAGE_KAFKA_VERSION",
        "TRIAGE_KAFKA_TRANSACTION_VERSION",
        "TRIAGE_TEST_BROKER",
        "TRIAGE_KAFKA_IMAGE",
    }
)


class _Entry(msgspec.Struct, frozen=True):
    value: object
    source: str
    # Values from the environment and the command line are strings and get converted to the field's type;
    # values from TOML already have a type, which must match.
    from_text: bool


_Key = tuple[str, ...]


def _error(key: str, problem: str, source: str | None = None) -> UserError:
    origin = f" (from {source})" if source else ""
    return UserError(f"config error: {key}: {problem}{origin}")


def _split_key(dotted: str, source: str) -> _Key:
    """``pipeline.max_in_flight`` → ("pipeline", "max_in_flight"); kafka keys keep their own dots."""
    section, _, rest = dotted.partition(".")
    if section == "kafka" and rest:
        return ("kafka", rest)
    if section not in SECTIONS:
        raise _error(dotted, f"unknown section; expected one of kafka, {', '.join(SECTIONS)}", source)
    name, _, entry = rest.partition(".")
    if name not in _FIELD_TYPES[section]:
        raise _error(dotted, f"unknown key; {section} has {', '.join(_FIELD_TYPES[section])}", source)
    if (section, name) in _MAP_FIELDS:
        if not entry:
            raise _error(dotted, f"set one entry at a time, as {dotted}.<name>", source)
        return (section, name, entry)
    if entry:
        raise _error(dotted, f"unknown key; {section}.{name} is not a table", source)
    return (section, name)


def _file_entries(path: Path) -> dict[_Key, _Entry]:
    try:
        document = tomllib.loads(read_small_file(path, "a settings file").decode("utf-8"))
    except OSError as error:
        raise UserError(f"config error: cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise UserError(f"config error: {path}: not UTF-8 text (byte {error.start})") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"config error: {path}: invalid TOML: {error}") from None
    source = str(path)
    entries: dict[_Key, _Entry] = {}
    for section, table in document.items():
        if section != "kafka" and section not in SECTIONS:
            raise _error(section, f"unknown section; expected one of kafka, {', '.join(SECTIONS)}", source)
        if not isinstance(table, dict):
            raise _error(section, "expected a table", source)
        for name, value in table.items():
            if section == "kafka":
                entries[("kafka", name)] = _Entry(value, source, from_text=False)
                continue
            if (section, name) in _MAP_FIELDS:
                if not isinstance(value, dict):
                    raise _error(f"{section}.{name}", "expected a table of strings", source)
                for entry, entry_value in value.items():
                    entries[(section, name, entry)] = _Entry(entry_value, source, from_text=False)
            else:
                entries[_split_key(f"{section}.{name}", source)] = _Entry(value, source, from_text=False)
    return entries


def _env_option(variable: str) -> str:
    """KAFKA_BOOTSTRAP_SERVERS → bootstrap.servers."""
    return variable.removeprefix("KAFKA_").lower().replace("_", ".")


def _warn_service_links(variables: list[str]) -> None:
    """One line on stderr per process (not per reload), before logging is set up: the command goes on."""
    new = sorted(set(variables) - _warned_service_links)
    if new:
        _warned_service_links.update(new)
        print(
            f"triage-worker: warning: ignoring {', '.join(new)}: Kubernetes service-link variables, not "
            "settings or librdkafka options (set enableServiceLinks: false in the pod spec)",
            file=sys.stderr,
            flush=True,
        )


def _setting_variable(section: str, name: str) -> str:
    table_entry = "__<NAME>" if (section, name) in _MAP_FIELDS else ""
    return f"TRIAGE_{section.upper()}__{name.upper()}{table_entry}"


def _is_setting_variable(variable: str) -> bool:
    """TRIAGE_<SECTION>__<KEY>, or TRIAGE_<SECTION>__<TABLE>__<NAME> for a table of strings."""
    section, _, rest = variable.removeprefix("TRIAGE_").lower().partition("__")
    name, _, entry = rest.partition("__")
    if name not in _FIELD_TYPES.get(section, {}):
        return False
    return bool(entry) == ((section, name) in _MAP_FIELDS)


def _unknown_variable(variable: str) -> UserError:
    """One line naming the setting `variable` was most likely meant to be, compared by its words with each
    setting's, with and without the section: TRIAGE_MAX_IN_FLIGHT and TRIAGE_PIPELINE_MAX_IN_FLIGHT both
    meant TRIAGE_PIPELINE__MAX_IN_FLIGHT."""
    meant: dict[str, str] = {}
    for section, fields in _FIELD_TYPES.items():
        for name in fields:
            meant[f"{section}_{name}"] = meant.setdefault(name, _setting_variable(section, name))
    words = variable.removeprefix("TRIAGE_").lower().replace("__", "_")
    nearest = difflib.get_close_matches(words, meant, n=1)
    hint = f"did you mean {meant[nearest[0]]}?" if nearest else "settings are TRIAGE_<SECTION>__<KEY>"
    return UserError(f"config error: {variable}: no such setting; {hint}")


def _env_entries(env: Mapping[str, str]) -> dict[_Key, _Entry]:
    entries: dict[_Key, _Entry] = {}
    service_links: list[str] = []
    for variable, value in env.items():
        if variable.startswith("KAFKA_") and variable not in _KAFKA_JVM_ENV:
            option = _env_option(variable)
            if option in LIBRDKAFKA_PROPERTIES or not _SERVICE_LINK.fullmatch(variable):
                if option and not variable.endswith("_OPTS"):
                    entries[("kafka", option)] = _Entry(value, variable, from_text=True)
            else:
                service_links.append(variable)
            continue
        if not variable.startswith("TRIAGE_") or variable in _TOOL_VARIABLES:
            continue
        if variable.startswith("TRIAGE_KAFKA__"):
            raise UserError(f"config error: {variable}: set librdkafka options as KAFKA_<OPTION>")
        if _is_setting_variable(variable):
            dotted = variable.removeprefix("TRIAGE_").lower().replace("__", ".")
            entries[_split_key(dotted, variable)] = _Entry(value, variable, from_text=True)
        elif _SERVICE_LINK.fullmatch(variable):
            service_links.append(variable)
        else:
            # A typo is never ignored in silence: the setting it meant would keep its default unseen.
            raise _unknown_variable(variable)
    _warn_service_links(service_links)
    return entries


def _override_entries(overrides: Mapping[str, object]) -> dict[_Key, _Entry]:
    source = "command line"
    return {
        _split_key(dotted, source): _Entry(value, source, from_text=isinstance(value, str))
        for dotted, value in overrides.items()
        if value is not None
    }


def _render(value: object, from_text: bool = False) -> str:
    """A value for an error line: env/flag text as typed (quoted only when blank), TOML values as TOML."""
    if from_text and isinstance(value, str) and re.fullmatch(r"\S+", value):
        text = value
    elif isinstance(value, str | int | float | bool):
        text = toml_value(value)
    else:
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _readable(error: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int` >= 1" → "expected int >= 1" (the caller appends the offending value)."""
    message = str(error).split(" - at `", 1)[0].replace("`", "")
    message = re.sub(r", got \w+$", "", message)
    message = message.replace("int | null", "int").replace("str | null", "str")
    return message[:1].lower() + message[1:]


def _is_optional(field_type: Any) -> bool:
    return typing.get_origin(field_type) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        field_type
    )


def _as_option_string(key: str, entry: _Entry) -> str:
    """librdkafka and ORT take string options; TOML numbers and booleans are written the way they expect."""
    value = entry.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    # Never echo the value: a misplaced table here may well hold credentials.
    raise _error(key, f"expected a string, number or boolean, got {type(value).__name__}", entry.source)


def _unknown_to_client(option: str) -> bool:
    """Whether the installed confluent-kafka rejects `option` as no property at all. Asked only for names
    missing from `LIBRDKAFKA_PROPERTIES`, so that a newer client's new properties and the Python client's own
    ones still pass. A second, invalid name makes it fail before it would create a client for a known one."""
    import confluent_kafka

    try:
        confluent_kafka.Producer({option: "", "triage.worker.probe": ""})
    except confluent_kafka.KafkaException as error:
        return f'No such configuration property: "{option}"' in error.args[0].str()
    except (TypeError, ValueError):  # a Python-level option (callback, typed flag): known
        return False
    return False


def _check_kafka_option(option: str, entry: _Entry) -> None:
    """A one-line error for an option librdkafka does not know, with the nearest one it does."""
    if option in LIBRDKAFKA_PROPERTIES or not _unknown_to_client(option):
        return
    nearest = difflib.get_close_matches(option, LIBRDKAFKA_PROPERTIES, n=1)
    from_env = entry.source.startswith("KAFKA_")
    if not nearest:
        hint = ""
    elif not from_env:
        hint = f"; did you mean {nearest[0]}?"
    elif "_" in nearest[0]:  # no variable maps to it: underscores become dots
        hint = f"; did you mean {nearest[0]} (settable only in a --config file's [kafka] table)?"
    else:
        hint = f"; did you mean {nearest[0]} ({'KAFKA_' + nearest[0].upper().replace('.', '_')})?"
    if from_env:
        raise _error(entry.source, f"librdkafka has no option {option}{hint}")
    raise _error(f"kafka.{option}", f"librdkafka has no such option{hint}", entry.source)


def _convert(key: _Key, entry: _Entry) -> object:
    section, name = key[0], key[1]
    dotted = ".".join(key)
    if section == "kafka":
        _check_kafka_option(name, entry)
    if section == "kafka" or len(key) == 3:
        return _as_option_string(dotted, entry)
    field_type = _FIELD_TYPES[section][name]
    value = entry.value
    if entry.from_text and value == "" and _is_optional(field_type):
        return None
    if entry.from_text and isinstance(value, str) and typing.get_origin(field_type) is list:
        # A list from the environment or a flag: comma-separated ("email,phone"; "" is the empty list).
        value = [item.strip() for item in value.split(",") if item.strip()]
    try:
        return msgspec.convert(value, field_type, strict=not entry.from_text)
    except msgspec.ValidationError as error:
        if typing.get_origin(field_type) is Literal or "Invalid enum value" in str(error):
            choices = typing.get_args(field_type) or ()
            flat = [c for arg in choices for c in (typing.get_args(arg) or (arg,)) if c is not type(None)]
            problem = "expected one of " + ", ".join(_render(choice) for choice in flat)
        else:
            problem = _readable(error)
        raise _error(
            dotted, f"{problem}, got {_shown(dotted, value, entry.from_text)}", entry.source
        ) from None


def _shown(dotted: str, value: object, from_text: bool) -> str:
    """A bad value for an error line, never a secret: a secret setting's is masked, and so is a password
    written into a URL."""
    if dotted in SECRET_SETTINGS:
        return MASK
    if isinstance(value, str):
        value = masked_url(value)
    return _render(value, from_text)


def _assemble(entries: Mapping[_Key, _Entry]) -> Settings:
    document: dict[str, dict[str, Any]] = {"kafka": default_kafka(), **{name: {} for name in SECTIONS}}
    for key, entry in entries.items():
        value = _convert(key, entry)
        if len(key) == 3:
            document[key[0]].setdefault(key[1], {})[key[2]] = value
        else:
            document[key[0]][key[1]] = value
    try:
        return msgspec.convert(document, Settings)
    except msgspec.ValidationError as error:
        # Only cross-field checks can fail here: every value was converted on its own above.
        message = str(error)
        problem, _, where = message.partition(" - at `$.")
        section = where.rstrip("`")
        name, _, detail = problem.partition(": ")
        sources = sorted(
            {entry.source for key, entry in entries.items() if key[0] == section and key[1] in problem}
        )
        raise _error(f"{section}.{name}", detail or problem, ", ".join(sources) or None) from None


def load_settings(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Settings:
    """Build Settings from defaults < `config_file` (TOML) < `env` (default: os.environ) < `overrides`.

    `overrides` uses dotted keys (``pipeline.max_in_flight``, ``kafka.security.protocol``); a None value means
    "flag not given" and is skipped. Raises UserError with one line naming the bad key and where it came from.
    """
    entries: dict[_Key, _Entry] = {}
    if config_file is not None:
        entries.update(_file_entries(config_file))
    entries.update(_env_entries(os.environ if env is None else env))
    entries.update(_override_entries(overrides or {}))
    settings = _assemble(entries)
    _check_registry(settings, entries)
    _check_privacy(settings, entries)
    return settings


def _check_registry(settings: Settings, entries: Mapping[_Key, _Entry]) -> None:
    """The registry formats read writers' schemas from a registry: without one the worker could decode no
    record, so it is refused at start rather than dead-lettering every ticket."""
    for key, chosen in (("input.format", settings.input.format), ("output.format", settings.output.format)):
        if chosen in REGISTRY_FORMATS and settings.schema_registry.url is None:
            given = entries.get(tuple(key.split(".")))
            origin = "" if given is None else f" (from {given.source})"
            raise _error(
                "schema_registry.url",
                f"required by {key} = {chosen}{origin}: the registry's address (`triage-worker registry "
                "start` prints a local one's)",
            )


def _check_privacy(settings: Settings, entries: Mapping[_Key, _Entry]) -> None:
    """`privacy.detect = []` looks for nothing, so a setting that promises redaction (of dead letters, of the
    review topic's text, of the model's input) would redact nothing: refused at start rather than leaving
    personal data in clear where the settings say it is masked."""
    if settings.privacy.detect:
        return
    promises = [
        ("dead_letter.redact", "true", settings.dead_letter.redact),
        ("review.threshold", str(settings.review.threshold), settings.review.threshold is not None),
        ("review.fallbacks", "true", settings.review.fallbacks),
        ("inference.redact_input", "true", settings.inference.redact_input),
    ]
    for key, shown, promised in promises:
        if promised:
            given = entries.get(tuple(key.split(".")))
            origin = "the default" if given is None else f"from {given.source}"
            detect = entries.get(("privacy", "detect"))
            raise _error(
                "privacy.detect",
                f"[] detects nothing, so {key} = {shown} ({origin}) would redact nothing: name the kinds to "
                f"detect (privacy.keep leaves them in clear on the review topic), or turn {key} off",
                None if detect is None else detect.source,
            )
