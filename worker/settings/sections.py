"""The settings' sections: one validated, frozen struct per TOML table (`[pipeline]`, `[inference]`, ...),
their defaults and the checks across a section's fields, and `Settings`, which holds them all. `[kafka]` is
a plain table of librdkafka's own options, passed through untouched. Build a `Settings` with
`worker.settings.load_settings`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from worker.messages import TicketEvent
from worker.privacy.detector import KINDS, Kind
from worker.privacy.redaction import Redactor
from worker.privacy.values import EVERY_HEADER
from worker.settings.masking import URL_PASSWORD, masked_url
from worker.shipped import shipped_path

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
# How many of the encoder stage's best intents the escalation LLM decides among (`escalation_top_k`): at most
# the encoder's `scores` (its top 5). 2 by default: 3 and 5 were within 1.5 points of it on every row of
# results/llm-topk.md, at up to 2.4 times its time per ticket.
MAX_CANDIDATES = 5
DEFAULT_CANDIDATES = 2

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
# Where per-ticket traces go: nowhere, or an OpenTelemetry collector over OTLP (docs/operations.md#tracing).
TracesExporter = Literal["none", "otlp"]
OtlpProtocol = Literal["http/protobuf", "grpc"]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveMs = Annotated[int, msgspec.Meta(gt=0)]
TopicName = Annotated[str, msgspec.Meta(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")]


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
    # nested table: settings are flattened to `section.key` (`loading`). Any of the first three
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
    # An ORT GenAI model folder that decides among the encoder stage's `escalation_top_k` best intents, their
    # descriptions listed in its prompt (worker/inference/candidates.py); None: the encoder stage's own
    # answer stands. Needs an encoder stage as `escalation`.
    escalation_llm: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    escalation_top_k: Annotated[int, msgspec.Meta(ge=2, le=MAX_CANDIDATES)] = DEFAULT_CANDIDATES

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
            escalation_llm=None,
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

    def candidates_llm_settings(self) -> InferenceSettings | None:
        """How the LLM that decides among this escalation stage's candidates runs: `escalation_llm` as
        `model`, in score mode; None when there is none. Only a stage's settings (`escalation_settings`, with
        no cascade of their own) have one: a first stage's `escalation_llm` belongs to its cascade."""
        if self.escalation_llm is None or self.escalation is not None:
            return None
        return msgspec.structs.replace(self, model=self.escalation_llm, mode="score", escalation_llm=None)


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
        return None if self.url is None else masked_url(self.url)

    def secrets(self) -> list[str]:
        """The secret strings these settings hold, for `mask_secrets`-like blanking of client messages."""
        found = [] if self.basic_auth_user_info is None else [self.basic_auth_user_info]
        found += [self.basic_auth_user_info.partition(":")[2]] if self.basic_auth_user_info else []
        if self.url is not None and (match := URL_PASSWORD.search(self.url)):
            found.append(self.url[match.end(1) : match.end() - 1])
        return [secret for secret in found if secret]


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


class TracingSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Per-ticket OpenTelemetry traces (docs/operations.md#tracing), sent over OTLP; needs the `otel` extra.
    Off unless `exporter = "otlp"` here or, as with any OpenTelemetry SDK, `OTEL_TRACES_EXPORTER=otlp` in
    the environment; what is not set here comes from the standard `OTEL_*` variables."""

    # "none": off, unless OTEL_TRACES_EXPORTER=otlp is in the environment.
    exporter: TracesExporter = "none"
    # The collector's OTLP endpoint, e.g. http://collector:4318 (http/protobuf; /v1/traces is added) or
    # http://collector:4317 (grpc). None: OTEL_EXPORTER_OTLP_ENDPOINT, else the SDK's default (localhost).
    endpoint: Annotated[str, msgspec.Meta(pattern=r"^https?://\S+$")] | None = None
    # None: OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf.
    protocol: OtlpProtocol | None = None
    # The share of tickets traced whose producer sent no sampled trace context (parent-based: a ticket
    # whose producer's span was sampled is traced, one whose was not is not). None: OTEL_TRACES_SAMPLER and
    # OTEL_TRACES_SAMPLER_ARG, else every ticket.
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


def default_kafka() -> dict[str, str]:
    """The `[kafka]` table where nothing sets it: a broker on this host's default port."""
    return {"bootstrap.servers": "127.0.0.1:9092"}


class Settings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Everything the worker and its commands read; build it with `load_settings`."""

    kafka: dict[str, str] = msgspec.field(default_factory=default_kafka)
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
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)


# The sections by their TOML table name, in the order `config show` writes them.
SECTIONS: dict[str, type[msgspec.Struct]] = {
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
    "tracing": TracingSettings,
}
# Fields that are string→string tables: set one entry at a time, like the kafka section.
