"""Configuration: precedence, one clear line per bad value with its origin, secrets never shown."""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tools import REPO
from worker.cli.cli import main
from worker.errors import UserError
from worker.settings import (
    DEFAULT_MODEL_DIR,
    PipelineSettings,
    add_config_argument,
    load_settings,
    masked_kafka_config,
    settings_from_args,
)

SECRET = "hunter2-very-secret"
TINY = REPO / "tests" / "models" / "tiny"


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _error(**kwargs: object) -> str:
    with pytest.raises(UserError) as caught:
        load_settings(**kwargs)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_defaults() -> None:
    settings = load_settings(env={})
    assert settings.kafka == {"bootstrap.servers": "127.0.0.1:9092"}
    assert (settings.topics.input, settings.topics.output, settings.topics.dead_letter) == (
        "tickets.raw",
        "tickets.triaged",
        "tickets.dlq",
    )
    assert settings.pipeline.max_in_flight == 64
    assert settings.pipeline.resume_threshold == 32
    assert settings.inference.model == str(DEFAULT_MODEL_DIR)
    assert REPO / "models" / "triage-mini" == DEFAULT_MODEL_DIR
    assert (settings.inference.provider, settings.inference.mode, settings.inference.pool) == (
        "cpu",
        "score",
        None,
    )


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
[pipeline]
max_in_flight = 8
deadline_ms = 500
poll_batch_size = 10

[topics]
input = "from-file"
""",
    )
    env = {"TRIAGE_PIPELINE__MAX_IN_FLIGHT": "16", "TRIAGE_PIPELINE__DEADLINE_MS": "700"}
    settings = load_settings(path, env=env, overrides={"pipeline.max_in_flight": 32, "log.level": None})
    assert settings.pipeline.max_in_flight == 32  # flag beats env and file
    assert settings.pipeline.deadline_ms == 700  # env beats file
    assert settings.pipeline.poll_batch_size == 10  # file beats default
    assert settings.topics.input == "from-file"
    assert settings.log.level == "info"  # a None override means "flag not given"


def test_kafka_options_pass_through_from_file_env_and_flags(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
[kafka]
"bootstrap.servers" = "broker-a:9092"
"security.protocol" = "SASL_SSL"
"enable.idempotence" = true
"linger.ms" = 5
""",
    )
    env = {
        "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        # Kafka's own JVM/script variables must not become client options.
        "KAFKA_HEAP_OPTS": "-Xmx1G",
        "KAFKA_OPTS": "-Dx=y",
        "KAFKA_LOG4J_OPTS": "-Dlog4j",
        "KAFKA_JVM_PERFORMANCE_OPTS": "-server",
        "KAFKA_HOME": "/opt/kafka",
    }
    settings = load_settings(path, env=env, overrides={"kafka.client.id": "triage-7"})
    assert settings.kafka == {
        "bootstrap.servers": "broker-a:9092",
        "security.protocol": "SASL_PLAINTEXT",
        "enable.idempotence": "true",
        "linger.ms": "5",
        "sasl.mechanism": "SCRAM-SHA-512",
        "client.id": "triage-7",
    }


def test_optional_values_and_tables_from_env() -> None:
    env = {
        "TRIAGE_INFERENCE__POOL": "thread",
        "TRIAGE_INFERENCE__POOL_SIZE": "3",
        "TRIAGE_INFERENCE__PROVIDER_OPTIONS__DEVICE_ID": "1",
        "TRIAGE_PIPELINE__RESUME_BELOW": "10",
        # The local broker's, not settings: a worker started beside `broker start` reads the same environment.
        "TRIAGE_KAFKA_HOME": "/opt/kafka-jars",
        "TRIAGE_KAFKA_VERSION": "4.4.0",
        "TRIAGE_KAFKA_TRANSACTION_VERSION": "1",
    }
    settings = load_settings(env=env, overrides={"inference.pool_size": ""})
    assert settings.inference.pool == "thread"
    assert settings.inference.pool_size is None  # empty text from a flag clears an optional setting
    assert settings.inference.provider_options == {"device_id": "1"}
    assert settings.pipeline.resume_threshold == 10


