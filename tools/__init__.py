"""The project's own programs around the worker: benchmarks, fuzzing, soak and chaos runs, the test model and
the embedded model's training. Run from the repository root as `python -m tools.<name>` (the Makefile's
targets do); `harness` is the real-broker harness the tests share. Not part of the installed package."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
