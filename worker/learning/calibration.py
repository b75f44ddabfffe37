"""Fit a model folder's temperatures on labelled tickets (`triage-worker model calibrate`).

One temperature per mode, the standard post-hoc calibration (one parameter; the answer does not move): the
temperature of `TEMPERATURES` that minimises the negative log-likelihood of the true labels.

- `score`: the renormalised label distribution at temperature 1, rescaled (softmax of log-probabilities / T).
- `generate`: the decisions on the true label's path down the label trie (worker/inference/answer_trie.py),
  each renormalised over its allowed tokens at T; the confidence the worker will report is the same
  decisions' weight on the greedy path, so the figures below are exactly what a record would say.

Figures are on the tickets it was fitted on (in-sample; one parameter overfits little): the accuracy, and the
expected calibration error before and after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from worker.inference.answer_trie import Decision, weigh
from worker.inference.calibration import Mode, ModeCalibration
from worker.inference.engine import Context, Engine
from worker.inference.loading import resolve_taxonomy
from worker.learning.evaluation import expected_calibration_error
from worker.settings import InferenceSettings

# A geometric grid from 0.1 to 20: published models met here were over- and under-confident by several times.
TEMPERATURES = tuple(round(0.1 * 1.05**step, 4) for step in range(109))
# Each ticket's reading gets this long: calibration is offline, a slow model must still be read.
_TICKET_SECONDS = 600.0


# (the label the greedy walk reaches, its decisions, the decisions on the true label's path)
Walks = tuple[int, list[Decision], list[Decision]]


def _best(negative_log_likelihood: Callable[[float], float]) -> float:
    return min(TEMPERATURES, key=negative_log_likelihood)


def calibrate_folder(
    settings: InferenceSettings,
    modes: Sequence[Mode],
    examples: Sequence[tuple[str, str]],
    reporter: Callable[[str], Callable[[int, int], None]],
) -> dict[Mode, ModeCalibration]:
    """Open the model of `settings` once and fit each mode on `examples` (`reporter(mode)` shows progress)."""
    engine = Engine(settings, *resolve_taxonomy(settings))
    return {mode: calibrate_mode(engine, mode, examples, reporter(mode)) for mode in modes}


def calibrate_mode(
    engine: Engine,
    mode: Mode,
    examples: Sequence[tuple[str, str]],
    progress: Callable[[int, int], None] | None = None,
) -> ModeCalibration:
    """Read every example in `mode` at temperature 1 and fit the temperature of that mode."""
    context = engine.new_context(mode)
    context.temperature = 1.0  # fit from the raw probabilities, whatever the folder records now
    index = {label: i for i, label in enumerate(engine.labels)}
    truths = [index[label] for _, label in examples]
    if mode == "score":
        rows = []
        for done, (text, _) in enumerate(examples, 1):
            deadline = time.monotonic() + _TICKET_SECONDS
            probabilities = np.asarray(list(context.label_distribution(text, deadline).values()))
            rows.append(np.log(np.maximum(probabilities, 1e-300)))
            if progress:
                progress(done, len(examples))
        return _fit_scores(np.asarray(rows), truths)
    paths: list[Walks] = []
    for done, ((text, _), truth) in enumerate(zip(examples, truths, strict=True), 1):
        paths.append(_paths(context, text, truth))
        if progress:
            progress(done, len(examples))
    return _fit_paths(paths, truths)


def _paths(context: Context, text: str, truth: int) -> Walks:
    deadline = time.monotonic() + _TICKET_SECONDS
    predicted, greedy = context.walk(text, deadline)
    _, followed = context.walk(text, deadline, follow=truth)
    return predicted, greedy, followed


def _fit_scores(logprobs: np.ndarray, truths: Sequence[int]) -> ModeCalibration:
    rows = np.arange(len(truths))

    def probabilities(temperature: float) -> np.ndarray:
        scaled = logprobs / temperature
        scaled = scaled - scaled.max(axis=1, keepdims=True)
        exp = np.exp(scaled)
        result: np.ndarray = exp / exp.sum(axis=1, keepdims=True)
        return result

    def nll(temperature: float) -> float:
        return float(-np.log(np.maximum(probabilities(temperature)[rows, truths], 1e-300)).mean())

    def ece(temperature: float) -> float:
        chosen = probabilities(temperature)
        correct = [bool(p == t) for p, t in zip(chosen.argmax(axis=1), truths, strict=True)]
        return expected_calibration_error([float(c) for c in chosen.max(axis=1)], correct)

    temperature = _best(nll)
    accuracy = float(np.mean(logprobs.argmax(axis=1) == np.asarray(truths)))
    return ModeCalibration(temperature, len(truths), accuracy, ece(1.0), ece(temperature))


def _fit_paths(
    paths: Sequence[tuple[int, list[Decision], list[Decision]]], truths: Sequence[int]
) -> ModeCalibration:
    correct = [predicted == truth for (predicted, _, _), truth in zip(paths, truths, strict=True)]

    def nll(temperature: float) -> float:
        return -sum(math.log(max(weigh(followed, temperature)[0], 1e-300)) for _, _, followed in paths)

    def ece(temperature: float) -> float:
        return expected_calibration_error([weigh(greedy, temperature)[0] for _, greedy, _ in paths], correct)

    temperature = _best(nll)
    accuracy = sum(correct) / max(1, len(correct))
    return ModeCalibration(temperature, len(truths), accuracy, ece(1.0), ece(temperature))
