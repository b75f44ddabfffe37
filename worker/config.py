"""Settings: one validated object built from defaults < TOML file < environment < command line.

Each layer is flattened into dotted keys (``pipeline.max_in_flight``, ``kafka.bootstrap.servers``) that
remember where they came from, so a bad value fails at start with one line naming the key, what was expected,
the value (never a secret one) and its origin. ``[kafka]`` options are librdkafka's own and pass through
untouched, which is what lets SASL/SSL and every other client option work without code here; only their names
are checked at start, so that a typo is one line naming it rather than a client that fails later.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from worker.errors import UserError
from worker.librdkafka import PROPERTIES as LIBRDKAFKA_PROPERTIES
from worker.messages import TicketEvent
from worker.privacy.detector import KINDS, Kind
from worker.privacy.redaction import Redactor
from worker.privacy.values import EVERY_HEADER
from worker.shipped import shipped_path
from worker.small_files import read_small_file

DEFAULT_MODEL_DIR = shipped_path("models/triage-mini")
# The shipped escalation stage of the cascade (an encoder stage, see worker/inference/encoder.py), found like
# the embedded model.
DEFAULT_ESCALATION_DIR = shipped_path("models/triage-encoder")
# `inference.escalation` words: the model folder's own stage (`DIR/encoder/`, what `model train` writes),
# else the shipped stage where it fits the first stage's taxonomy (the default; see
# worker/inference/escalation.py), or no cascade.
ESCALATION_AUTO = "auto"
# The cascade's threshold where neither the settings nor the model folder choose one (`escalate_below`).
DEFAULT_ESCALATE_BELOW = 0.8
ESCALATION_OFF = "off"

Provider = Literal["cpu", "cuda", "dml"]
InferenceMode = Literal["score", "generate"]
PoolKind = Literal["process", "thread", "batch"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["console", "json"]
GuaranteeName = Literal["at_least_once", "exactly_once"]
Scheduling = Literal["edf", "fifo"]
# How the worker reads its input: a consumer group (partitions owned, offsets committed) or a share group
# (records handed out one by one under a lock, acknowledged per record; Kafka >= 4.2).
Consume = Literal["group", "queue"]
# How record values of the input topic are written: plain JSON, or one of the Schema Registry formats in
# the Confluent wire format (worker/contracts/input.py).
InputFormat = Literal["json", "avro", "json_schema", "protobuf"]
REGISTRY_FORMATS = frozenset({"avro", "json_schema", "protobuf"})
OutputFormat = Literal["json", "avro"]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveMs = Annotated[int, msgspec.Meta(gt=0)]
TopicName = Annotated[str, msgspec.Meta(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")]

SECRET_MARKERS = ("password", "secret", "key", "token", "jaas", "credentials")
MASK = "***"
# Settings (outside the kafka pass-through) that hold a credential: masked wherever settings are shown.
SECRET_SETTINGS = frozenset({"schema_registry.basic_auth_user_info"})


class TopicSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Topic names, and the layout `topics create` gives them."""

    input: TopicName = "tickets.raw"
    output: TopicName = "tickets.triaged"
    dead_letter: TopicName = "tickets.dlq"
    # Side topic of the shadow model's answers (see `InferenceSettings.shadow_settings`).
    shadow: TopicName = "tickets.triaged.shadow"
    # Side topic of results a person should check (see `ReviewSettings`), and the reviewers' verdicts.
    review: TopicName = "tickets.review"
    feedback: TopicName = "tickets.feedback"
    partitions: PositiveInt = 3
    replication_factor: PositiveInt = 1


class PipelineSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Consumer loop knobs: how much work may be in flight, how long a ticket may take, commit cadence."""

    group_id: Annotated[str, msgspec.Meta(min_length=1)] = "triage-worker"
    max_in_flight: PositiveInt = 64
    # Consumption pauses at max_in_flight and resumes once the in-flight count has drained to this level;
    # None means half of max_in_flight (see `resume_threshold`).
    resume_below: Annotated[int, msgspec.Meta(ge=0)] | None = None
    deadline_ms: PositiveMs = 2000
    poll_batch_size: PositiveInt = 100
    poll_timeout_ms: PositiveMs = 100
    commit_interval_ms: PositiveMs = 1000
    revoke_timeout_ms: PositiveMs = 10000
    shutdown_timeout_ms: PositiveMs = 15000
    max_value_bytes: PositiveInt = 1048576
    # Input headers (trace context, ...) a triage record carries, in order, up to this many bytes of names
    # and values; the rest are left off, so that no input can make a result its topic refuses.
    max_header_bytes: PositiveInt = 16384
    # exactly_once: results, dead letters and input offsets are written in Kafka transactions (see
    # worker/pipeline/settlements/guarantees.py); downstream consumers then need
    # isolation.level=read_committed.
    guarantee: GuaranteeName = "at_least_once"
    # The transactional producer's id in exactly_once mode; None means "<group_id>-<host name>". It must be
    # unique among live workers (two with one id fence each other) and should survive a restart of the same
    # instance, so that the restart aborts the crashed instance's open transaction at once.
    transactional_id: Annotated[str, msgspec.Meta(min_length=1, max_length=249)] | None = None
    # Which waiting ticket goes to the model next: earliest deadline first, or arrival order.
    scheduling: Scheduling = "edf"
    # "queue": read through a share group, more workers than partitions (worker/pipeline/sources/share.py).
    consume: Consume = "group"
    # Queue mode: a record delivered this many times is dead-lettered (`delivery_count_exceeded`) instead of
    # tried again; None: the group's `share.delivery.count.limit` (Kafka's default 5). Above the group's
    # limit the broker archives the record first, without a dead letter.
    delivery_count_limit: Annotated[int, msgspec.Meta(ge=2, le=10)] | None = None

    def __post_init__(self) -> None:
        if self.resume_below is not None and self.resume_below >= self.max_in_flight:
            raise ValueError(
                f"resume_below: expected int < max_in_flight ({self.max_in_flight}), got {self.resume_below}"
            )

    def transactional_id_or_default(self, host: str) -> str:
        """`transactional_id` with its default applied (see the field)."""
        return self.transactional_id or f"{self.group_id}-{host}"

    @property
    def resume_threshold(self) -> int:
        """`resume_below` with its default applied (half of `max_in_flight`), always < `max_in_flight`."""
        return self.max_in_flight // 2 if self.resume_below is None else self.resume_below


class InferenceSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Which model answers and how it runs. None means "let the inference room choose" (see its docs)."""

    model: Annotated[str, msgspec.Meta(min_length=1)] = str(DEFAULT_MODEL_DIR)
    taxonomy: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    provider: Provider = "cpu"
    provider_options: dict[str, str] = msgspec.field(default_factory=dict)
    intra_op_num_threads: PositiveInt = 1
    mode: InferenceMode = "score"
    pool: PoolKind | None = None
    pool_size: PositiveInt | None = None
    batch_size: PositiveInt = 8
    max_ticket_tokens: PositiveInt = 256
    # The model gets the ticket with `privacy.detect`'s kinds redacted. On by default: BANKING77 test tickets
    # with an identifier appended scored 78.2 % redacted against 61.9 % in clear, and tickets without one
    # are unchanged (docs/privacy.md#before-the-model).
    redact_input: bool = True
    # A shadow model classifies every ticket the primary classified, off the critical path. Flat keys, not a
    # nested table: settings are flattened to `section.key` (see `_split_key`). Any of the first three
    # turns it on; what is unset is the primary's (see `shadow_settings`).
    shadow_model: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    shadow_taxonomy: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    shadow_mode: InferenceMode | None = None
    # One context by default: the shadow shares the cores with the primary and must not crowd it out.
    shadow_pool_size: PositiveInt = 1
    # The cascade (worker/pipeline/triage/cascade.py): a ticket the model answers with a confidence under
    # `escalate_below` goes to the escalation stage when its deadline leaves time for it. `escalation` is the
    # stage's folder (an encoder stage with encoder.json, or an ORT GenAI model; the shipped one by its name,
    # "triage-encoder"), "auto" (that one where it fits) or "off"; None (set empty) is "off".
    escalation: Annotated[str, msgspec.Meta(min_length=1)] | None = ESCALATION_AUTO
    # None: the model folder's own choice (`training.json` `cascade.escalate_below`, which `model train`
    # writes), else 0.8, what `model eval` chose on the validation split for the shipped model
    # (docs/model.md#the-cascade).
    escalate_below: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    # One process by default: the stage shares the cores with the first one and must never crowd it out.
    escalation_pool_size: PositiveInt = 1

    def shadow_settings(self) -> InferenceSettings | None:
        """How the shadow model runs: these settings with the `shadow_*` keys applied; None when no shadow is
        configured. A shadow model without a taxonomy of its own uses its folder's taxonomy.toml, as the
        primary would: the primary's taxonomy names intents the other model may not know."""
        if self.shadow_model is None and self.shadow_taxonomy is None and self.shadow_mode is None:
            return None
        inherited_taxonomy = None if self.shadow_model is not None else self.taxonomy
        return msgspec.structs.replace(
            self,
            model=self.shadow_model or self.model,
            taxonomy=self.shadow_taxonomy or inherited_taxonomy,
            mode=self.shadow_mode or self.mode,
            pool_size=self.shadow_pool_size,
            shadow_model=None,
            shadow_taxonomy=None,
            shadow_mode=None,
            escalation=None,
        )

    def escalation_settings(self, taxonomy: str) -> InferenceSettings | None:
        """How the escalation stage runs: its folder as `model`, the first stage's `taxonomy` (its file, as
        resolved: both stages answer with one label set and one priority policy), its pool size, the rest
        (provider, threads) as the first stage's; None when the cascade is off. "auto" gives the shipped
        stage: whether it runs is `worker.inference.escalation.choose_escalation`'s call."""
        if self.escalation is None or self.escalation == ESCALATION_OFF:
            return None
        return msgspec.structs.replace(
            self,
            model=str(escalation_dir(self.escalation)),
            taxonomy=taxonomy,
            pool=None,
            pool_size=self.escalation_pool_size,
            shadow_model=None,
            shadow_taxonomy=None,
            shadow_mode=None,
            escalation=None,
        )


