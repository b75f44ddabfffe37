"""Which escalation stage the cascade gets (worker/pipeline/triage/cascade.py).

A configured folder runs as configured (and refuses to start when it cannot), except an encoder stage whose
encoder was never fetched: the worker never fetches it (Maven would be a connection besides the broker and
the registry), so it runs without a cascade and says why (run `triage-worker model fetch`). "auto", the
default, runs:

- the first stage's own encoder stage when its model folder has one (`DIR/encoder/`, what `triage-worker
  model train` writes next to the model it trains): trained for the same taxonomy, with its encoder in the
  folder. It runs when the taxonomy's labels are all among those its head was trained for;
- otherwise the shipped triage-encoder, only where its measured figures hold: the first stage's taxonomy has
  exactly the labels its head was trained and calibrated for, and its encoder file is at hand (the wheel and
  the image carry it; a checkout gets it at `make setup`).

Otherwise the worker runs without a cascade and says why, rather than refusing to start or fetching 34 MB on
a worker's start: `run` logs `cascade_off` with the reason, `classify` prints it on stderr.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from worker.errors import UserError
from worker.inference.encoder import (
    OWN_STAGE_DIR,
    encoder_file,
    encoder_stage_only,
    is_encoder_folder,
    read_manifest,
)
from worker.inference.taxonomy import Taxonomy
from worker.settings import DEFAULT_ESCALATE_BELOW, DEFAULT_ESCALATION_DIR, ESCALATION_AUTO, InferenceSettings
from worker.small_files import read_small_file

# What `model train` records of a folder, its cascade threshold among it (worker/learning/compose.py).
TRAINING_FILE = "training.json"


@dataclass(frozen=True)
class EscalationChoice:
    settings: InferenceSettings | None  # the stage's settings; None: no cascade
    why_off: str | None = None  # why "auto" runs no cascade


def own_stage(first: InferenceSettings) -> Path | None:
    """The encoder stage trained with the first stage's model (`DIR/encoder/`), None when it has none, or
    when that stage is the model itself (a folder written without its first stage: `encoder_stage_only`)."""
    model = Path(first.model).expanduser()
    folder = model / OWN_STAGE_DIR
    if encoder_stage_only(model) is not None:
        return None
    return folder if is_encoder_folder(folder) else None


def escalation_threshold(first: InferenceSettings) -> float:
    """The cascade's threshold: `inference.escalate_below` when set, else the one `model train` chose for
    the model folder (`training.json` `cascade.escalate_below`: 1.0 for a zero-shot or few-shot folder, whose
    first stage is not calibrated), else `DEFAULT_ESCALATE_BELOW`."""
    if first.escalate_below is not None:
        return first.escalate_below
    path = Path(first.model).expanduser() / TRAINING_FILE
    if not path.is_file():
        return DEFAULT_ESCALATE_BELOW
    try:
        chosen = msgspec.json.decode(read_small_file(path, "a model's training record"))["cascade"]
        value = chosen["escalate_below"]
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    except (msgspec.DecodeError, KeyError, TypeError):  # a record without one: written before it existed
        return DEFAULT_ESCALATE_BELOW
    if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise UserError(f"{path}: cascade.escalate_below must be a number from 0 to 1, not {value!r}")
    return float(value)


def check_candidates_llm(stage: InferenceSettings, llm_folder: str) -> None:
    """Refuse, in one line, an `escalation_llm` that cannot decide among `stage`'s candidates: the stage must
    be an encoder stage (the candidates are its top intents) and the LLM an ORT GenAI model folder."""
    if not is_encoder_folder(Path(stage.model).expanduser()):
        raise UserError(
            f"inference.escalation_llm decides among an encoder stage's candidates, but the escalation stage "
            f"{stage.model} is not one (no encoder.json)"
        )
    folder = Path(llm_folder).expanduser()
    if not (folder / "genai_config.json").is_file():
        raise UserError(
            f"inference.escalation_llm: {folder} is not an ORT GenAI model folder (no genai_config.json)"
        )


def choose_escalation(first: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path) -> EscalationChoice:
    """The escalation stage for a first stage of settings `first`, whose taxonomy (as resolved) is
    `taxonomy` from `taxonomy_path`; a UserError when `escalation_llm` cannot decide among its candidates."""
    choice = _chosen_stage(first, taxonomy, taxonomy_path)
    if first.escalation_llm is None:
        return choice
    if choice.settings is None and choice.why_off is None:
        raise UserError("inference.escalation_llm needs the cascade, but inference.escalation is off")
    if choice.settings is not None:
        check_candidates_llm(choice.settings, first.escalation_llm)
    return choice


def _missing_encoder(folder: Path) -> str | None:
    """Why the encoder stage in `folder` cannot run here (its encoder is neither in it nor in the cache);
    None when it can, or when `folder` is no encoder stage (an ORT GenAI folder needs nothing fetched; a
    folder that is neither is refused when its pool opens)."""
    if not is_encoder_folder(folder):
        return None
    try:
        encoder_file(folder, read_manifest(folder))
    except UserError as missing:
        return str(missing)
    return None


def _chosen_stage(first: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path) -> EscalationChoice:
    settings = first.escalation_settings(str(taxonomy_path))
    if settings is None:
        return EscalationChoice(None)
    if first.escalation != ESCALATION_AUTO:
        missing = _missing_encoder(Path(settings.model))
        return EscalationChoice(settings) if missing is None else EscalationChoice(None, missing)
    alone = encoder_stage_only(Path(first.model).expanduser())
    if alone is not None:
        return EscalationChoice(
            None,
            f"{first.model} has no first stage (it was trained without the `train` extra): its encoder stage "
            f"{alone} answers every ticket; pip install 'triage-worker[train]' and train it again for both",
        )
    own = own_stage(first)
    folder = own or DEFAULT_ESCALATION_DIR
    manifest = read_manifest(folder)
    if own is not None:
        unknown = sorted(set(taxonomy.labels) - set(manifest.labels))
        if unknown:
            return EscalationChoice(
                None,
                f"the model's own encoder stage {own} was not trained for {len(unknown)} label(s) of "
                f"taxonomy {taxonomy.name!r} ({', '.join(unknown[:5])}); set inference.escalation to a stage "
                "that was",
            )
        settings = msgspec.structs.replace(settings, model=str(own))
    elif set(manifest.labels) != set(taxonomy.labels):
        return EscalationChoice(
            None,
            f"the shipped {DEFAULT_ESCALATION_DIR.name} knows {len(manifest.labels)} BANKING77 intents, "
            f"not the {len(taxonomy.labels)} of taxonomy {taxonomy.name!r}; set inference.escalation to a "
            "stage trained for it (`triage-worker model train --encoder`)",
        )
    try:
        encoder_file(folder, manifest)
    except UserError as missing:
        return EscalationChoice(None, str(missing))
    return EscalationChoice(settings)
