"""The classifier: one loaded model (`GenAIEngine`) and its reusable generator contexts (`Context`).

A context is one long-lived ORT GenAI Generator whose KV cache already holds the shared prefix (the system
prompt with the taxonomy). Each request appends only its own tokens and is rewound to the prefix afterwards
(`rewind_to`), which is token-for-token identical to a from-scratch run and several times faster because
the model's time is spent on the ticket, not on the instructions.

Two modes fill the same `Classification`:
- `score` (default): one prefill of the ticket + `{"intent": "`, then each label's continuation is scored
  from the logits; the log-probabilities are renormalised over the closed label set, so `confidence` is the
  model's real probability of the chosen label and `scores` its distribution.
- `generate`: the same prefill, then the intent is written greedily one token at a time, each step allowed
  only the tokens that continue a label as the tokenizer spells it (worker/inference/answer_trie.py) and its
  probability renormalised over them: `confidence` is the chosen label's probability among the labels,
  `scores` the labels whose probability the path settles (the chosen one and single-label branches not
  taken). A few model steps instead of one continuation per label.

Whatever happens, `Context.classify` returns a Classification (a fallback tagged with its reason when the
model cannot answer in time or fails) and leaves the context rewound and usable for the next request.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
import structlog

from worker.classification import Classification, ClassifyRequest, fallback_answer
from worker.errors import UserError
from worker.inference.answer_trie import Decision, build_trie, log_softmax, weigh
from worker.inference.calibration import temperatures
from worker.inference.genai import og
from worker.inference.loading import load_model, model_dir, model_id
from worker.inference.pairing import taxonomy_mark
from worker.inference.prompt import (
    INTENT_OPENING,
    PRIORITY_OPENING,
    SPLIT_PROBES,
    PromptBuilder,
    truncate_ticket,
)
from worker.inference.taxonomy import Taxonomy
from worker.messages import FallbackReason, Priority
from worker.settings import InferenceSettings

log = structlog.get_logger(__name__)

TOP_K_SCORES = 5
# A fixed seed: sampling is off (greedy), and the default seed (-1) was measured to cost ~15 ms per
# Generator on these VMs (RDSEED retries).
RANDOM_SEED = 42

Mode = Literal["score", "generate"]
FloatArray = npt.NDArray[np.float64]


class DeadlineExceeded(Exception):
    """Raised between model steps when the request's deadline has passed."""


