"""`triage-worker run`'s setting flags: one per pipeline, topic, inference, log and metrics setting, each the
text of one dotted settings key (worker/settings). The generated reference (worker/dev/reference.py) lists
them; `run` adds them to its parser and hands what was given to the settings loader as overrides.
"""

from __future__ import annotations

import argparse

from worker.cli.defaults import with_default

# (flag, dotted settings key, help). Types are parsed by the settings loader, so flags take text; each help
# gets its default from Settings (worker/cli/defaults.py).
RUN_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--bootstrap-servers", "kafka.bootstrap.servers", "Kafka bootstrap servers, host:port[,host:port]"),
    ("--group-id", "pipeline.group_id", "consumer group id"),
    ("--input-topic", "topics.input", "topic of raw tickets"),
    ("--output-topic", "topics.output", "topic of triage records"),
    ("--dead-letter-topic", "topics.dead_letter", "topic of undecodable records"),
    (
        "--max-in-flight",
        "pipeline.max_in_flight",
        "most tickets between poll and commit; also the most a crash can duplicate",
    ),
    (
        "--resume-below",
        "pipeline.resume_below",
        "paused partitions resume once in-flight drops to this",
    ),
    ("--deadline-ms", "pipeline.deadline_ms", "per-ticket budget from poll to answer"),
    ("--poll-batch-size", "pipeline.poll_batch_size", "most records taken per poll"),
    ("--poll-timeout-ms", "pipeline.poll_timeout_ms", "longest wait of an idle poll"),
    ("--commit-interval-ms", "pipeline.commit_interval_ms", "commit cadence"),
    (
        "--revoke-timeout-ms",
        "pipeline.revoke_timeout_ms",
        "how long a rebalance waits for in-flight tickets of revoked partitions",
    ),
    (
        "--shutdown-timeout-ms",
        "pipeline.shutdown_timeout_ms",
        "how long shutdown waits for in-flight tickets",
    ),
    ("--max-value-bytes", "pipeline.max_value_bytes", "larger records are dead-lettered"),
    (
        "--guarantee",
        "pipeline.guarantee",
        "at_least_once | exactly_once (transactions; readers need read_committed)",
    ),
    (
        "--transactional-id",
        "pipeline.transactional_id",
        "exactly_once: this worker's transactional.id, unique among live workers",
    ),
    (
        "--scheduling",
        "pipeline.scheduling",
        "edf | fifo: tickets go to the model earliest deadline first, or in arrival order",
    ),
    (
        "--consume",
        "pipeline.consume",
        "group | queue: a consumer group, or a share group (Kafka >= 4.2; more workers than partitions, "
        "each ticket acknowledged on its own)",
    ),
    ("--model", "inference.model", "ORT GenAI model folder"),
    ("--taxonomy", "inference.taxonomy", "taxonomy TOML"),
    ("--mode", "inference.mode", "score | generate"),
    ("--provider", "inference.provider", "cpu | cuda | dml"),
    ("--pool", "inference.pool", "process | thread | batch"),
    ("--pool-size", "inference.pool_size", "contexts/worker processes"),
    ("--intra-op-threads", "inference.intra_op_num_threads", "ONNX Runtime threads per context"),
    (
        "--shadow-model",
        "inference.shadow_model",
        "shadow model folder: also classifies every classified ticket, off the critical path",
    ),
    ("--shadow-taxonomy", "inference.shadow_taxonomy", "shadow taxonomy"),
    ("--shadow-mode", "inference.shadow_mode", "shadow's score | generate"),
    ("--shadow-pool-size", "inference.shadow_pool_size", "shadow contexts"),
    ("--shadow-topic", "topics.shadow", "side topic of shadow answers"),
    (
        "--escalation",
        "inference.escalation",
        "escalation stage folder (encoder stage or ORT GenAI model; the shipped one: triage-encoder), auto "
        "(that one where it fits the taxonomy) or off: tickets the model is unsure of go to it when their "
        "deadline allows",
    ),
    ("--escalate-below", "inference.escalate_below", "escalate tickets whose first confidence is under this"),
    ("--escalation-pool-size", "inference.escalation_pool_size", "escalation stage processes"),
    (
        "--review-threshold",
        "review.threshold",
        "results under this confidence also go to the review topic, for `triage-worker review`",
    ),
    ("--review-topic", "topics.review", "side topic of results to review"),
    ("--log-level", "log.level", "debug | info | warning | error"),
    ("--log-format", "log.format", "console | json"),
    ("--metrics-port", "metrics.port", "serve /metrics, /healthz, /readyz here; 0 = any free port"),
    ("--metrics-host", "metrics.host", "address the metrics port binds"),
    ("--stall-timeout-ms", "metrics.stall_timeout_ms", "/healthz fails after a loop stall this long"),
    (
        "--reload-token-file",
        "metrics.reload_token_file",
        "file holding the token POST /reload requires; unset, the endpoint is closed (SIGHUP reloads)",
    ),
)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Add each setting flag to `parser`, its help ending in its default from Settings."""
    for flag, key, help_text in RUN_FLAGS:
        parser.add_argument(
            flag, dest=_dest(key), metavar=key.rsplit(".", 1)[-1].upper(), help=with_default(help_text, key)
        )


def flag_settings() -> list[tuple[str, str]]:
    """Each of `run`'s setting flags and the dotted setting it sets (for the generated reference)."""
    return [(flag, key) for flag, key, _ in RUN_FLAGS]


def overrides(args: argparse.Namespace) -> dict[str, object]:
    """The flags' values by dotted settings key (None where a flag was not given)."""
    return {key: getattr(args, _dest(key)) for _, key, _ in RUN_FLAGS}


def _dest(key: str) -> str:
    return "flag_" + key.replace(".", "_")
