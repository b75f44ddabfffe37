"""Model and taxonomy stay a pair: a model folder records the labels it was trained on, and every start
(worker, `classify`, hot reload, shadow) checks the configured taxonomy against that record.

In `score` mode the model can only rank the labels it learned: a label it never saw gets a meaningless
probability, and the answer comes out confidently wrong. So a taxonomy naming labels outside the record stops
the start with one line naming them. In `generate` mode the prompt lists the labels and a new taxonomy is
meaningful (an instruction model follows it), so the mismatch is allowed: it is logged once per process and
every record carries the taxonomy's version (`TriageResult.taxonomy`), so results of a model used outside its
training can be told apart downstream. A folder without the record (a published instruction model) is not
checked: nothing says what it was trained for.

`model train` and `model export` write the record (`TRAINED_LABELS_FILE`) from the taxonomy.toml they ship.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import msgspec
import structlog

from worker.errors import UserError
from worker.inference.taxonomy import Taxonomy
from worker.settings import InferenceSettings

TRAINED_LABELS_FILE = "trained_labels.json"
# Labels named in the refusal line; a whole foreign taxonomy may have dozens.
_NAMED_LABELS = 20

log = structlog.get_logger(__name__)
_warned: set[tuple[str, str]] = set()


class TrainedLabels(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a model folder was trained for: the taxonomy's name, its labels and their fingerprint."""

    taxonomy: str
    fingerprint: str
    labels: tuple[str, ...]


def labels_fingerprint(labels: Iterable[str]) -> str:
    """Order-independent: score mode ranks a set of labels, whatever order the file lists them in."""
    digest = hashlib.sha256("\n".join(sorted(labels)).encode("utf-8")).hexdigest()
    return f"sha256:{digest}"


def taxonomy_version(taxonomy: Taxonomy) -> str:
    """`name@` + the first 12 hex digits of the labels' fingerprint, e.g. ``default@3f09c1d2a4b5``."""
    return f"{taxonomy.name}@{labels_fingerprint(taxonomy.labels).removeprefix('sha256:')[:12]}"


def write_trained_labels(folder: Path, taxonomy: Taxonomy) -> Path:
    """Record in `folder` that its model was trained for `taxonomy`'s labels."""
    record = TrainedLabels(taxonomy.name, labels_fingerprint(taxonomy.labels), taxonomy.labels)
    path = folder / TRAINED_LABELS_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n")
    return path


def read_trained_labels(folder: Path) -> TrainedLabels | None:
    """The folder's record, None when it has none; UserError when it is unreadable or inconsistent."""
    path = folder / TRAINED_LABELS_FILE
    if not path.is_file():
        return None
    try:
        record = msgspec.json.decode(path.read_bytes(), type=TrainedLabels)
    except (OSError, msgspec.DecodeError) as error:
        raise UserError(f"inference.model: cannot read {path}: {error}") from None
    if labels_fingerprint(record.labels) != record.fingerprint:
        raise UserError(f"inference.model: {path}: its fingerprint does not match its labels (hand-edited?)")
    return record


def taxonomy_mark(settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path) -> str | None:
    """None when the model was trained for these labels (or records nothing); otherwise, in `generate`
    mode, the taxonomy version its records carry. In `score` mode a mismatch is a UserError naming the
    labels the model was not trained on."""
    record = read_trained_labels(Path(settings.model).expanduser())
    if record is None or labels_fingerprint(taxonomy.labels) == record.fingerprint:
        return None
    unknown = [label for label in taxonomy.labels if label not in set(record.labels)]
    if not unknown:
        return None  # a subset of what it learned: scoring over fewer labels is still exact
    if settings.mode == "score":
        named = ", ".join(unknown[:_NAMED_LABELS])
        more = f" and {len(unknown) - _NAMED_LABELS} more" if len(unknown) > _NAMED_LABELS else ""
        raise UserError(
            f"inference.taxonomy: {taxonomy_path} has {len(unknown)} label(s) the model {settings.model} was "
            f"not trained on (score mode can only rank the labels of {record.taxonomy!r}): {named}{more}"
        )
    return taxonomy_version(taxonomy)


def warn_once_if_unpaired(settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path) -> None:
    """Log, once per model and taxonomy in this process, that generate mode runs a taxonomy the model was not
    trained for (score mode refuses it in `taxonomy_mark`)."""
    mark = taxonomy_mark(settings, taxonomy, taxonomy_path)
    key = (settings.model, labels_fingerprint(taxonomy.labels))
    if mark is None or key in _warned:
        return
    _warned.add(key)
    log.warning(
        "taxonomy_not_trained_for",
        model=settings.model,
        taxonomy=str(taxonomy_path),
        marked_as=mark,
        note="generate mode follows the prompt's labels; records carry `taxonomy` so they can be told apart",
    )
