"""Build hook (everything else is in pyproject.toml): the wheel carries the embedded model, the taxonomies and
the message schemas, which live at the repository root (see worker/shipped.py for why and how they are found).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# The same folders and destination as worker/shipped.py (SHIPPED, WHEEL_COPIES); the package cannot be
# imported here, since its dependencies need not be installed at build time.
SHIPPED = ("models/triage-mini", "taxonomies", "schemas")
DESTINATION = Path("worker", "_shipped")


class BuildPyWithShippedFiles(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout itself
            return
        for relative in SHIPPED:
            if not Path(relative, ".").is_dir():
                raise SystemExit(f"{relative}/ is missing: build the wheel from a full source checkout")
            self.copy_tree(relative, str(Path(self.build_lib, DESTINATION, relative)))


setup(cmdclass={"build_py": BuildPyWithShippedFiles})
