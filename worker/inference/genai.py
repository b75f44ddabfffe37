"""The ONNX Runtime GenAI module, imported here only, so that a missing build is one clear line.

Its builds (onnxruntime-genai for CPU, -cuda, -directml) install the same `onnxruntime_genai` package, so
the package's extras choose one and none is a plain dependency (pip cannot drop a default dependency when a
GPU extra replaces it). Without a build, whatever needs a model stops with `MISSING_RUNTIME`; commands that
need none (config, schemas, topics, replay) work.
"""

from __future__ import annotations

from typing import Any

from worker.errors import UserError

__all__ = ["MISSING_RUNTIME", "og", "require_runtime"]

MISSING_RUNTIME = (
    "no ONNX Runtime GenAI build is installed; install triage-worker with one: "
    "pip install 'triage-worker[cpu]' (or [cuda] for NVIDIA GPUs, [directml] for GPUs on Windows)"
)


class _MissingRuntime:
    def __getattr__(self, name: str) -> Any:
        raise UserError(MISSING_RUNTIME)


try:
    import onnxruntime_genai as og
except ModuleNotFoundError as error:
    if error.name != "onnxruntime_genai":
        raise
    og = _MissingRuntime()
else:
    # The library's own switch too (0.15+; the DirectML build, 0.12, has none): the environment variable
    # this package sets is what stopped the look-ups, measured (worker/inference/__init__.py).
    if hasattr(og, "disable_telemetry_events"):
        og.disable_telemetry_events()


def require_runtime() -> None:
    """Raise the one-line `MISSING_RUNTIME` error unless a build is importable."""
    if isinstance(og, _MissingRuntime):
        raise UserError(MISSING_RUNTIME)
