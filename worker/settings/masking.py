"""Secrets in the settings: which ones are, and their values masked wherever settings or a client's words are
shown (`config show`, logs, error lines)."""

from __future__ import annotations

import re
from collections.abc import Mapping

SECRET_MARKERS = ("password", "secret", "key", "token", "jaas", "credentials")
MASK = "***"
# Settings (outside the kafka pass-through) that hold a credential: masked wherever settings are shown.
SECRET_SETTINGS = frozenset({"schema_registry.basic_auth_user_info"})

# The password of `scheme://user:password@host`.
URL_PASSWORD = re.compile(r"^(\w+://[^/@:]*:)[^/@]*@")


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


def masked_url(url: str) -> str:
    """`url` with a password written into it (http://user:password@host) replaced by ``***``."""
    return URL_PASSWORD.sub(rf"\1{MASK}@", url)
