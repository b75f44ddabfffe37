"""Defaults as a person reads them, from `Settings` itself: what `--help` and the generated configuration
reference say, so neither can drift from the code."""

from __future__ import annotations

from worker.settings import DEFAULT_MODEL_DIR, Settings, unset_hint

_DEFAULTS = Settings()


def default_of(key: str) -> str:
    """The default of a dotted setting (``pipeline.max_in_flight`` → ``64``); for one that is unset by
    default, what unset means (``pipeline.resume_below`` → ``half of max_in_flight``)."""
    section, _, name = key.partition(".")
    if section == "kafka":
        return _DEFAULTS.kafka.get(name, "unset (librdkafka's default)")
    value = getattr(getattr(_DEFAULTS, section), name)
    if value is None:
        return unset_hint(key)
    if key == "inference.model" and value == str(DEFAULT_MODEL_DIR):
        return f"the embedded model, {DEFAULT_MODEL_DIR.name}"  # not this machine's absolute path
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def with_default(help_text: str, key: str) -> str:
    """`help_text` with the setting's default appended, for a command-line flag's help."""
    return f"{help_text} (default: {default_of(key)})"
