"""Learn from reviewers' corrections in minutes: fine-tune the intent rows of a model's output layer.

`triage-worker model train --feedback-topic T` (or `--feedback FILE`) starts from the current model and
changes only what decides an intent in `score` mode: the output layer's rows of the intent tokens (one token
per intent in the project's models). Everything below them, and so the ticket representation the model has
learnt, stays as it is; that is what keeps it minutes instead of the full rebuild's hour, and needs nothing
beyond the runtime dependencies (no torch).

1. Features: each ticket's hidden state where `score` mode reads the intent. ORT GenAI gives the logits
   there, not the hidden state; the output layer is linear (no bias), so the hidden state is its
   least-squares solution, exact to float rounding (checked for every ticket: a model whose output layer
   does not explain its logits is refused).
2. Fit: the intent rows are trained, from their current values, on the corrections mixed with the original
   training data (so the model does not forget the other intents), with an L2 pull towards the current
   rows: mean cross-entropy over the original tickets + mean over the corrections + `l2` * ||W - W0||^2.
3. Write: the base folder is copied into a new folder beside `--out` and the new rows are written into its
   weights, quantised the way the ORT GenAI builder quantises them (int4 blocks of 32, symmetric) or as they
   are (fp32).
4. Measure with the written model (ORT GenAI, as the worker runs it): accuracy on the BANKING77 test split
   (tickets used as corrections left out) and on a held-out part of the feedback, before and after; the
   model card (README.md) and training.json say what was done and what it gave. Then the new folder
   replaces `--out` whole (worker/learning/folders.py: only a folder model train wrote, never a shipped one).
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worker.errors import UserError
from worker.inference.engine import GenAIEngine
from worker.inference.loading import resolve_taxonomy
from worker.learning.feedback import Correction
from worker.learning.folders import writing
from worker.settings import InferenceSettings

FloatArray = npt.NDArray[np.float64]
Example = tuple[str, str]  # (text, intent)

_Q4_WEIGHT = "lm_head.MatMul.weight_Q4"
_Q4_SCALES = "lm_head.MatMul.weight_scales"
_Q4_ZERO_POINTS = "lm_head.MatMul.weight_zp"
_FP32_WEIGHT = "lm_head.MatMul.weight"
_FLOAT, _UINT8 = 1, 2  # ONNX TensorProto data types
# A hidden state must reproduce its logits this closely (relative): the output layer is what we think it is.
_MAX_RELATIVE_RESIDUAL = 1e-4


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the fine-tuned rows (recorded in training.json)."""

    seed: int = 77
    holdout: float = 0.25  # share of the corrections kept out of training, to measure on
    # Original training tickets per intent mixed in (0: all of them). 40 of BANKING77's ~130 kept the test
    # accuracy as well as all of them did in the measured example, in a third of the time.
    replay_per_intent: int = 40
    steps: int = 300
    learning_rate: float = 0.003
    l2: float = 0.01


# -- reading and writing the output layer -------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    dims: tuple[int, ...]
    data_type: int
    location: str | None
    offset: int
    length: int


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as int, everything else as bytes."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at : at + size], at + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, at = data[at : at + width], at + width
        else:
            raise ValueError(f"protobuf wire type {wire} not supported")
        yield number, value


def _initializers(model_file: Path) -> dict[str, _Tensor]:
    """The initializers of an ONNX file whose data lives in an external file (ModelProto.graph = 7,
    GraphProto.initializer = 5; TensorProto dims = 1, data_type = 2, name = 8, external_data = 13)."""
    tensors = {}
    for number, graph in _fields(model_file.read_bytes()):
        if number != 7 or not isinstance(graph, bytes):
            continue
        for field_number, tensor in _fields(graph):
            if field_number != 5 or not isinstance(tensor, bytes):
                continue
            dims: list[int] = []
            name, data_type, external = "", 0, {}
            for key, value in _fields(tensor):
                if key == 1:
                    dims += [value] if isinstance(value, int) else _packed(value)
                elif key == 2 and isinstance(value, int):
                    data_type = value
                elif key == 8 and isinstance(value, bytes):
                    name = value.decode()
                elif key == 13 and isinstance(value, bytes):
                    entry = dict(_fields(value))
                    external[bytes(entry.get(1, b"")).decode()] = bytes(entry.get(2, b"")).decode()
            tensors[name] = _Tensor(
                name,
                tuple(dims),
                data_type,
                external.get("location"),
                int(external.get("offset", 0)),
                int(external.get("length", 0)),
            )
    return tensors