class GenAIEngine:
    """A loaded model with everything derived from the taxonomy; creates contexts that share the model.

    Construction checks, once, what the per-request code relies on: that the prompt splits into prefix and
    suffix with identical tokens (so prefix reuse is exact) and that every label continuation tokenises the
    same on its own as inside the answer (so scoring reads the tokens the model would produce).

    `taxonomy` from `taxonomy_path` is the model's, as `worker.inference.loading.resolve_taxonomy` found and
    checked it where the model is assembled: the engine takes it as given.
    """

    def __init__(self, settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path) -> None:
        self.settings = settings
        folder = model_dir(settings)
        self.taxonomy = taxonomy
        self.taxonomy_path = taxonomy_path
        self.taxonomy_mark = taxonomy_mark(settings, self.taxonomy, self.taxonomy_path)
        self.model_id = model_id(folder)
        self.model = load_model(settings)
        self.temperatures = temperatures(folder, taxonomy)
        try:
            self.tokenizer = og.Tokenizer(self.model)
        except RuntimeError as error:  # e.g. a tokenizer class this ORT GenAI build does not support
            raise UserError(f"cannot load the tokenizer of {folder}: {str(error).splitlines()[0]}") from None
        self.builder = PromptBuilder(self.taxonomy, self._render, self._splits_cleanly)
        budgets = [settings.max_ticket_tokens, self.taxonomy.prompt.max_ticket_tokens]
        self.max_ticket_tokens = min(b for b in budgets if b is not None)
        self.eos_ids = frozenset(int(t) for t in self.tokenizer.eos_token_ids)
        self.prefix_ids = self.encode(self.builder.prefix)
        self.labels = self.taxonomy.labels
        probe = self.builder.suffix("probe") + INTENT_OPENING
        self.label_ids = self._label_continuations(probe, self.labels)
        self.priority_ids: list[list[int]] = []
        self.priority_opening_ids: list[int] = []
        if self.taxonomy.prompt.score_priority:
            with_label = probe + self.labels[0] + '"'
            self.priority_opening_ids = self._continuation(with_label, PRIORITY_OPENING[1:])
            opened = with_label + PRIORITY_OPENING[1:]
            self.priority_ids = self._label_continuations(opened, self.taxonomy.priorities)
        try:
            self.label_trie = build_trie(self.label_ids)
        except ValueError:
            raise UserError(
                f"{self.taxonomy_path}: with this model's tokenizer one label's tokens start another's, so "
                "generate mode could not tell them apart; rename the shorter one"
            ) from None
        overhead = len(self.encode(self.builder.suffix("") + INTENT_OPENING)) + 16
        longest_labels = (
            max(len(ids) for ids in self.label_ids)
            + len(self.priority_opening_ids)
            + max((len(ids) for ids in self.priority_ids), default=0)
        )
        needed = len(self.prefix_ids) + overhead + self.max_ticket_tokens + longest_labels
        self.max_length, slack = _cache_length(folder, needed)
        if slack:  # reopened so that its sliding layers keep a whole request and a context can rewind
            self.model = load_model(settings, sliding_window_slack=slack)
            self.tokenizer = og.Tokenizer(self.model)
        self._check_split()
        self._check_serves()
        self._check_fits(_context_length(folder), needed)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def prepare(self, text: str) -> tuple[list[int], bool]:
        """Ticket text → (ids appended after the prefix, truncated): normalised, cut to the token budget,
        wrapped in the user turn and followed by the answer's opening up to the intent's value."""
        ticket = self.builder.prepare(text)
        ticket, truncated = truncate_ticket(ticket, self.tokenizer, self.max_ticket_tokens)
        return self.encode(self.builder.suffix(ticket) + INTENT_OPENING), truncated

    def new_context(self, mode: Mode | None = None) -> Context:
        return Context(self, mode or self.settings.mode)

    def params(self, batch_size: int = 1) -> og.GeneratorParams:
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_length, random_seed=RANDOM_SEED, batch_size=batch_size)
        return params

    def walked_answer(
        self, leaf: int, decisions: Sequence[Decision], temperature: float
    ) -> tuple[float, dict[str, float]]:
        """`generate` mode's confidence for the label a walk reached, and its scores: that label and every
        label whose share the walk settles, the best `TOP_K_SCORES` of them."""
        confidence, settled = weigh(decisions, temperature)
        settled[leaf] = confidence
        top = sorted(settled.items(), key=lambda item: -item[1])[:TOP_K_SCORES]
        return confidence, {self.labels[i]: p for i, p in top}

    def fallback(self, reason: FallbackReason, started: float, truncated: bool = False) -> Classification:
        latency_ms = (time.monotonic() - started) * 1000.0
        return fallback_answer(reason, self.taxonomy.fallback_label, self.model_id, latency_ms, truncated)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        rendered: str = self.tokenizer.apply_chat_template(
            json.dumps(messages), add_generation_prompt=add_generation_prompt
        )
        return rendered

    def _continuation(self, before: str, text: str) -> list[int]:
        base, joined = self.encode(before), self.encode(before + text)
        if joined[: len(base)] != base or len(joined) == len(base):
            raise UserError(
                f"{self.taxonomy_path}: {text[:-1]!r} does not tokenise cleanly after the answer's opening "
                "with this model's tokenizer; rename it"
            )
        return joined[len(base) :]

    def _label_continuations(self, before: str, labels: Sequence[str]) -> list[list[int]]:
        """The token sequences scored for each label after `before`.

        When the labels' own tokens form a prefix-free set (no label's tokens start another's, as with one
        token per intent), each sequence is a distinct event and needs no closing quote: single-token labels
        are then scored in one step. Otherwise the closing quote ends each label, so that `card` is not
        credited with the probability of `card_arrival`.
        """
        quoted = [self._continuation(before, label + '"') for label in labels]
        bare = [self._continuation(before, label) for label in labels]
        clean_cut = all(q[: len(b)] == b and len(q) > len(b) for q, b in zip(quoted, bare, strict=True))
        prefix_free = not any(
            i != j and a == b[: len(a)] for i, a in enumerate(bare) for j, b in enumerate(bare)
        )
        return bare if clean_cut and prefix_free else quoted

    def _splits_cleanly(self, prefix: str, full: str) -> bool:
        """Whether `prefix` and the rest of `full` tokenise exactly like `full` (so prefix reuse is exact)."""
        return full.startswith(prefix) and self.encode(prefix) + self.encode(
            full[len(prefix) :]
        ) == self.encode(full)

    def _check_split(self) -> None:
        if not all(self._splits_cleanly(self.builder.prefix, self.builder.full(t)) for t in SPLIT_PROBES):
            raise UserError(
                f"{self.model_id}: the chat template cannot be split before the ticket with identical "
                "tokens, so the shared prefix cannot be reused"
            )

    def _check_fits(self, context: int, needed: int) -> None:
        """Refuse, in one line, a model whose context cannot hold the prompt plus the ticket budget and the
        answer: a ticket that used its whole budget would run past the cache and fail with `model_error`
        (issue #55), every such ticket, in every door."""
        if needed <= context:
            return
        others = needed - self.max_ticket_tokens
        fix = (
            f"lower the ticket budget to at most {context - others} (inference.max_ticket_tokens)"
            if context > others
            else "the prompt alone does not fit: use a model with a longer context"
        )
        raise UserError(
            f"{self.model_id}: its context ({context} tokens) cannot hold the prompt ({len(self.prefix_ids)} "
            f"tokens) plus the ticket budget ({self.max_ticket_tokens} tokens) and the answer "
            f"({others - len(self.prefix_ids)} tokens): {fix}"
        )

    def _check_serves(self) -> None:
        """Create one Generator and prefill the prefix, so that a model this runtime cannot serve with these
        settings (e.g. a cache sized under what its attention needs) is refused at start in one line rather
        than failing every request."""
        try:
            og.Generator(self.model, self.params()).append_tokens(self.prefix_ids)
        except Exception as error:  # ORT GenAI raises plain RuntimeError
            raise UserError(f"{self.model_id} cannot be served: {str(error).splitlines()[0]}") from None