_TICKET_FIELDS = tuple(field.name for field in msgspec.structs.fields(TicketEvent))
# "module:Class", both parts dotted Python names.
_PYTHON_OBJECT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class InputSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the input topic's record values are written (docs/schema-registry.md)."""

    format: InputFormat = "json"
    # Per ticket field, the dotted path of the producer's record that holds it (`body = "description"`,
    # `customer_id = "requester.email"`); fields not named are read under their own name.
    fields: dict[str, str] = msgspec.field(default_factory=dict)
    # The producer's generated Protobuf message class, "module:Class" (confluent-kafka's Protobuf
    # deserializer decodes into a class, not from the registry's schema alone).
    protobuf_message: Annotated[str, msgspec.Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fields) - set(_TICKET_FIELDS))
        if unknown:
            raise ValueError(
                f"fields: no ticket field {', '.join(unknown)}; expected {', '.join(_TICKET_FIELDS)}"
            )
        empty = sorted(name for name, path in self.fields.items() if not path.strip(".") or ".." in path)
        if empty:
            raise ValueError(f"fields: expected a dotted path like requester.email for {', '.join(empty)}")
        if self.protobuf_message is not None and not _PYTHON_OBJECT.fullmatch(self.protobuf_message):
            raise ValueError(f"protobuf_message: expected module:Class, got {self.protobuf_message}")
        if self.format == "protobuf" and self.protobuf_message is None:
            raise ValueError(
                "protobuf_message: input.format protobuf needs the message class, as module:Class"
            )


class OutputSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How triage records are written to the output topic (docs/schema-registry.md#avro-output)."""

    # json: `TriageResult` as JSON. avro: in the Schema Registry wire format, with the schema generated from
    # `TriageResult` (schemas/triage_result.avsc) registered under the output topic's value subject at start.
    format: OutputFormat = "json"


class SchemaRegistrySettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The Schema Registry the registry input formats read writers' schemas from."""

    # None: no registry (plain JSON input only).
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://\S+$")] | None = None
    # "user:password" for HTTP basic authentication; a secret: never printed or logged.
    basic_auth_user_info: Annotated[str, msgspec.Meta(pattern=r"^[^:]*:.*$")] | None = None
    # CA bundle for an https registry; None: the system's (or certifi's) roots.
    ssl_ca_location: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    # One request's limit. Schemas are cached, so the loop waits on the registry only for a schema id it has
    # not seen yet, and no longer than this.
    timeout_ms: PositiveMs = 5000

    def client_config(self) -> dict[str, Any]:
        """confluent-kafka's `SchemaRegistryClient` configuration. No retries inside the client: its own
        (with sleeps of up to 20 s) would hold the consumer loop; the pipeline retries the record instead,
        with the partition paused (worker/pipeline/registry_wait.py)."""
        assert self.url is not None
        config: dict[str, Any] = {"url": self.url, "timeout": self.timeout_ms / 1000.0, "max.retries": 0}
        if self.basic_auth_user_info is not None:
            config["basic.auth.user.info"] = self.basic_auth_user_info
        if self.ssl_ca_location is not None:
            config["ssl.ca.location"] = self.ssl_ca_location
        return config

    def masked_url(self) -> str | None:
        """`url` with a password written into it (http://user:password@host) replaced by ``***``."""
        return None if self.url is None else _URL_PASSWORD.sub(rf"\1{MASK}@", self.url)

    def secrets(self) -> list[str]:
        """The secret strings these settings hold, for `mask_secrets`-like blanking of client messages."""
        found = [] if self.basic_auth_user_info is None else [self.basic_auth_user_info]
        found += [self.basic_auth_user_info.partition(":")[2]] if self.basic_auth_user_info else []
        if self.url is not None and (match := _URL_PASSWORD.search(self.url)):
            found.append(self.url[match.end(1) : match.end() - 1])
        return [secret for secret in found if secret]


# The password of `scheme://user:password@host`.
_URL_PASSWORD = re.compile(r"^(\w+://[^/@:]*:)[^/@]*@")


def escalation_dir(value: str) -> Path:
    """`inference.escalation` as a folder: a path, or "auto" or the shipped stage's name (where no such
    folder is) for the shipped stage."""
    folder = Path(value).expanduser()
    if value in (ESCALATION_AUTO, DEFAULT_ESCALATION_DIR.name) and not folder.exists():
        return DEFAULT_ESCALATION_DIR
    return folder


class ReviewSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Which results also go to the review side topic (`topics.review`) for a person to accept or correct
    (`triage-worker review`); off unless one of the two is set."""

    # Classified results whose confidence is under this go to review; None: none do.
    threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    # Fallbacks (no model answer) go to review too.
    fallbacks: bool = False

    @property
    def enabled(self) -> bool:
        return self.threshold is not None or self.fallbacks


class PrivacySettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Personal data in tickets (docs/privacy.md): which kinds are looked for (each result's `pii` lists
    those found) and which of them stay in clear on the review topic. Build each redactor once: they are
    reused per record."""

    detect: list[Kind] = msgspec.field(default_factory=lambda: list(KINDS))
    # Detected, listed in `pii`, but not redacted on the review topic (and nowhere else): for a deployment
    # whose reviewers may see, say, e-mails.
    keep: list[Kind] = msgspec.field(default_factory=list)
    # ISO 3166 country of phone numbers written without a +country code; "" finds only those with one.
    phone_region: Annotated[str, msgspec.Meta(pattern=r"^([A-Z]{2})?$")] = "US"
    # The input headers a triage record (and its review and shadow copies) carries, by name (case does not
    # matter), besides the worker's own `triage.*`; "*": every header. Their names and values are redacted.
    carry_headers: list[Annotated[str, msgspec.Meta(min_length=1)]] = msgspec.field(
        default_factory=lambda: [EVERY_HEADER]
    )

    def redactor(self) -> Redactor:
        """The ticket's scan: `detect`'s kinds, `keep`'s left in clear (the review topic's text)."""
        return Redactor(self.detect, self.keep, self.phone_region or None)

    def copy_redactor(self) -> Redactor:
        """`detect`'s kinds, none kept: what every other copy of ticket data takes (keys and headers of
        results, redacted dead letters, training files)."""
        return Redactor(self.detect, (), self.phone_region or None)

    def log_redactor(self) -> Redactor:
        """Every kind, `detect` or not, none kept: the worker's own words, which may quote anything (logs,
        `triage.error.message`, a command's error line)."""
        return Redactor(KINDS, (), self.phone_region or None)


class DeadLetterSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What a dead letter keeps of its record (docs/privacy.md#dead-letters)."""

    # False: the record as taken, so that replay can republish it. True: its value with personal data
    # redacted (replay then republishes the redacted ticket).
    redact: bool = False


class LogSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    level: LogLevel = "info"
    format: LogFormat = "console"


class MetricsSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Prometheus `/metrics` and the `/healthz` and `/readyz` probes, served on one HTTP port."""

    # None: no HTTP endpoint. Off by default so that several workers (and `demo`, and tests) on one host never
    # fight over a fixed port; the container image turns it on. 0 picks a free port and logs it.
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    host: Annotated[str, msgspec.Meta(min_length=1)] = "0.0.0.0"
    # /healthz fails once the consumer loop has not turned for this long. A rebalance holds the loop for up to
    # pipeline.revoke_timeout_ms, so keep this well above it.
    stall_timeout_ms: PositiveMs = 60000
    # A file holding the token `POST /reload` requires (worker/telemetry/access.py): the path is a setting,
    # the token never is, so it stays out of config files, the environment and `config show`. None: the
    # endpoint is closed and SIGHUP is the way to reload.
    reload_token_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None


def _default_kafka() -> dict[str, str]:
    return {"bootstrap.servers": "127.0.0.1:9092"}


class Settings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Everything the worker and its commands read; build it with `load_settings`."""

    kafka: dict[str, str] = msgspec.field(default_factory=_default_kafka)
    topics: TopicSettings = msgspec.field(default_factory=TopicSettings)
    pipeline: PipelineSettings = msgspec.field(default_factory=PipelineSettings)
    inference: InferenceSettings = msgspec.field(default_factory=InferenceSettings)
    review: ReviewSettings = msgspec.field(default_factory=ReviewSettings)
    privacy: PrivacySettings = msgspec.field(default_factory=PrivacySettings)
    dead_letter: DeadLetterSettings = msgspec.field(default_factory=DeadLetterSettings)
    log: LogSettings = msgspec.field(default_factory=LogSettings)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    input: InputSettings = msgspec.field(default_factory=InputSettings)
    output: OutputSettings = msgspec.field(default_factory=OutputSettings)
    schema_registry: SchemaRegistrySettings = msgspec.field(default_factory=SchemaRegistrySettings)


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "topics": TopicSettings,
    "pipeline": PipelineSettings,
    "inference": InferenceSettings,
    "review": ReviewSettings,
    "privacy": PrivacySettings,
    "dead_letter": DeadLetterSettings,
    "log": LogSettings,
    "metrics": MetricsSettings,
    "input": InputSettings,
    "output": OutputSettings,
    "schema_registry": SchemaRegistrySettings,
}
# Fields that are string→string tables: set one entry at a time, like the kafka section.
_MAP_FIELDS = frozenset({("inference", "provider_options"), ("input", "fields")})
_FIELD_TYPES: dict[str, dict[str, Any]] = {
    name: {field.name: field.type for field in msgspec.structs.fields(cls)} for name, cls in _SECTIONS.items()
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
    {"TRIAGE_KAFKA_HOME", "TRIAGE_KAFKA_VERSION", "TRIAGE_TEST_BROKER", "TRIAGE_KAFKA_IMAGE"}
)


def is_secret_key(key: str) -> bool:
    """Whether a librdkafka option holds a credential (password, key, token, JAAS config, ...)."""
    lowered = key.lower()
    return any(marker in lowered for marker in SECRET_MARKERS)


def masked_kafka_config(kafka: Mapping[str, str]) -> dict[str, str]:
    """A copy of librdkafka options that is safe to log or print: secret values replaced by ``***``."""
    return {key: MASK if is_secret_key(key) else value for key, value in kafka.items()}


def mask_secrets(text: str, kafka: Mapping[str, str]) -> str:
    """`text` (a client's error message) with the value of every secret option in `kafka` blanked out:
    belt and braces, whatever the client said."""
    for key, value in kafka.items():
        if value and is_secret_key(key):
            text = text.replace(value, MASK)
    return text


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
    if section not in _SECTIONS:
        raise _error(dotted, f"unknown section; expected one of kafka, {', '.join(_SECTIONS)}", source)
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
        if section != "kafka" and section not in _SECTIONS:
            raise _error(section, f"unknown section; expected one of kafka, {', '.join(_SECTIONS)}", source)
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
        text = _toml_value(value)
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
        value = _URL_PASSWORD.sub(rf"\1{MASK}@", value)
    return _render(value, from_text)


def _assemble(entries: Mapping[_Key, _Entry]) -> Settings:
    document: dict[str, dict[str, Any]] = {"kafka": _default_kafka(), **{name: {} for name in _SECTIONS}}
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


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and repeatable ``--set KEY=VALUE`` to a command's parser."""
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file")
    parser.add_argument(
        "--set",
        dest="config_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting, e.g. --set pipeline.max_in_flight=8 (repeatable; wins over file and env)",
    )


def _parse_sets(pairs: Iterable[str]) -> dict[str, object]:
    parsed: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            # Don't echo the argument: a mistyped "--set kafka.sasl.password:xyz" holds a secret.
            raise UserError("config error: --set expects KEY=VALUE, e.g. --set pipeline.max_in_flight=8")
        parsed[key.strip()] = value
    return parsed


def settings_from_args(args: argparse.Namespace, overrides: Mapping[str, object] | None = None) -> Settings:
    """Settings for a command that called `add_config_argument`; `overrides` (its flags) beat ``--set``."""
    merged = _parse_sets(getattr(args, "config_overrides", None) or [])
    merged.update({key: value for key, value in (overrides or {}).items() if value is not None})
    return load_settings(getattr(args, "config", None), overrides=merged)


def _toml_value(value: object) -> str:
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
    "review.threshold": "no result goes to review for its confidence",
    "metrics.port": "no HTTP endpoint",
    "metrics.reload_token_file": "POST /reload closed (SIGHUP reloads)",
    "input.protobuf_message": "needed by input.format protobuf",
    "schema_registry.url": "no registry (needed by the avro, json_schema and protobuf input formats)",
    "schema_registry.basic_auth_user_info": "no authentication",
    "schema_registry.ssl_ca_location": "the system's CA roots",
}


