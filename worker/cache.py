"""The user cache every command shares: `$XDG_CACHE_HOME/triage-worker` (default `~/.cache/triage-worker`),
where the Kafka jars, the training teacher and large model files resolved with Maven are kept."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "triage-worker"