def _context_length(folder: Path) -> int:
    """The most tokens the model in `folder` attends to (its `genai_config.json`)."""
    config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    model = config.get("model", {})
    return int(model.get("context_length") or config.get("search", {}).get("max_length") or 4096)


def _cache_length(folder: Path, needed: int) -> tuple[int, int]:
    """(the Generator's `max_length`, the sliding-window cache's slack) for requests of up to `needed` tokens.

    `max_length` is at least the model's sliding attention window (ORT GenAI refuses a smaller cache) and at
    most its context. A sliding-window cache holds the window plus its slack (0 as the builder writes it):
    a request that runs past the window evicts the prefix, and rewinding to it then fails (measured with
    Gemma 3 270M and a 900-token ticket: "Cannot rewind to 349"), so the slack covers the whole request.
    """
    config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    model = config.get("model", {})
    context = _context_length(folder)
    window = model.get("decoder", {}).get("sliding_window", {}).get("window_size")
    if not isinstance(window, int) or window <= 0:
        return min(context, needed), 0
    length = min(context, max(needed, window))
    return length, length - window


class Context:
    """One prefix-prefilled Generator serving requests one at a time (not thread-safe: one per thread)."""

    def __init__(self, engine: GenAIEngine, mode: Mode) -> None:
        self.engine = engine
        self.mode: Mode = mode
        self.temperature = engine.temperatures[mode]
        self._generator: og.Generator | None = None
        self._build()

    def classify(self, request: ClassifyRequest) -> Classification:
        """Classify one ticket; never raises. A request that arrives past its deadline is not run
        (`overloaded`: it waited, no model time was spent); one that runs out of time while running
        gives `deadline_exceeded`."""
        started = time.monotonic()
        if started >= request.deadline:
            return self.engine.fallback("overloaded", started)
        truncated = False
        try:
            ids, truncated = self.engine.prepare(request.text)
            if self._generator is None:
                self._build()
            if self.mode == "score":
                intent, priority, confidence, scores = self._score(ids, request.deadline)
            else:
                intent, priority, confidence, scores = self._generate(ids, request.deadline)
        except DeadlineExceeded:
            result = self.engine.fallback("deadline_exceeded", started, truncated)
        except Exception:
            log.exception("model error", request_id=request.request_id)
            result = self.engine.fallback("model_error", started, truncated)
            self._generator = None  # rebuilt on the next request (or below)
        else:
            result = Classification(
                intent=intent,
                priority=priority,
                confidence=confidence,
                scores=scores,
                model=self.engine.model_id,
                latency_ms=(time.monotonic() - started) * 1000.0,
                truncated=truncated,
                taxonomy=self.engine.taxonomy_mark,
            )
        self._reset()
        return result

    def label_distribution(self, text: str, deadline: float = math.inf) -> dict[str, float]:
        """The full renormalised distribution over the label set (what `score` mode decides from)."""
        ids, _ = self.engine.prepare(text)
        try:
            return dict(zip(self.engine.labels, self._label_probs(ids, deadline), strict=True))
        finally:
            self._reset()

    def walk(self, text: str, deadline: float) -> tuple[int, list[Decision]]:
        """`generate` mode's walk down the label trie for `text`: the label reached and the decisions, raw,
        for calibration (worker/learning/calibration.py)."""
        ids, _ = self.engine.prepare(text)
        try:
            return self._walk(ids, deadline)
        finally:
            self._reset()

    def answer_logits(self, text: str) -> FloatArray:
        """The logits over the whole vocabulary where `score` mode reads the intent (right after
        `{"intent": "`): what fine-tuning the output layer's intent rows starts from
        (worker/learning/fine_tune.py)."""
        ids, _ = self.engine.prepare(text)
        try:
            generator = self._require()
            generator.append_tokens(ids)
            logits: FloatArray = np.asarray(generator.get_logits()[0, -1], dtype=np.float64)
            return logits
        finally:
            self._reset()

    # -- score mode ---------------------------------------------------------------------------------------

    def _score(self, ids: list[int], deadline: float) -> tuple[str, Priority, float, dict[str, float]]:
        probs = self._label_probs(ids, deadline)
        best = int(np.argmax(probs))
        intent = self.engine.labels[best]
        priority = self.engine.taxonomy.policy_priority(intent)
        if self.engine.priority_ids:
            priority = self._score_priority(self.engine.label_ids[best], deadline)
        order = np.argsort(-probs)[:TOP_K_SCORES]
        scores = {self.engine.labels[i]: float(probs[i]) for i in order}
        return intent, priority, float(probs[best]), scores

    def _label_probs(self, ids: list[int], deadline: float) -> FloatArray:
        logprobs = self._label_logprobs(ids, self.engine.label_ids, deadline) / self.temperature
        probs: FloatArray = np.exp(logprobs - np.logaddexp.reduce(logprobs))
        return probs

    def _label_logprobs(self, ids: list[int], continuations: list[list[int]], deadline: float) -> FloatArray:
        """Append `ids` (a ticket's, up to the answer's opening), then each continuation's log-probability."""
        generator = self._require()
        if time.monotonic() >= deadline:
            raise DeadlineExceeded
        generator.append_tokens(ids)
        return self._continuations(continuations, deadline)

    def _continuations(self, continuations: list[list[int]], deadline: float) -> FloatArray:
        """Log-probability of each continuation after the current position: the first token from the last
        logits; the rest by appending the continuation (all but its last token) and reading the logits of
        every appended position, then rewinding. The deadline is checked between continuations."""
        generator = self._require()
        base = generator.token_count()
        first = log_softmax(generator.get_logits()[0, -1])
        result = np.empty(len(continuations))
        for index, tokens in enumerate(continuations):
            if time.monotonic() >= deadline:
                raise DeadlineExceeded
            total = float(first[tokens[0]])
            if len(tokens) > 1:
                generator.append_tokens(tokens[:-1])
                steps = log_softmax(generator.get_output("logits")[0])
                total += float(steps[np.arange(len(tokens) - 1), tokens[1:]].sum())
                generator.rewind_to(base)
            result[index] = total
        return result

    def _score_priority(self, label_tokens: list[int], deadline: float) -> Priority:
        generator = self._require()
        generator.append_tokens(label_tokens + self.engine.priority_opening_ids)
        logprobs = self._continuations(self.engine.priority_ids, deadline)
        return self.engine.taxonomy.priorities[int(np.argmax(logprobs))]

    # -- generate mode ------------------------------------------------------------------------------------

    def _generate(self, ids: list[int], deadline: float) -> tuple[str, Priority, float, dict[str, float]]:
        leaf, decisions = self._walk(ids, deadline)
        intent = self.engine.labels[leaf]
        confidence, scores = self.engine.walked_answer(leaf, decisions, self.temperature)
        priority = self.engine.taxonomy.policy_priority(intent)
        if self.engine.priority_ids:
            self._require().rewind_to(len(self.engine.prefix_ids) + len(ids))
            priority = self._score_priority(self.engine.label_ids[leaf], deadline)
        return intent, priority, confidence, scores

    def _walk(self, ids: list[int], deadline: float) -> tuple[int, list[Decision]]:
        """Append `ids`, then write the intent token by token down the label trie: each step reads the
        model's next-token logits and takes the most likely allowed token. A run of tokens with no choice
        is appended in one call and is no decision. Returns the label reached and the decisions on the way."""
        generator = self._require()
        if time.monotonic() >= deadline:
            raise DeadlineExceeded
        generator.append_tokens(ids)
        node, decisions = self.engine.label_trie, list[Decision]()
        while True:
            run, node = node.forced()
            if node.label is not None:
                return node.label, decisions
            if time.monotonic() >= deadline:
                raise DeadlineExceeded
            if run:
                generator.append_tokens(run)
            decision = Decision.greedy(node, generator.get_logits()[0, -1])
            decisions.append(decision)
            node = decision.child
            if node.label is None:
                generator.append_tokens([decision.token])

    # -- lifecycle ----------------------------------------------------------------------------------------

    def _require(self) -> og.Generator:
        if self._generator is None:
            raise RuntimeError("context has no generator")
        return self._generator

    def _build(self) -> None:
        """(Re)create the Generator and prefill the shared prefix."""
        self._generator = None
        generator = og.Generator(self.engine.model, self.engine.params())
        generator.append_tokens(self.engine.prefix_ids)
        self._generator = generator

    def _reset(self) -> None:
        """Rewind to the prefix; a generator that cannot be rewound is rebuilt (or dropped until the next
        request, when rebuilding fails too)."""
        prefix = len(self.engine.prefix_ids)
        try:
            if self._generator is None:
                self._build()
            elif self._require().token_count() != prefix:
                self._require().rewind_to(prefix)
        except Exception:
            log.exception("context reset failed; rebuilding")
            try:
                self._build()
            except Exception:
                log.exception("context rebuild failed")
                self._generator = None

    # -- deciding among candidates (worker/inference/candidates.py) -------------------------------------

    def score_among(self, user_turn: str, labels: Sequence[str], deadline: float = math.inf) -> FloatArray:
        """The probability of each of `labels` (some of the engine's) as the answer to `user_turn` (the whole
        user message, already normalised and cut to budget by the caller), renormalised over those labels
        only: each label's log-probability after `{"intent": "` as score mode reads it. Raises
        DeadlineExceeded when `deadline` passes between continuations; the context is rewound either way."""
        ids = self.engine.encode(self.engine.builder.suffix(user_turn) + INTENT_OPENING)
        try:
            if self._generator is None:
                self._build()
            continuations = [self.engine.label_ids[self.engine.labels.index(label)] for label in labels]
            logprobs = self._label_logprobs(ids, continuations, deadline)
            probs: FloatArray = np.exp(logprobs - np.logaddexp.reduce(logprobs))
            return probs
        finally:
            self._reset()
