"""Files the package reads besides its code, found alike in a source checkout and in an installed wheel.

The embedded model (``models/triage-mini``), the taxonomies and the message schemas live at the repository
root, where `make model` and `triage-worker schemas --write` update them and a checkout (or an editable
install) reads them. A wheel has no repository around it, so the build copies them into ``worker/_shipped``
(see setup.py). Tools that only make sense in a checkout (the local broker's pom, the training script and
data) are found with `checkout_file`, which says so in one line when there is none.
"""

from __future__ import annotations

from pathlib import Path

from worker.errors import UserError

PACKAGE_DIR = Path(__file__).resolve().parent
# The repository root when the package runs from a source checkout; site-packages when installed.
SOURCE_ROOT = PACKAGE_DIR.parent
# Where setup.py puts the copies in a wheel; the folder name it uses too.
WHEEL_COPIES = PACKAGE_DIR / "_shipped"
SHIPPED = ("models/triage-mini", "taxonomies", "schemas")


def shipped_path(relative: str) -> Path:
    """`relative` (under one of `SHIPPED`) in the installed wheel's copies, else in the source checkout."""
    copy = WHEEL_COPIES / relative
    return copy if copy.exists() else SOURCE_ROOT / relative


def is_source_checkout() -> bool:
    return (SOURCE_ROOT / "pyproject.toml").is_file() and (SOURCE_ROOT / "worker" / "shipped.py").is_file()


def checkout_file(relative: str, needed_for: str, instead: str | None = None) -> Path:
    """A file that exists only in a source checkout (poms, training script), or a one-line UserError saying
    that `needed_for` runs only there (and what to do `instead`)."""
    path = SOURCE_ROOT / relative
    if not path.exists():
        alternative = f"; instead, {instead}" if instead else ""
        raise UserError(
            f"{needed_for} runs only from a source checkout of triage-worker ({relative} is not part of the "
            f"installed package){alternative}"
        )
    return path