@pytest.mark.parametrize(
    ("env", "overrides", "expected"),
    [
        (
            {"TRIAGE_PIPELINE__MAX_IN_FLIGHT": "0"},
            {},
            "config error: pipeline.max_in_flight: expected int >= 1, got 0 "
            "(from TRIAGE_PIPELINE__MAX_IN_FLIGHT)",
        ),
        (
            {"TRIAGE_PIPELINE__DEADLINE_MS": "fast"},
            {},
            "config error: pipeline.deadline_ms: expected int, got fast (from TRIAGE_PIPELINE__DEADLINE_MS)",
        ),
        (
            {},
            {"inference.provider": "tpu"},
            'config error: inference.provider: expected one of "cpu", "cuda", "dml", got tpu '
            "(from command line)",
        ),
        (
            {"TRIAGE_PIPELINE__MAX_IN_FLIGHT": "8"},
            {"pipeline.resume_below": 8},
            "config error: pipeline.resume_below: expected int < max_in_flight (8), got 8 "
            "(from TRIAGE_PIPELINE__MAX_IN_FLIGHT, command line)",
        ),
        ({}, {"pipelines.max_in_flight": 8}, "config error: pipelines.max_in_flight: unknown section"),
    ],
)
def test_one_bad_value_gives_one_line_naming_key_and_origin(
    env: dict[str, str], overrides: dict[str, object], expected: str
) -> None:
    assert _error(env=env, overrides=overrides).startswith(expected)


@pytest.mark.parametrize(
    ("variable", "meant"),
    [
        ("TRIAGE_MAX_IN_FLIGHT", "TRIAGE_PIPELINE__MAX_IN_FLIGHT"),  # once ignored in silence
        ("TRIAGE_PIPELINE_MAX_IN_FLIGHT", "TRIAGE_PIPELINE__MAX_IN_FLIGHT"),
        ("TRIAGE_PIPELINE__MAX_INFLIGHT", "TRIAGE_PIPELINE__MAX_IN_FLIGHT"),
        ("TRIAGE_PIPELINES__MAX_IN_FLIGHT", "TRIAGE_PIPELINE__MAX_IN_FLIGHT"),
        ("TRIAGE_DEADLINE", "TRIAGE_PIPELINE__DEADLINE_MS"),
        ("TRIAGE_INFERENCE__PROVIDER_OPTIONS", "TRIAGE_INFERENCE__PROVIDER_OPTIONS__<NAME>"),
    ],
)
def test_an_unknown_triage_variable_is_one_line_naming_the_nearest_setting(variable: str, meant: str) -> None:
    assert _error(env={variable: "5"}) == f"config error: {variable}: no such setting; did you mean {meant}?"


def test_a_triage_variable_like_no_setting_at_all_says_what_settings_look_like() -> None:
    assert _error(env={"TRIAGE_FOO": "1"}) == (
        "config error: TRIAGE_FOO: no such setting; settings are TRIAGE_<SECTION>__<KEY>"
    )