def _packed(data: bytes) -> list[int]:
    values, at = [], 0
    while at < len(data):
        value, at = _varint(data, at)
        values.append(value)
    return values


class OutputLayer:
    """The output projection (`lm_head`) of a folder built by the ORT GenAI builder: int4 (MatMulNBits,
    symmetric blocks) or fp32 (MatMul), its weights in the external data file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        model_file = folder / "model.onnx"
        if not model_file.is_file():
            raise UserError(f"{folder}: no model.onnx (fine-tuning needs a folder of the ORT GenAI builder)")
        tensors = _initializers(model_file)
        self._tensors = tensors
        if _Q4_WEIGHT in tensors and _Q4_SCALES in tensors and _Q4_ZERO_POINTS not in tensors:
            blob = tensors[_Q4_WEIGHT].dims[-1]
            self.kind, self.block = "int4", blob * 2
            self.weights = self._dequantize(
                self._read(_Q4_WEIGHT, np.uint8), self._read(_Q4_SCALES, np.float32)
            )
        elif _FP32_WEIGHT in tensors and tensors[_FP32_WEIGHT].data_type == _FLOAT:
            self.kind, self.block = "fp32", 0
            self.weights = self._read(_FP32_WEIGHT, np.float32).reshape(tensors[_FP32_WEIGHT].dims).T
        else:
            raise UserError(
                f"{folder}: fine-tuning supports output layers the ORT GenAI builder writes in int4 "
                "(symmetric) or fp32; this model's is neither"
            )
        self.weights = self.weights.astype(np.float64)

    @functools.cached_property
    def _pseudo_inverse(self) -> FloatArray:
        """Computed once, and only by a featurizer that needs hidden states (an SVD of the whole layer)."""
        return np.linalg.pinv(self.weights).astype(np.float64)

    def _read(self, name: str, dtype: type[np.generic]) -> npt.NDArray[Any]:
        tensor = self._tensors[name]
        if tensor.location is None:
            raise UserError(f"{self.folder}: {name} is not in an external data file")
        with open(self.folder / tensor.location, "rb") as handle:
            handle.seek(tensor.offset)
            data = handle.read(tensor.length)
        return np.frombuffer(data, dtype=dtype).reshape(tensor.dims).copy()

    def _dequantize(self, packed: npt.NDArray[Any], scales: npt.NDArray[Any]) -> FloatArray:
        rows, blocks, _ = packed.shape
        low = (packed & 0x0F).astype(np.int8) - 8
        high = (packed >> 4).astype(np.int8) - 8
        values = np.stack([low, high], axis=-1).reshape(rows, blocks, self.block)
        weights: FloatArray = (values * scales.reshape(rows, blocks)[:, :, None]).reshape(rows, -1)
        return weights

    def hidden(self, logits: FloatArray) -> FloatArray:
        """The hidden state that gives `logits`; raises when it does not reproduce them."""
        state: FloatArray = self._pseudo_inverse @ logits
        residual = np.abs(self.weights @ state - logits).max()
        if residual > _MAX_RELATIVE_RESIDUAL * max(1.0, float(np.abs(logits).max())):
            raise UserError(
                f"{self.folder}: the output layer does not reproduce the model's logits "
                f"(residual {residual:.3g})"
            )
        return state

    def write_rows(self, folder: Path, token_ids: Sequence[int], rows: FloatArray) -> None:
        """Write `rows` as the weights of `token_ids` into the copy of this model in `folder`."""
        if self.kind == "int4":
            packed, scales = _quantize_int4(rows, self.block)
            self._patch(folder, _Q4_WEIGHT, token_ids, packed)
            self._patch(folder, _Q4_SCALES, token_ids, scales)
        else:
            full = self._read(_FP32_WEIGHT, np.float32).reshape(self._tensors[_FP32_WEIGHT].dims)
            full[:, list(token_ids)] = rows.T.astype(np.float32)
            self._patch(folder, _FP32_WEIGHT, range(full.shape[0]), full)

    def _patch(self, folder: Path, name: str, row_ids: Sequence[int], values: npt.NDArray[Any]) -> None:
        tensor = self._tensors[name]
        row_bytes = tensor.length // tensor.dims[0]
        assert tensor.location is not None
        with open(folder / tensor.location, "r+b") as handle:
            for row, value in zip(row_ids, values, strict=True):
                handle.seek(tensor.offset + row * row_bytes)
                handle.write(np.ascontiguousarray(value).tobytes())


def _quantize_int4(rows: FloatArray, block: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Symmetric int4 blocks as ORT's quantiser makes them: the largest magnitude of a block maps to -8
    (its scale carries the sign), the rest round to the nearest step in [-8, 7]."""
    count, width = rows.shape
    blocks = rows.reshape(count, width // block, block)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scales = (extreme / -8.0).astype(np.float32)
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    quantized = (np.clip(np.rint(blocks / safe), -8, 7) + 8).astype(np.uint8)
    packed = quantized[..., 0::2] | (quantized[..., 1::2] << 4)
    return packed.astype(np.uint8), scales


# -- features and the fit ---------------------------------------------------------------------------------


class Featurizer:
    """Hidden states and label decisions of one model folder, computed with ORT GenAI as the worker does."""

    def __init__(self, folder: Path, threads: int = 1) -> None:
        settings = InferenceSettings(model=str(folder), mode="score", intra_op_num_threads=threads)
        self.engine = GenAIEngine(settings, *resolve_taxonomy(settings))
        if any(len(ids) != 1 for ids in self.engine.label_ids):
            raise UserError(f"{folder}: fine-tuning needs one token per intent, as the project's models have")
        self.label_ids = [ids[0] for ids in self.engine.label_ids]
        self.labels = list(self.engine.labels)
        self.layer = OutputLayer(folder)
        self._context = self.engine.new_context("score")

    def run(
        self, texts: Sequence[str], progress: Callable[[int, int], None] | None = None
    ) -> tuple[FloatArray, list[str]]:
        """(hidden states, intents the model decides) for `texts`."""
        states: list[FloatArray] = []
        decided = self._score(texts, progress, states)
        return np.array(states).reshape(len(texts), self.layer.weights.shape[1]), decided

    def decide(self, texts: Sequence[str], progress: Callable[[int, int], None] | None = None) -> list[str]:
        """The intents the model decides for `texts` (no hidden states: only measuring)."""
        return self._score(texts, progress, None)

    def _score(
        self,
        texts: Sequence[str],
        progress: Callable[[int, int], None] | None,
        states: list[FloatArray] | None,
    ) -> list[str]:
        decided = []
        for done, text in enumerate(texts, 1):
            logits = self._context.answer_logits(text)
            if states is not None:
                states.append(self.layer.hidden(logits))
            decided.append(self.labels[int(np.argmax(logits[self.label_ids]))])
            if progress is not None:
                progress(done, len(texts))
        return decided


def fit_rows(
    start: FloatArray,
    original: tuple[FloatArray, npt.NDArray[np.int64]],
    corrections: tuple[FloatArray, npt.NDArray[np.int64]],
    recipe: Recipe,
) -> FloatArray:
    """Intent rows minimising mean cross-entropy on the original tickets + mean on the corrections +
    `l2` * ||W - start||^2, from `start`, with full-batch Adam."""
    rows = start.copy()
    moment, velocity = np.zeros_like(rows), np.zeros_like(rows)
    parts = [part for part in (original, corrections) if len(part[1])]
    for step in range(1, recipe.steps + 1):
        gradient = 2.0 * recipe.l2 * (rows - start)
        for states, labels in parts:
            logits = states @ rows.T
            logits -= logits.max(axis=1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=1, keepdims=True)
            probs[np.arange(len(labels)), labels] -= 1.0
            gradient += probs.T @ states / len(labels)
        moment = 0.9 * moment + 0.1 * gradient
        velocity = 0.999 * velocity + 0.001 * gradient**2
        rows -= (
            recipe.learning_rate * (moment / (1 - 0.9**step)) / (np.sqrt(velocity / (1 - 0.999**step)) + 1e-8)
        )
    return rows


def split_holdout(
    corrections: Sequence[Correction], share: float, seed: int
) -> tuple[list[Correction], list[Correction]]:
    """(to train on, held out): `share` of each corrected intent held out (none from an intent with one)."""
    by_intent: dict[str, list[Correction]] = defaultdict(list)
    for correction in corrections:
        by_intent[correction.intent].append(correction)
    rng = random.Random(seed)
    train, held = [], []
    for intent in sorted(by_intent):
        group = by_intent[intent]
        rng.shuffle(group)
        cut = round(len(group) * share) if len(group) > 1 else 0
        held += group[:cut]
        train += group[cut:]
    return train, held


def replay_sample(examples: Sequence[Example], per_intent: int, seed: int) -> list[Example]:
    """`per_intent` original tickets of each intent (all of them for 0)."""
    if per_intent <= 0:
        return list(examples)
    by_intent: dict[str, list[Example]] = defaultdict(list)
    for example in examples:
        by_intent[example[1]].append(example)
    rng = random.Random(seed)
    return [
        e
        for intent in sorted(by_intent)
        for e in rng.sample(by_intent[intent], min(per_intent, len(by_intent[intent])))
    ]


def _accuracy(decided: Sequence[str], expected: Sequence[str]) -> float | None:
    return sum(d == e for d, e in zip(decided, expected, strict=True)) / len(expected) if expected else None


@dataclass
class FineTuneOutcome:
    """What a fine-tune did and measured (the model card's figures)."""

    corrections: int
    trained_on: int
    held_out: int
    replayed: int
    test_tickets: int
    test_accuracy: tuple[float | None, float | None]
    held_out_accuracy: tuple[float | None, float | None]
    trained_accuracy: tuple[float | None, float | None]
    minutes: float


def fine_tune(
    base: Path,
    out: Path,
    corrections: Sequence[Correction],
    original: Sequence[Example],
    test: Sequence[Example],
    recipe: Recipe,
    say: Callable[[str], None],
    command: str = "",
) -> FineTuneOutcome:
    """Fine-tune `base` on `corrections` mixed with `original` tickets, write it to `out`, measure both on
    `test` and the held-out corrections."""
    started = time.monotonic()
    if not corrections:
        raise UserError("no usable corrections: nothing to fine-tune on")
    if out.resolve().is_relative_to(base.resolve()):
        raise UserError(f"--out {out} is in the base model's folder: write the fine-tuned model elsewhere")
    featurizer = Featurizer(base)
    unknown = sorted({intent for _, intent in original} - set(featurizer.labels))
    if unknown:
        raise UserError(f"training data has intents the model does not know: {', '.join(unknown[:5])}")
    trained, held = split_holdout(corrections, recipe.holdout, recipe.seed)
    replayed = replay_sample(original, recipe.replay_per_intent, recipe.seed)
    corrected_texts = {c.text for c in trained}
    test = [example for example in test if example[0] not in corrected_texts]
    index = {label: i for i, label in enumerate(featurizer.labels)}

    def progress(what: str) -> Callable[[int, int], None]:
        last = [time.monotonic()]

        def show(done: int, total: int) -> None:
            if done == total or time.monotonic() - last[0] >= 5.0:
                last[0] = time.monotonic()
                say(f"{what}: {done}/{total} tickets")

        return show

    replay_states, _ = featurizer.run([t for t, _ in replayed], progress("original tickets"))
    trained_states, trained_before = featurizer.run([c.text for c in trained], progress("corrections"))
    held_before = featurizer.decide([c.text for c in held], progress("held-out corrections"))
    test_before = featurizer.decide([t for t, _ in test], progress("test tickets"))
    start = featurizer.layer.weights[featurizer.label_ids]
    rows = fit_rows(
        start,
        (replay_states, np.array([index[i] for _, i in replayed], dtype=np.int64)),
        (trained_states, np.array([index[c.intent] for c in trained], dtype=np.int64)),
        recipe,
    )
    with writing(out) as building:
        shutil.copytree(base, building, dirs_exist_ok=True)
        (building / "VERSION").unlink(missing_ok=True)
        featurizer.layer.write_rows(building, featurizer.label_ids, rows)
        say(f"wrote the fine-tuned rows into a new folder beside {out}; measuring it")
        tuned = Featurizer(building)
        held_after = tuned.decide([c.text for c in held])
        trained_after = tuned.decide([c.text for c in trained])
        test_after = tuned.decide([t for t, _ in test], progress("test tickets (fine-tuned)"))
        expected_test = [i for _, i in test]
        outcome = FineTuneOutcome(
            corrections=len(corrections),
            trained_on=len(trained),
            held_out=len(held),
            replayed=len(replayed),
            test_tickets=len(test),
            test_accuracy=(_accuracy(test_before, expected_test), _accuracy(test_after, expected_test)),
            held_out_accuracy=(
                _accuracy(held_before, [c.intent for c in held]),
                _accuracy(held_after, [c.intent for c in held]),
            ),
            trained_accuracy=(
                _accuracy(trained_before, [c.intent for c in trained]),
                _accuracy(trained_after, [c.intent for c in trained]),
            ),
            minutes=round((time.monotonic() - started) / 60.0, 2),
        )
        _write_card(base, building, out.name, corrections, recipe, outcome, command)
    return outcome


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f} %"


