"""Every setting declares what a hot reload does with it (worker/settings/reloads.py), and the comparison a
reload acts on: changed keys, secrets masked, the restart-only ones put back at their running values."""

from __future__ import annotations

import msgspec

from worker.settings import Settings, load_settings
from worker.settings.reloads import (
    RELOAD,
    changed_settings,
    declared,
    masked_setting,
    setting_paths,
    with_running,
)


def _leaves(struct: type[msgspec.Struct], prefix: str = "") -> list[str]:
    """Every field of `struct`, walked here on its own (not with `setting_paths`): nested structs are
    entered, anything else is a setting."""
    found = []
    for field in msgspec.structs.fields(struct):
        kind = field.type
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            found += _leaves(kind, f"{prefix}{field.name}.")
        else:
            found.append(f"{prefix}{field.name}")
    return found


def test_every_setting_declares_what_a_reload_does_with_it() -> None:
    """A new field anywhere in `Settings` fails here until `RELOAD` says whether a reload applies it."""
    fields = _leaves(Settings)
    assert len(fields) > 60  # the walk reached into every section
    undeclared = [path for path in fields if path not in RELOAD]
    assert undeclared == [], f"declare these in worker/settings/reloads.py RELOAD: {undeclared}"
    stale = sorted(set(RELOAD) - set(fields))
    assert stale == [], f"RELOAD declares settings that do not exist: {stale}"
    assert list(setting_paths()) == fields


def test_every_setting_that_a_reload_does_not_apply_says_why() -> None:
    for path, declaration in RELOAD.items():
        assert declaration.reload in ("live", "restart", "refused"), path
        if declaration.reload != "live":
            assert declaration.why.strip() and "\n" not in declaration.why, path


def test_privacy_and_redaction_settings_are_never_restart_only() -> None:
    """Applied by a reload, or the reload is refused: never a change that is only named and waits."""
    redaction = [p for p in RELOAD if p.startswith(("privacy.", "dead_letter."))] + ["inference.redact_input"]
    assert {RELOAD[p].reload for p in redaction} <= {"live", "refused"}, {p: RELOAD[p] for p in redaction}


class _Inner(msgspec.Struct, frozen=True):
    depth: int = 0


class _Middle(msgspec.Struct, frozen=True):
    inner: _Inner = msgspec.field(default_factory=_Inner)
    table: dict[str, str] = msgspec.field(default_factory=dict)


class _Outer(msgspec.Struct, frozen=True):
    middle: _Middle = msgspec.field(default_factory=_Middle)
    flag: bool = False


def test_the_walk_goes_through_structs_at_any_depth() -> None:
    assert list(setting_paths(_Outer)) == ["middle.inner.depth", "middle.table", "flag"]


def _loaded(**overrides: object) -> Settings:
    return load_settings(env={}, overrides=overrides)


def test_changes_are_named_per_kafka_option_and_secrets_are_masked() -> None:
    running = _loaded()
    configured = _loaded(
        **{
            "kafka.sasl.password": "hunter2",
            "kafka.client.id": "w-2",
            "pipeline.max_in_flight": 8,
            "schema_registry.url": "http://user:s3cret@registry:8081",
            "schema_registry.basic_auth_user_info": "user:s3cret",
            "inference.provider_options.api_key": "k3y",
        }
    )
    changed = changed_settings(running, configured)
    assert sorted(changed) == [
        "inference.provider_options",
        "kafka.client.id",
        "kafka.sasl.password",
        "pipeline.max_in_flight",
        "schema_registry.basic_auth_user_info",
        "schema_registry.url",
    ]
    assert changed["kafka.sasl.password"] == (None, "hunter2")
    assert changed["pipeline.max_in_flight"] == (64, 8)
    shown = {key: masked_setting(key, after) for key, (_, after) in changed.items()}
    assert shown["kafka.sasl.password"] == "***" and shown["kafka.client.id"] == "w-2"
    assert shown["schema_registry.basic_auth_user_info"] == "***"
    assert shown["schema_registry.url"] == "http://user:***@registry:8081"
    assert shown["inference.provider_options"] == {"api_key": "***"}
    assert "hunter2" not in repr(shown) and "s3cret" not in repr(shown) and "k3y" not in repr(shown)
    assert declared("kafka.sasl.password") == RELOAD["kafka"]
    assert changed_settings(running, _loaded()) == {}


def test_what_a_reload_does_not_apply_keeps_its_running_value() -> None:
    running = _loaded(**{"kafka.client.id": "w-1"})
    changes = {"kafka.client.id": "w-2", "pipeline.max_in_flight": 8, "privacy.keep": "email"}
    configured = _loaded(**changes, **{"log.level": "debug"})
    kept = with_running(configured, running, ["kafka.client.id", "pipeline.max_in_flight", "log.level"])
    assert kept.kafka == running.kafka and kept.pipeline == running.pipeline and kept.log == running.log
    assert kept.privacy.keep == ["email"]
    assert changed_settings(running, kept) == {"privacy.keep": ([], ["email"])}
