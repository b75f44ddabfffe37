"""Build hook (everything else is in pyproject.toml): the wheel carries the embedded model, the cascade's
escalation stage, the taxonomies and the message schemas, which live at the repository root (see
worker/shipped.py for why and how they are found).
"""

import hashlib
import json
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# The same folders and destination as worker/shipped.py (SHIPPED, WHEEL_COPIES); the package cannot be
# imported here, since its dependencies need not be installed at build time.
SHIPPED = ("models/triage-mini", "models/triage-encoder", "deploy/encoder", "taxonomies", "schemas")
DESTINATION = Path("worker", "_shipped")
ENCODER_STAGE = Path("models/triage-encoder")


def check_encoder_present() -> None:
    """The escalation stage's 34 MB encoder is not in git: `make setup` copies it into the stage folder. A
    wheel without it would start every worker without its default cascade."""
    manifest = json.loads((ENCODER_STAGE / "encoder.json").read_text(encoding="utf-8"))
    encoder = ENCODER_STAGE / manifest["encoder"]
    fetch = "run `make setup` or `triage-worker model fetch --into-folder` first"
    if not encoder.is_file():
        raise SystemExit(f"{encoder} is missing (the cascade's encoder, not kept in git): {fetch}")
    if hashlib.sha256(encoder.read_bytes()).hexdigest() != manifest["encoder_sha256"]:
        raise SystemExit(f"{encoder}: its sha256 is not the one encoder.json records: delete it and {fetch}")


class BuildPyWithShippedFiles(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout itself
            return
        for relative in SHIPPED:
            if not Path(relative, ".").is_dir():
                raise SystemExit(f"{relative}/ is missing: build the wheel from a full source checkout")
        check_encoder_present()
        for relative in SHIPPED:
            self.copy_tree(relative, str(Path(self.build_lib, DESTINATION, relative)))


setup(cmdclass={"build_py": BuildPyWithShippedFiles})