def _write_card(
    base: Path,
    out: Path,
    name: str,
    corrections: Sequence[Correction],
    recipe: Recipe,
    outcome: FineTuneOutcome,
    command: str,
) -> None:
    pairs: dict[str, int] = defaultdict(int)
    for correction in corrections:
        pairs[f"{correction.model_intent or '?'} -> {correction.intent}"] += 1
    by_pair = dict(sorted(pairs.items(), key=lambda item: -item[1]))
    base_training = base / "training.json"
    summary = {
        "fine_tuned_from": str(base),
        "method": "intent rows of the output layer, warm-started, corrections mixed with original tickets",
        "recipe": asdict(recipe),
        "outcome": asdict(outcome),
        "corrections_by_pair": by_pair,
        "command": command,
        "base_training": json.loads(base_training.read_text(encoding="utf-8"))
        if base_training.is_file()
        else None,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    rows = [
        ("BANKING77 test", outcome.test_tickets, outcome.test_accuracy),
        ("held-out feedback", outcome.held_out, outcome.held_out_accuracy),
        ("feedback trained on", outcome.trained_on, outcome.trained_accuracy),
    ]
    table = "\n".join(
        f"| {name} | {count} | {_percent(before)} | {_percent(after)} |"
        for name, count, (before, after) in rows
    )
    top = "\n".join(f"- {pair}: {count}" for pair, count in list(by_pair.items())[:10])
    card = (
        f"# {name}\n\n"
        f"Fine-tuned from `{base.name}` on {outcome.corrections} reviewers' corrections "
        f"({outcome.trained_on} trained on, {outcome.held_out} held out to measure), mixed with "
        f"{outcome.replayed} of its original training tickets, in {outcome.minutes} min. Only the output "
        "layer's intent rows changed (`triage-worker model train --feedback`, worker/learning/fine_tune.py); "
        "training.json has the recipe and the base model's own training record.\n\n"
        f"| tickets | count | before | after |\n|---|---|---|---|\n{table}\n\n"
        "BANKING77 test leaves out any ticket used as a correction. Corrections (model's intent -> "
        f"reviewer's):\n\n{top}\n\nCommand: `{command}`\n"
    )
    (out / "README.md").write_text(card, encoding="utf-8")


def outcome_lines(outcome: FineTuneOutcome) -> list[str]:
    return [
        f"BANKING77 test ({outcome.test_tickets}): {_percent(outcome.test_accuracy[0])} -> "
        f"{_percent(outcome.test_accuracy[1])}",
        f"held-out feedback ({outcome.held_out}): {_percent(outcome.held_out_accuracy[0])} -> "
        f"{_percent(outcome.held_out_accuracy[1])}",
        f"feedback trained on ({outcome.trained_on}): {_percent(outcome.trained_accuracy[0])} -> "
        f"{_percent(outcome.trained_accuracy[1])}",
        f"took {outcome.minutes} min",
    ]