def test_service_links_of_a_triage_service_are_ignored_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Kubernetes gives every pod TRIAGE_WORKER_METRICS_SERVICE_HOST, ... for a Service
    `triage-worker-metrics` in its namespace (unless enableServiceLinks: false): not typos, and no reason to
    refuse to start."""
    links = {
        "TRIAGE_WORKER_METRICS_SERVICE_HOST": "10.0.0.9",
        "TRIAGE_WORKER_METRICS_PORT": "tcp://10.0.0.9:9400",
    }
    assert load_settings(env={**links, "TRIAGE_METRICS__PORT": "9400"}).metrics.port == 9400
    assert (
        "ignoring TRIAGE_WORKER_METRICS_PORT, TRIAGE_WORKER_METRICS_SERVICE_HOST" in capsys.readouterr().err
    )


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[pipeline]\nmax_in_flihgt = 8\n")
    assert _error(config_file=path, env={}).startswith(
        "config error: pipeline.max_in_flihgt: unknown key; pipeline has group_id, max_in_flight"
    )
    assert _error(config_file=path, env={}).endswith(f"(from {path})")
    assert _error(config_file=_toml(tmp_path, "[pipline]\n"), env={}).startswith(
        "config error: pipline: unknown section"
    )


def test_file_values_keep_their_toml_type(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[pipeline]\nmax_in_flight = "8"\n')
    assert _error(config_file=path, env={}) == (
        f'config error: pipeline.max_in_flight: expected int, got "8" (from {path})'
    )


def test_unreadable_or_invalid_file(tmp_path: Path) -> None:
    assert _error(config_file=tmp_path / "missing.toml", env={}).startswith("config error: cannot read")
    assert "invalid TOML" in _error(config_file=_toml(tmp_path, "[pipeline\n"), env={})


@pytest.mark.parametrize(
    "command",
    [
        ["config", "show", "--config", "/dev/zero"],
        ["classify", "hi", "--model", str(TINY), "--taxonomy", "/dev/zero"],
        ["classify", "hi", "--model", str(TINY), "--taxonomy", "{big}"],
    ],
    ids=["config-dev-zero", "taxonomy-dev-zero", "taxonomy-2-MiB"],
)
def test_a_settings_file_or_taxonomy_is_read_with_a_bound(command: list[str], tmp_path: Path) -> None:
    """`--taxonomy /dev/zero` once read 8.1 GB before anything was said (here the memory is capped at 4 GiB
    so that the old way fails fast): now one line, at once."""
    big = tmp_path / "big.toml"
    big.write_text("# a comment\n" * ((2 << 20) // 12) + (TINY / "taxonomy.toml").read_text())
    command = [part.format(big=big) for part in command]
    done = subprocess.run(
        [sys.executable, "-m", "worker", *command],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)),
        check=False,
    )
    what = "a settings file" if command[0] == "config" else "a taxonomy"
    prefix = "config error: cannot read" if command[0] == "config" else "cannot read taxonomy file"
    line = f"{prefix} {command[-1]}: over 1 MiB, too large for {what}: is it the right file?"
    assert (done.returncode, done.stderr) == (2, f"triage-worker: error: {line}\n")


def test_a_fallback_intent_that_is_a_real_intent_is_refused_at_load(tmp_path: Path) -> None:
    """A fallback (no model answer) named like a real intent reads as an answer downstream."""
    taxonomy = tmp_path / "taxonomy.toml"
    taxonomy.write_text(
        (TINY / "taxonomy.toml")
        .read_text()
        .replace('fallback_intent = "unclassified"', 'fallback_intent = "card_arrival"')
    )
    done = subprocess.run(
        [sys.executable, "-m", "worker", "classify", "hi", "--model", str(TINY), "--taxonomy", str(taxonomy)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"triage-worker: error: {taxonomy}: `fallback_intent` 'card_arrival' is one of the intents; it must "
        'be a name of its own (e.g. "unclassified") so that a fallback is never taken for an answer\n'
    )


def test_errors_about_kafka_values_never_echo_them(tmp_path: Path) -> None:
    path = _toml(tmp_path, f'[kafka]\n"sasl.password" = ["{SECRET}"]\n')
    message = _error(config_file=path, env={})
    assert message.startswith("config error: kafka.sasl.password: expected a string, number or boolean")
    assert SECRET not in message
    with pytest.raises(UserError) as caught:
        settings_from_args(argparse.Namespace(config=None, config_overrides=[f"kafka.sasl.password{SECRET}"]))
    assert str(caught.value) == "config error: --set expects KEY=VALUE, e.g. --set pipeline.max_in_flight=8"


def test_masked_kafka_config_hides_every_kind_of_secret() -> None:
    options = {
        "bootstrap.servers": "b:9092",
        "sasl.password": SECRET,
        "sasl.oauthbearer.client.secret": SECRET,
        "ssl.key.password": SECRET,
        "sasl.oauthbearer.token.endpoint.url": SECRET,
        "sasl.jaas.config": SECRET,
        "sasl.oauthbearer.config": "scope=x",
    }
    masked = masked_kafka_config(options)
    assert SECRET not in str(masked)
    assert masked["bootstrap.servers"] == "b:9092"
    assert masked["sasl.oauthbearer.config"] == "scope=x"


def test_settings_from_args_flags_beat_set_which_beat_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIAGE_PIPELINE__MAX_IN_FLIGHT", "4")
    monkeypatch.setenv("TRIAGE_PIPELINE__DEADLINE_MS", "900")
    parser = argparse.ArgumentParser()
    add_config_argument(parser)
    path = _toml(tmp_path, '[log]\nformat = "json"\n')
    args = parser.parse_args(
        ["--config", str(path), "--set", "pipeline.max_in_flight=6", "--set", "pipeline.deadline_ms=1200"]
    )
    settings = settings_from_args(args, {"pipeline.max_in_flight": 12})
    assert (settings.pipeline.max_in_flight, settings.pipeline.deadline_ms, settings.log.format) == (
        12,
        1200,
        "json",
    )


def test_scheduling_is_earliest_deadline_first_unless_run_is_told_fifo() -> None:
    from worker.cli.cli import build_parser
    from worker.cli.flags import overrides

    assert load_settings(env={}).pipeline.scheduling == "edf"
    args = build_parser().parse_args(["run", "--scheduling", "fifo"])
    assert settings_from_args(args, overrides(args)).pipeline.scheduling == "fifo"
    assert _error(env={}, overrides={"pipeline.scheduling": "lifo"}).startswith(
        'config error: pipeline.scheduling: expected one of "edf", "fifo", got lifo (from command line)'
    )


def test_resume_below_must_stay_under_max_in_flight() -> None:
    with pytest.raises(ValueError, match="resume_below"):
        PipelineSettings(max_in_flight=4, resume_below=4)


def test_config_show_prints_loadable_toml_with_secrets_masked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _toml(tmp_path, f'[kafka]\n"sasl.username" = "svc"\n"sasl.password" = "{SECRET}"\n')
    monkeypatch.setenv("KAFKA_SSL_KEY_PASSWORD", SECRET)
    monkeypatch.setenv("TRIAGE_PIPELINE__MAX_IN_FLIGHT", "9")
    assert (
        main(["config", "show", "--config", str(path), "--set", "inference.provider_options.device_id=0"])
        == 0
    )
    out = capsys.readouterr().out
    assert SECRET not in out
    shown = tomllib.loads(out)
    assert shown["kafka"]["sasl.password"] == "***"
    assert shown["kafka"]["ssl.key.password"] == "***"
    assert shown["kafka"]["sasl.username"] == "svc"
    assert shown["pipeline"]["max_in_flight"] == 9
    assert shown["inference"]["model"] == str(DEFAULT_MODEL_DIR)
    assert shown["inference"]["provider_options"] == {"device_id": "0"}
    assert "# resume_below: not set (half of max_in_flight)" in out
    # What `config show` prints is a config file `--config` accepts back.
    reloaded = load_settings(_toml(tmp_path, out), env={})
    assert reloaded.pipeline.max_in_flight == 9


def test_cli_bad_value_is_one_line_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRIAGE_PIPELINE__MAX_IN_FLIGHT", "0")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", SECRET)
    assert main(["config", "show"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "triage-worker: error: config error: pipeline.max_in_flight: expected int >= 1, got 0 "
        "(from TRIAGE_PIPELINE__MAX_IN_FLIGHT)\n"
    )


# -- input formats and the Schema Registry (docs/schema-registry.md) ---------------------------------------


def test_input_format_and_field_mapping_load_from_file_env_and_flags(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        '[input]\nformat = "avro"\n[input.fields]\nbody = "description"\n'
        '[schema_registry]\nurl = "http://127.0.0.1:8081"\n',
    )
    settings = load_settings(
        path,
        env={"TRIAGE_INPUT__FIELDS__CUSTOMER_ID": "requester.email"},
        overrides={"input.fields.ticket_id": "id"},
    )
    assert settings.input.format == "avro"
    assert settings.input.fields == {
        "body": "description",
        "customer_id": "requester.email",
        "ticket_id": "id",
    }
    assert settings.schema_registry.url == "http://127.0.0.1:8081"
    assert load_settings(env={}).input.format == "json"


def test_a_mapping_for_no_ticket_field_is_refused_naming_it_and_the_fields() -> None:
    message = _error(env={"TRIAGE_INPUT__FIELDS__BODDY": "description"})
    assert message.startswith("config error: input.fields: no ticket field boddy; expected ticket_id, body")


def test_a_registry_format_without_a_registry_is_refused_in_one_line() -> None:
    message = _error(env={"TRIAGE_INPUT__FORMAT": "avro"})
    assert "schema_registry.url: required by input.format = avro (from TRIAGE_INPUT__FORMAT)" in message
    assert "input.format: expected one of" in _error(env={"TRIAGE_INPUT__FORMAT": "xml"})


def test_protobuf_input_needs_an_importable_looking_message_class() -> None:
    registry = {"schema_registry.url": "http://127.0.0.1:8081"}
    assert "needs the message class" in _error(env={}, overrides={**registry, "input.format": "protobuf"})
    assert "expected module:Class, got Ticket" in _error(
        env={}, overrides={**registry, "input.protobuf_message": "Ticket"}
    )


def test_registry_credentials_are_masked_by_config_show_and_in_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("TRIAGE_SCHEMA_REGISTRY__URL", f"https://svc:{SECRET}@registry.example:8081")
    monkeypatch.setenv("TRIAGE_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO", f"svc:{SECRET}")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    shown = tomllib.loads(out)["schema_registry"]
    assert shown == {
        "url": "https://svc:***@registry.example:8081",
        "basic_auth_user_info": "***",
        "timeout_ms": 5000,
    }
    # A malformed credential is refused without echoing it.
    bad = _error(env={"TRIAGE_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO": SECRET})
    assert SECRET not in bad and "schema_registry.basic_auth_user_info" in bad
    bad_url = _error(env={"TRIAGE_SCHEMA_REGISTRY__URL": f"ftp://svc:{SECRET}@host"})
    assert SECRET not in bad_url and "schema_registry.url" in bad_url


def test_avro_output_needs_a_registry_too() -> None:
    assert "schema_registry.url: required by output.format = avro" in _error(
        env={"TRIAGE_OUTPUT__FORMAT": "avro"}
    )
    registry = {"TRIAGE_SCHEMA_REGISTRY__URL": "http://127.0.0.1:8081"}
    assert load_settings(env={**registry, "TRIAGE_OUTPUT__FORMAT": "avro"}).output.format == "avro"
