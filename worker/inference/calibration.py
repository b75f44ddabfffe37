"""A model folder's fitted temperatures (`calibration.json`): a published model's confidence made honest.

A model trained by this project folds its temperature into its weights. A published instruction model was
never calibrated for a team's labels: on 100 BANKING77 tickets SmolLM2-135M-Instruct's generate-mode
confidence averaged 0.30 where it was right 10 % of the time. `triage-worker model calibrate` fits one
temperature per mode on labelled tickets (worker/learning/calibration.py) and records it here with the
fingerprint of the taxonomy's labels it was fitted for; the engine divides the labels' logits by it. A
temperature fitted for other labels means nothing for these, so it is then left unused, and said so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import structlog

from worker.errors import UserError
from worker.inference.pairing import labels_fingerprint
from worker.inference.taxonomy import Taxonomy
from worker.small_files import read_small_file

log = structlog.get_logger(__name__)

CALIBRATION_FILE = "calibration.json"
Mode = Literal["score", "generate"]


class ModeCalibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One mode's temperature and the figures it was chosen on (the same tickets: in-sample)."""

    temperature: Annotated[float, msgspec.Meta(gt=0.0)]
    tickets: int
    accuracy: float
    ece_before: float
    ece_after: float


class Calibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    taxonomy: str
    fingerprint: str
    modes: dict[Mode, ModeCalibration]


def read_calibration(folder: Path) -> Calibration | None:
    path = folder / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(read_small_file(path, "a model's calibration"), type=Calibration)
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    except msgspec.DecodeError as error:
        raise UserError(f"{path}: {error}") from None


def temperatures(folder: Path, taxonomy: Taxonomy) -> dict[Mode, float]:
    """The temperature of each mode for `taxonomy` (1.0 where none was fitted for its labels)."""
    record = read_calibration(folder)
    if record is None:
        return {"score": 1.0, "generate": 1.0}
    if record.fingerprint != labels_fingerprint(taxonomy.labels):
        log.warning(
            "calibration fitted for other labels left unused",
            model=folder.name,
            fitted_for=record.taxonomy,
            taxonomy=taxonomy.name,
        )
        return {"score": 1.0, "generate": 1.0}
    fitted = {mode: calibration.temperature for mode, calibration in record.modes.items()}
    return {"score": fitted.get("score", 1.0), "generate": fitted.get("generate", 1.0)}


def write_calibration(folder: Path, taxonomy: Taxonomy, modes: dict[Mode, ModeCalibration]) -> Path:
    """Record `modes` for `taxonomy`, keeping a mode fitted before for the same labels and not refitted."""
    fingerprint = labels_fingerprint(taxonomy.labels)
    before = read_calibration(folder)
    kept = dict(before.modes) if before is not None and before.fingerprint == fingerprint else {}
    record = Calibration(taxonomy.name, fingerprint, {**kept, **modes})
    path = folder / CALIBRATION_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n")
    return path