def unset_hint(key: str) -> str:
    """What an unset (None) setting means, e.g. ``half of max_in_flight`` for ``pipeline.resume_below``."""
    return _UNSET_HINTS.get(key, "unset")


def settings_to_toml(settings: Settings) -> str:
    """Effective settings as a TOML file `--config` accepts back, with kafka secrets masked."""
    lines = ["[kafka]"]
    lines += [f"{_toml_value(k)} = {_toml_value(v)}" for k, v in masked_kafka_config(settings.kafka).items()]
    for section in _SECTIONS:
        values = msgspec.structs.asdict(getattr(settings, section))
        lines += ["", f"[{section}]"]
        tables: list[str] = []
        for name, value in values.items():
            if value is not None and f"{section}.{name}" in SECRET_SETTINGS:
                lines.append(f"{name} = {_toml_value(MASK)}")
            elif section == "schema_registry" and name == "url" and value is not None:
                lines.append(f"{name} = {_toml_value(settings.schema_registry.masked_url())}")
            elif value is None:
                hint = unset_hint(f"{section}.{name}")
                lines.append(f"# {name}: not set ({hint})")
            elif isinstance(value, dict):
                tables += ["", f"[{section}.{name}]"]
                tables += [f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value.items()]
            else:
                lines.append(f"{name} = {_toml_value(value)}")
        lines += tables
    return "\n".join(lines) + "\n"
