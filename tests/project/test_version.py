"""One version: worker/__init__.py's `__version__` is the package's (pyproject.toml reads it at build time),
and `triage-worker --version` prints it. The wheel's side is in tests/project/test_packaging.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version

import worker
from tools import REPO


def test_pyproject_takes_its_version_from_the_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject["project"], "worker/__init__.py has the version"
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "worker.__version__"}


def test_the_cli_prints_the_installed_package_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "worker", "--version"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"triage-worker {worker.__version__}"
    # The venv's metadata is written at install time: after a version change, `make setup` reinstalls once
    # pyproject.toml is newer than the venv's stamp (`touch pyproject.toml`).
    assert version("triage-worker") == worker.__version__, "the venv's package metadata is stale: reinstall"
