"""Fit a model folder's temperatures on labelled tickets (`triage-worker model calibrate`).

One temperature per mode (one parameter; the answer does not move): the temperature of `TEMPERATURES` whose
confidences have the least squared error against being right (the Brier score of the reported confidence),
because that number is what routers, the review threshold and the cascade read. The negative log-likelihood
of the true labels, the textbook choice, was tried first: a published model's few very wrong answers dominate
it, and for SmolLM2-135M in score mode it chose T = 8.9, whose confidences averaged 0.05 where the model was
right 24 % of the time (ECE 0.19 on 100 test tickets).

- `score`: the renormalised label distribution at temperature 1, rescaled (softmax of log-probabilities / T).
- `generate`: the decisions of the greedy walk down the label trie (worker/inference/answer_trie.py), each
  renormalised over its allowed tokens at T: exactly the confidence a record will carry.

Figures are on the tickets it was fitted on (in-sample; one parameter overfits little): the accuracy, and the
expected calibration error before and after.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import numpy.typing as npt

from worker.inference.answer_trie import Decision, weigh
from worker.inference.calibration import Mode, ModeCalibration
from worker.inference.engine import GenAIEngine
from worker.inference.loading import resolve_taxonomy
from worker.learning.evaluation import expected_calibration_error
from worker.settings import InferenceSettings

# A geometric grid from 0.1 to 20: published models met here were over- and under-confident by several times.
TEMPERATURES = tuple(round(0.1 * 1.05**step, 4) for step in range(109))
# Each ticket's reading gets this long: calibration is offline, a slow model must still be read.
_TICKET_SECONDS = 600.0


def calibrate_folder(
    settings: InferenceSettings,
    modes: Sequence[Mode],
    examples: Sequence[tuple[str, str]],
    reporter: Callable[[str], Callable[[int, int], None]],
) -> dict[Mode, ModeCalibration]:
    """Open the model of `settings` once and fit each mode on `examples` (`reporter(mode)` shows progress)."""
    engine = GenAIEngine(settings, *resolve_taxonomy(settings))
    return {mode: calibrate_mode(engine, mode, examples, reporter(mode)) for mode in modes}


def calibrate_mode(
    engine: GenAIEngine,
    mode: Mode,
    examples: Sequence[tuple[str, str]],
    progress: Callable[[int, int], None] | None = None,
) -> ModeCalibration:
    """Read every example in `mode` at temperature 1 and fit the temperature of that mode."""
    context = engine.new_context(mode)
    context.temperature = 1.0  # fit from the raw probabilities, whatever the folder records now
    index = {label: i for i, label in enumerate(engine.labels)}
    readings: list[Callable[[float], float]] = []  # each ticket's confidence at a temperature
    correct: list[bool] = []
    for done, (text, label) in enumerate(examples, 1):
        deadline = time.monotonic() + _TICKET_SECONDS
        if mode == "score":
            logprobs = np.log(np.maximum(list(context.label_distribution(text, deadline).values()), 1e-300))
            readings.append(partial(_top_probability, logprobs))
            correct.append(int(np.argmax(logprobs)) == index[label])
        else:
            predicted, decisions = context.walk(text, deadline)
            readings.append(partial(_path_probability, decisions))
            correct.append(predicted == index[label])
        if progress:
            progress(done, len(examples))

    def confidences(temperature: float) -> list[float]:
        return [reading(temperature) for reading in readings]

    def brier(temperature: float) -> float:
        return sum((c - r) ** 2 for c, r in zip(confidences(temperature), correct, strict=True))

    temperature = min(TEMPERATURES, key=brier)
    return ModeCalibration(
        temperature,
        len(examples),
        sum(correct) / max(1, len(correct)),
        expected_calibration_error(confidences(1.0), correct),
        expected_calibration_error(confidences(temperature), correct),
    )


def _top_probability(logprobs: npt.NDArray[np.float64], temperature: float) -> float:
    scaled = logprobs / temperature
    return float(1.0 / np.exp(scaled - scaled.max()).sum())


def _path_probability(decisions: Sequence[Decision], temperature: float) -> float:
    return weigh(decisions, temperature)[0]
