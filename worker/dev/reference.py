"""The parts of docs/ generated from the code, so that they cannot drift from it.

- `settings`: every setting with its default (from `Settings`), its meaning (`SETTING_DOCS`) and what a hot
  reload does with it (`worker.settings.reloads.RELOAD`).
- `run-flags`: `triage-worker run`'s flags, the setting each one sets and its default (from `Settings`).
- `metrics`: every metric the worker, the lag exporter and replay export (from their registered collectors).

A generated part sits between ``<!-- generated: NAME ... -->`` and ``<!-- end generated -->`` in a page;
``python -m worker.dev.reference --write`` (`make docs`) rewrites them all, ``--check`` lists the stale ones
and exits 1 (tests/project/test_docs.py does the same).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from worker.cli.defaults import default_of
from worker.cli.flags import flag_settings
from worker.cli.lag_command import GroupLagCollector
from worker.messages import ReviewReason
from worker.pipeline.metrics import (
    EscalationMetrics,
    PartitionGauges,
    PipelineMetrics,
    QueueMetrics,
    RegistryState,
    ReviewMetrics,
    ShadowMetrics,
)
from worker.settings import Settings
from worker.settings.reloads import RELOAD
from worker.telemetry.collectors import ModelProcessCollector, PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.replay import ReplayMetrics
from worker.telemetry.server import Check

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"

# What each setting means; a test fails when a setting has no entry here or an entry names no setting.
SETTING_DOCS: dict[str, str] = {
    "kafka.*": "librdkafka options, passed through untouched (SASL, TLS, timeouts, ...)",
    "topics.input": "topic of raw tickets",
    "topics.output": "topic of triage records",
    "topics.dead_letter": "topic of records that are not tickets, each with the reason",
    "topics.shadow": "side topic of the shadow model's answers (only with a shadow model)",
    "topics.review": "side topic of results for a person to check, with the ticket's text (only with "
    "`review.*` set; [review loop](review-loop.md))",
    "topics.feedback": "topic of the reviewers' verdicts (`FeedbackEvent`s) that `triage-worker review` "
    "writes and `model train --feedback-topic` learns from",
    "topics.partitions": "partitions `triage-worker topics create` gives each topic (the most workers that "
    "share the load)",
    "topics.replication_factor": "replication factor `topics create` uses",
    "pipeline.group_id": "consumer group; run more workers in it to scale out",
    "pipeline.max_in_flight": "most tickets between poll and commit; at the bound partitions are paused; "
    "also the most a crash can duplicate",
    "pipeline.resume_below": "in-flight count at which paused partitions resume",
    "pipeline.deadline_ms": "per-ticket deadline, counted from the poll (a producer's earlier "
    "`metadata.deadline_at` wins); also a bucket bound of the latency histograms",
    "pipeline.poll_batch_size": "most records taken per poll",
    "pipeline.poll_timeout_ms": "longest wait of an idle poll",
    "pipeline.commit_interval_ms": "longest time between commits of acknowledged offsets (they also commit "
    "as soon as they fill half of `max_in_flight`)",
    "pipeline.revoke_timeout_ms": "how long a revoke waits for in-flight tickets of revoked partitions (at "
    "most half of `max.poll.interval.ms`: the wait happens inside a poll)",
    "pipeline.shutdown_timeout_ms": "how long shutdown waits for in-flight tickets",
    "pipeline.max_value_bytes": "larger values are dead-lettered as `too_large`",
    "pipeline.max_header_bytes": "input headers a triage record carries, in order, up to this many bytes "
    "(names and values); the rest are left off (dead letters keep all)",
    "pipeline.guarantee": "`at_least_once`, or `exactly_once`: results, dead letters and input offsets in "
    "Kafka transactions; readers need `isolation.level=read_committed` ([guarantees](guarantees.md))",
    "pipeline.transactional_id": "exactly-once only: this worker's `transactional.id`; unique among live "
    "workers, stable across restarts of the same instance",
    "pipeline.scheduling": "order in which waiting tickets go to the model: `edf` (earliest deadline first) "
    "or `fifo` (arrival order)",
    "pipeline.consume": "`group`: a consumer group (partitions owned, offsets committed); `queue`: a share "
    "group, Kafka >= 4.2 (any number of workers per partition, each ticket acknowledged on its own; "
    "[operations](operations.md#queue-mode))",
    "pipeline.delivery_count_limit": "queue mode: a record delivered this often is dead-lettered "
    "(`delivery_count_exceeded`) instead of tried again; unset: the group's `share.delivery.count.limit`",
    "inference.model": "ORT GenAI model folder; a relative path is relative to the working directory",
    "inference.taxonomy": "intents, priorities and instruction text; in `score` mode only labels the model "
    "was trained on ([model](model.md))",
    "inference.provider": "`cpu`, `cuda` (`pip install 'triage-worker[cuda]'`), `dml` (`[directml]`)",
    "inference.provider_options": "options of the execution provider, one `--set "
    "inference.provider_options.NAME=VALUE` each",
    "inference.intra_op_num_threads": "ONNX Runtime threads per context",
    "inference.mode": "`score` (every label scored) or `generate` (the label written token by token)",
    "inference.pool": "`process` (CPU default), `thread`, or `batch` (GPU default)",
    "inference.pool_size": "contexts (model processes) answering in parallel",
    "inference.batch_size": "static batch size of the `batch` pool",
    "inference.redact_input": "the model gets the ticket with its personal data redacted "
    "([privacy](privacy.md#before-the-model))",
    "inference.max_ticket_tokens": "longer tickets are cut (`truncated: true`)",
    "inference.shadow_model": "a shadow model that also classifies every classified ticket, off the "
    "critical path ([operations](operations.md#shadow-model))",
    "inference.shadow_taxonomy": "the shadow's taxonomy",
    "inference.shadow_mode": "the shadow's mode",
    "inference.shadow_pool_size": "the shadow's contexts",
    "inference.escalation": "the cascade's escalation stage: an encoder-stage folder or an ORT GenAI model "
    "folder, `triage-encoder` (the shipped one), `auto` (the model folder's own `encoder/` stage, else the "
    "shipped one where the taxonomy has exactly its BANKING77 labels) or `off` "
    "([model](model.md#the-cascade))",
    "inference.escalate_below": "tickets whose first answer's confidence is under this go to the escalation "
    "stage when their deadline leaves time (0.8 for the shipped model, chosen on the validation split; a "
    "folder `model train` wrote records its own: 1.0 when its first stage saw no held-out ticket)",
    "inference.escalation_pool_size": "the escalation stage's processes",
    "inference.escalation_llm": "an ORT GenAI model folder that decides among the encoder stage's "
    "`escalation_top_k` best intents, listed with their descriptions in its prompt; the answer is one of "
    "them ([model](model.md#an-llm-over-the-encoders-top-candidates))",
    "inference.escalation_top_k": "how many of the encoder stage's best intents `escalation_llm` decides "
    "among (2 to 5)",
    "review.threshold": "classified results whose confidence is under this also go to `topics.review`",
    "review.fallbacks": "fallbacks (no model answer) also go to `topics.review`",
    "privacy.detect": "kinds of personal data looked for in every ticket (`email`, `iban`, `card_number`, "
    "`us_ssn`, `phone`): listed in each result's `pii` and redacted in every copy ([privacy](privacy.md)); "
    "comma-separated from the environment; `[]` is refused while a setting promises redaction",
    "privacy.keep": "detected kinds left in clear on the review topic's text, and nowhere else (still "
    "listed in `pii`)",
    "privacy.phone_region": "country (ISO 3166 alpha-2) of phone numbers written without `+country`, in "
    "tickets and in the logs; empty: only numbers with one are found",
    "privacy.carry_headers": "input headers a triage record and its review and shadow copies carry, by name "
    "(`*`: every one), besides the worker's own `triage.*`; their names and values are redacted "
    "([privacy](privacy.md#keys-and-headers))",
    "dead_letter.redact": "dead letters carry the record (key, value, headers) with its personal data "
    "redacted instead of as taken (replay then republishes the redacted ticket; "
    "[privacy](privacy.md#dead-letters))",
    "log.level": "`debug`, `info`, `warning` or `error`",
    "log.format": "`console`, or `json` for log shippers",
    "metrics.port": "HTTP port of `/metrics`, `/healthz`, `/readyz`, `POST /reload`; `0` = any free port "
    "(logged); the image sets 9400",
    "metrics.host": "address that port binds",
    "metrics.stall_timeout_ms": "`/healthz` fails once the consumer loop has not turned for this long (keep "
    "it above `revoke_timeout_ms`)",
    "metrics.reload_token_file": "file holding the token `POST /reload` requires (`Authorization: Bearer`); "
    "at least 16 printable ASCII characters, not readable by other users; unset, the endpoint is closed "
    "([operations](operations.md#changing-the-model-without-a-restart))",
    "input.format": "how input values are written: `json`, or `avro`, `json_schema`, `protobuf` in the "
    "Schema Registry wire format, which need `schema_registry.url` ([schema registry](schema-registry.md))",
    "input.fields": "per ticket field, the dotted path of the producer's record that holds it "
    "(`input.fields.body = description`, `input.fields.customer_id = requester.email`); unknown ticket "
    "fields are refused",
    "input.protobuf_message": "the producer's generated Protobuf message class, `module:Class` (importable "
    "by the worker); required by `input.format = protobuf`",
    "output.format": "how triage records are written: `json`, or `avro` in the Schema Registry wire format "
    "with the schema of `schemas/triage_result.avsc`, registered under the output topic's value subject at "
    "start ([schema registry](schema-registry.md#avro-output))",
    "schema_registry.url": "the Schema Registry's address (`http://host:8081`); a password in it is masked",
    "schema_registry.basic_auth_user_info": "`user:password` for the registry's HTTP basic authentication; "
    "masked by `config show`, never logged",
    "schema_registry.ssl_ca_location": "CA bundle for an `https` registry",
    "schema_registry.timeout_ms": "one registry request's limit (schemas are cached: only a new schema id "
    "asks); an unanswered record is retried with its partition paused, never dead-lettered",
    "tracing.exporter": "`otlp`: per-ticket OpenTelemetry traces sent to a collector (needs the `otel` "
    "extra); `none`: off, unless `OTEL_TRACES_EXPORTER=otlp` is in the environment "
    "([tracing](operations.md#tracing))",
    "tracing.endpoint": "the collector's OTLP endpoint, `http://host:4318` (http/protobuf; `/v1/traces` is "
    "added) or `http://host:4317` (grpc)",
    "tracing.protocol": "`http/protobuf` or `grpc`",
    "tracing.sample_ratio": "the share of tickets traced whose producer sent no trace context (parent-based: "
    "a producer's sampling decision is kept)",
}


def setting_keys() -> list[str]:
    """Every dotted setting, in `Settings` order; `kafka.*` stands for the librdkafka pass-through."""
    keys = ["kafka.*"]
    for section in msgspec.structs.fields(Settings):
        if section.name != "kafka":
            keys += [f"{section.name}.{field.name}" for field in msgspec.structs.fields(section.type)]
    return keys


def settings_table() -> str:
    rows = ["| key | default | meaning | on reload |", "|---|---|---|---|"]
    for key in setting_keys():
        default = "bootstrap.servers = " + default_of("kafka.bootstrap.servers") if key == "kafka.*" else None
        cells = f"{_cell(default or default_of(key))} | {SETTING_DOCS[key]} | {reload_cell(key)}"
        rows.append(f"| `{key}` | {cells} |")
    return "\n".join(rows)


def reload_cell(key: str) -> str:
    """What a hot reload does with setting `key` (docs/operations.md#what-a-reload-does-with-each-setting)."""
    declared = RELOAD["kafka" if key == "kafka.*" else key]
    return f"**{declared.reload}**" + (f": {declared.why}" if declared.why else "")


def run_flags_table() -> str:
    rows = ["| flag | setting | default |", "|---|---|---|"]
    rows += [f"| `{flag}` | `{key}` | {_cell(default_of(key))} |" for flag, key in flag_settings()]
    return "\n".join(rows)


def _cell(text: str) -> str:
    plain = text.replace("|", "\\|")
    return f"`{plain}`" if re.fullmatch(r"[\w.:*-]+(, [\w.=:-]+)*|[\w.-]+ = [\w.:-]+", plain) else plain


class _NoProgress:
    def planned(self, plan: object) -> None: ...

    def settled(self, report: object) -> None: ...


class _AnsweringBroker:
    state = Check(True, "metadata answered")


def exporters() -> dict[str, CollectorRegistry]:
    """A registry per process kind, with every family present: the worker (with a shadow, review, the cascade
    and one model process), the lag exporter and replay."""
    metrics = PipelineMetrics(
        shadow=ShadowMetrics(),
        review=ReviewMetrics(),
        escalation=EscalationMetrics.starting(("a",)),
        registry=RegistryState(),
        queue=QueueMetrics(),
    )
    metrics.partitions = PartitionGauges(
        assigned=(("t", 0),), blocked=(("t", 0),), lag=((("t", 0), 0),), member=True
    )
    assert metrics.shadow is not None and metrics.review is not None
    metrics.shadow.compared("a", "b")
    metrics.review.sent.update({("a", reason): 1 for reason in typing.get_args(ReviewReason)})
    probes = WorkerProbes(60.0, _AnsweringBroker(), lambda: 0.0)  # type: ignore[arg-type]
    probes.metrics, probes.pool_contexts = metrics, 1
    probes.restart_pending = ("pipeline.max_in_flight",)
    model_processes = ModelProcessCollector()
    model_processes.pools["primary"] = lambda: [os.getpid()]
    worker = CollectorRegistry()
    worker.register(
        PipelineCollector(probes, {"version": "", "model": "", "mode": "", "provider": "", "pool": ""})
    )
    worker.register(model_processes)
    lag = CollectorRegistry()
    lag.register(GroupLagCollector(lambda: {0: 0}, "group", "topic"))
    replay = CollectorRegistry()
    replay.register(ReplayMetrics(_NoProgress()))
    return {"worker": worker, "lag-exporter": lag, "replay": replay}


def metrics_table() -> str:
    rows = ["| metric | type | labels | exported by | meaning |", "|---|---|---|---|---|"]
    for source, registry in exporters().items():
        for family in registry.collect():
            rows.append(
                f"| `{_sample_name(family)}` | {family.type} | {_labels(family)} | {source} | "
                f"{family.documentation} |"
            )
    return "\n".join(rows)


def _sample_name(family: Metric) -> str:
    return {"counter": f"{family.name}_total", "info": f"{family.name}_info"}.get(family.type, family.name)


# Labels whose every value is known in advance (and exported at 0): the table lists the values.
_KNOWN_VALUED = frozenset({"reason", "error_type", "outcome"})


def _labels(family: Metric) -> str:
    names = sorted({name for sample in family.samples for name in sample.labels if name != "le"})
    cells = []
    for name in names:
        values = sorted({sample.labels[name] for sample in family.samples})
        known = f" ({', '.join(values)})" if name in _KNOWN_VALUED else ""
        cells.append(f"`{name}`{known}")
    return ", ".join(cells) or "-"


SECTIONS: dict[str, Callable[[], str]] = {
    "settings": settings_table,
    "run-flags": run_flags_table,
    "metrics": metrics_table,
}
_GENERATED = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+)[^\n]*-->\n)(?P<body>.*?)(<!-- end generated -->)", re.DOTALL
)


def refreshed(text: str) -> str:
    """`text` with every generated part rewritten from the code."""

    def rewrite(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in SECTIONS:
            raise ValueError(f"unknown generated part {name!r} (known: {', '.join(SECTIONS)})")
        return f"{match.group(1)}{SECTIONS[name]()}\n{match.group(4)}"

    return _GENERATED.sub(rewrite, text)


def pages(docs_dir: Path = DOCS_DIR) -> list[Path]:
    return sorted(
        path for path in docs_dir.glob("*.md") if _GENERATED.search(path.read_text(encoding="utf-8"))
    )


def stale(paths: Iterable[Path]) -> list[Path]:
    return [path for path in paths if refreshed(text := path.read_text(encoding="utf-8")) != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.dev.reference", description=__doc__.splitlines()[0]
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--check", action="store_true", help="exit 1 naming the pages whose generated parts are stale"
    )
    mode.add_argument("--write", action="store_true", help="rewrite the generated parts of every page")
    args = parser.parse_args(argv)
    outdated = stale(pages())
    if args.check:
        for path in outdated:
            print(f"{path}: generated parts are stale; run `make docs`", file=sys.stderr)
        return 1 if outdated else 0
    for path in outdated:
        path.write_text(refreshed(path.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
