"""The settings room: one validated `Settings` object, built from defaults < TOML file < environment < command
line, and read by every other room.

- `sections`: one frozen struct per TOML table (`PipelineSettings`, `InferenceSettings`, ...), their
  defaults and cross-field checks, and `Settings`, which holds them all.
- `loading`: `load_settings`, the layered loader; a bad value is one line naming the key, what was expected
  and where it came from.
- `command_line`: every command's ``--config`` and ``--set`` (`add_config_argument`, `settings_from_args`).
- `writing`: `settings_to_toml`, the effective settings as a file `--config` accepts back (`config show`).
- `masking`: which settings and librdkafka options hold secrets, and their values masked.
- `reloads`: what a hot reload does with each setting (`RELOAD`: live, restart or refused, and why), and the
  comparison of the running settings with the configured ones a reload acts on.

Below the assembly point (`worker.app`) a part takes its own section or plain values, never the whole
`Settings` (`tests/project/test_architecture.py` checks it). Imports the shared modules and
`worker.privacy` (the kinds of personal data a section names).
"""

from worker.settings.command_line import add_config_argument, settings_from_args
from worker.settings.loading import load_settings
from worker.settings.masking import mask_secrets, masked_kafka_config
from worker.settings.sections import (
    DEFAULT_ESCALATE_BELOW,
    DEFAULT_ESCALATION_DIR,
    DEFAULT_MODEL_DIR,
    ESCALATION_AUTO,
    ESCALATION_OFF,
    REGISTRY_FORMATS,
    DeadLetterSettings,
    GuaranteeName,
    InferenceMode,
    InferenceSettings,
    InputFormat,
    InputSettings,
    LogSettings,
    MetricsSettings,
    OutputSettings,
    PipelineSettings,
    PoolKind,
    PrivacySettings,
    ReviewSettings,
    Scheduling,
    SchemaRegistrySettings,
    Settings,
    TopicSettings,
    TracingSettings,
    escalation_dir,
)
from worker.settings.writing import settings_to_toml, unset_hint

__all__ = [
    "DEFAULT_ESCALATE_BELOW",
    "DEFAULT_ESCALATION_DIR",
    "DEFAULT_MODEL_DIR",
    "ESCALATION_AUTO",
    "ESCALATION_OFF",
    "REGISTRY_FORMATS",
    "DeadLetterSettings",
    "GuaranteeName",
    "InferenceMode",
    "InferenceSettings",
    "InputFormat",
    "InputSettings",
    "LogSettings",
    "MetricsSettings",
    "OutputSettings",
    "PipelineSettings",
    "PoolKind",
    "PrivacySettings",
    "ReviewSettings",
    "Scheduling",
    "SchemaRegistrySettings",
    "Settings",
    "TopicSettings",
    "TracingSettings",
    "add_config_argument",
    "escalation_dir",
    "load_settings",
    "mask_secrets",
    "masked_kafka_config",
    "settings_from_args",
    "settings_to_toml",
    "unset_hint",
]
