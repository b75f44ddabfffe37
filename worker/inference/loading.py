"""Open an ORT GenAI model folder on the configured provider, and find the taxonomy that goes with it.

Any folder the ORT GenAI builder produces works (genai_config.json + ONNX + tokenizer files with a chat
template): the project's own models or a published one such as Phi-4-mini-instruct's ONNX int4 folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from worker.errors import UserError
from worker.inference.genai import og, require_runtime
from worker.inference.pairing import taxonomy_mark
from worker.inference.taxonomy import Taxonomy, load_taxonomy
from worker.settings import InferenceSettings, PrivacySettings, ReviewSettings
from worker.shipped import shipped_path

DEFAULT_TAXONOMY = shipped_path("taxonomies/default.toml")

# ORT GenAI's name of each provider, and the package that brings its runtime.
_PROVIDERS = {"cpu": None, "cuda": "cuda", "dml": "dml"}
_PACKAGES = {"cuda": ("onnxruntime-genai-cuda", "cuda"), "dml": ("onnxruntime-genai-directml", "directml")}


def model_dir(settings: InferenceSettings) -> Path:
    """The model folder, checked to be an ORT GenAI folder (a clear error beats ORT's own)."""
    folder = Path(settings.model).expanduser()
    if not (folder / "genai_config.json").is_file():
        raise UserError(
            f"inference.model: {folder} is not an ORT GenAI model folder (no genai_config.json); build one "
            "with `triage-worker model export` or download one"
        )
    return folder


# A model folder's VERSION for a model trained from its taxonomy alone (`model train --zero-shot`): its
# records then say `model: <folder>@zero-shot`, and `run` sends its results to review unless told otherwise.
ZERO_SHOT_VERSION = "zero-shot"


def is_zero_shot(folder: Path) -> bool:
    return model_id(folder).endswith(f"@{ZERO_SHOT_VERSION}")


def model_id(folder: Path) -> str:
    """The id written into every record: the folder name, plus its version file when it has one."""
    version = folder / "VERSION"
    suffix = f"@{version.read_text(encoding='utf-8').strip()}" if version.is_file() else ""
    return folder.name + suffix


def resolve_taxonomy(settings: InferenceSettings) -> tuple[Taxonomy, Path]:
    """The configured taxonomy, else the model's own `taxonomy.toml`, else the shipped default; in score mode
    a UserError when the model was not trained for its labels (see worker/inference/pairing.py)."""
    taxonomy, path = _find_taxonomy(settings)
    taxonomy_mark(settings, taxonomy, path)
    return taxonomy, path


def _find_taxonomy(settings: InferenceSettings) -> tuple[Taxonomy, Path]:
    if settings.taxonomy is not None:
        path = Path(settings.taxonomy).expanduser()
    elif (Path(settings.model) / "taxonomy.toml").is_file():
        path = Path(settings.model) / "taxonomy.toml"
    elif DEFAULT_TAXONOMY.is_file():
        path = DEFAULT_TAXONOMY
    else:
        raise UserError("inference.taxonomy: the model folder has no taxonomy.toml; set inference.taxonomy")
    return load_taxonomy(path), path


def load_model(settings: InferenceSettings, sliding_window_slack: int = 0) -> og.Model:
    """Create the og.Model on the configured provider with its options and intra-op thread count (and, for a
    model with sliding-window attention, the cache slack the engine needs: see engine.py `_cache_length`).

    Thread count is set explicitly because ORT's default was measured to be effectively single-threaded
    here; with several worker processes, 1 thread each (the default) avoids oversubscribing the cores.
    """
    require_runtime()
    folder = model_dir(settings)
    config = og.Config(str(folder))
    config.clear_providers()
    provider = _PROVIDERS[settings.provider]
    if provider is not None:
        config.append_provider(provider)
        for key, value in settings.provider_options.items():
            config.set_provider_option(provider, key, value)
    decoder: dict[str, Any] = {"session_options": {"intra_op_num_threads": settings.intra_op_num_threads}}
    if sliding_window_slack:  # the whole object: an overlay replaces it rather than merging into it
        written = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
        window = written["model"]["decoder"]["sliding_window"]
        decoder["sliding_window"] = {**window, "cache_slack": sliding_window_slack}
    overlay = {"model": {"decoder": decoder}}
    config.overlay(json.dumps(overlay))
    try:
        return og.Model(config)
    except Exception as error:  # ORT GenAI raises plain RuntimeError for everything
        raise _provider_error(settings, error) from None


def _provider_error(settings: InferenceSettings, error: Exception) -> UserError:
    message = str(error)
    if settings.provider in _PACKAGES and (
        any(
            marker in message.lower()
            for marker in (
                "interface not available",  # 0.18
                "failed to load library",
                "not been built with",
                "not enabled in this build",  # 0.12 (the DirectML extra's version)
            )
        )
    ):
        package, extra = _PACKAGES[settings.provider]
        return UserError(
            f"inference.provider={settings.provider} needs the {package} package "
            f"(pip install 'triage-worker[{extra}]'): {message.splitlines()[0]}"
        )
    return UserError(f"cannot load model {settings.model} on {settings.provider}: {message.splitlines()[0]}")


# A zero-shot model guesses from its taxonomy alone: unless review is configured, every result it classifies
# goes to review, so that reviewers' verdicts become the tickets its few-shot successor learns from.
ZERO_SHOT_REVIEW_THRESHOLD = 1.0


def zero_shot_review(review: ReviewSettings, privacy: PrivacySettings, model: str) -> ReviewSettings:
    """`review` on for a zero-shot `model` folder (`review.threshold` 1.0) when no threshold is set: what
    `run` serves and what `topics create` makes topics for (the review and feedback topics). UserError when
    `privacy.detect` is `[]`: the review topic promises redacted text, as where review is configured
    (`worker.settings`'s check at load)."""
    if review.threshold is not None or not is_zero_shot(Path(model).expanduser()):
        return review
    if not privacy.detect:
        raise UserError(
            "config error: privacy.detect: [] detects nothing, so the review topic a zero-shot model turns "
            f"on (review.threshold = {ZERO_SHOT_REVIEW_THRESHOLD}) would hold tickets in clear: name the "
            "kinds to detect (privacy.keep leaves them in clear there)"
        )
    return msgspec.structs.replace(review, threshold=ZERO_SHOT_REVIEW_THRESHOLD)
