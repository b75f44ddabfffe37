"""The command line's way to settings: every command's ``--config FILE`` and ``--set KEY=VALUE``."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path

from worker.errors import UserError
from worker.settings.loading import load_settings
from worker.settings.sections import Settings


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
