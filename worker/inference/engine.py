"""The classifier: one loaded model (`Engine`) and its reusable generator contexts (`Context`).

A context is one long-lived ORT GenAI Generator whose KV cache already holds the shared prefix (the system
prompt with the taxonomy). Each request appends only its own tokens and is rewound to the prefix afterwards
(`rewind_to`), which is token-for-token identical to a from-scratch run and several times faster because
the model's time is spent on the ticket, not on the instructions.

Two modes fill the same `Classification`:
- `score` (default): one prefill of the ticket + `{"intent": "`, then each label's continuation is scored
  from the logits; the log-probabilities are renormalised over the closed label set, so `confidence` is the
  model's real probability of the chosen label and `scores` its distribution.
- `generate`: greedy decoding constrained by the taxonomy's JSON schema (llguidance, strict whitespace),
  stopping on EOS; confidence is the product of the chosen label tokens' probabilities.

Whatever happens, `Context.classify` returns a Classification (a fallback tagged with its reason when the
model cannot answer in time or fails) and leaves the context rewound and usable for the next request.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import structlog

from worker.classification import Classification, ClassifyRequest, fallback_answer
from worker.errors import UserError
from worker.inference.genai import og
from worker.inference.loading import load_model, model_dir, model_id
from worker.inference.pairing import taxonomy_mark
from worker.inference.prompt import INTENT_OPENING, PRIORITY_OPENING, PromptBuilder, truncate_ticket
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


class _Answer(msgspec.Struct, forbid_unknown_fields=True):
    intent: str
    priority: str


class DeadlineExceeded(Exception):
    """Raised between model steps when the request's deadline has passed."""


class InvalidOutput(Exception):
    """Generated text that does not decode to an answer of the taxonomy."""


def log_softmax(logits: npt.NDArray[Any]) -> FloatArray:
    values = logits.astype(np.float64)
    shifted = values - values.max(axis=-1, keepdims=True)
    result: FloatArray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


class Engine:
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
        try:
            self.tokenizer = og.Tokenizer(self.model)
        except RuntimeError as error:  # e.g. a tokenizer class this ORT GenAI build does not support
            raise UserError(f"cannot load the tokenizer of {folder}: {str(error).splitlines()[0]}") from None
        self.builder = PromptBuilder(self.taxonomy, self._render)
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
        self.schema = json.dumps(self.taxonomy.json_schema())
        longest = max(len(label) for label in self.labels) + max(len(p) for p in self.taxonomy.priorities)
        # Every token is at least one byte and the answer is ASCII-only JSON of known length: a bound on
        # the steps of any tokenisation the grammar can force.
        self.max_answer_tokens = len('{"intent": "", "priority": ""}') + longest + 2
        overhead = len(self.encode(self.builder.suffix("") + INTENT_OPENING)) + 16
        longest_labels = max(len(ids) for ids in self.label_ids) + max(
            (len(ids) for ids in self.priority_ids), default=0
        )
        context_length = self._context_length(folder)
        self.max_length = min(
            context_length,
            len(self.prefix_ids)
            + overhead
            + self.max_ticket_tokens
            + self.max_answer_tokens
            + longest_labels,
        )
        self._check_split()

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def prepare(self, text: str) -> tuple[list[int], list[int], bool]:
        """Ticket text → (score-mode ids, generate-mode ids, truncated): normalised, cut to the token
        budget, wrapped in the user turn; score mode also opens the answer up to the intent's value."""
        ticket = self.builder.prepare(text)
        ticket, truncated = truncate_ticket(ticket, self.tokenizer, self.max_ticket_tokens)
        suffix = self.builder.suffix(ticket)
        return self.encode(suffix + INTENT_OPENING), self.encode(suffix), truncated

    def new_context(self, mode: Mode | None = None) -> Context:
        return Context(self, mode or self.settings.mode)

    def params(self, guided: bool, batch_size: int = 1) -> og.GeneratorParams:
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_length, random_seed=RANDOM_SEED, batch_size=batch_size)
        if guided:
            params.set_guidance("json_schema", self.schema, enable_ff_tokens=False)
        return params

    def fallback(self, reason: FallbackReason, started: float, truncated: bool = False) -> Classification:
        latency_ms = (time.monotonic() - started) * 1000.0
        return fallback_answer(reason, self.taxonomy.fallback_label, self.model_id, latency_ms, truncated)

    def decode(self, tokens: list[int]) -> str:
        text: str = self.tokenizer.decode(tokens)
        return text

    def parse_answer(self, text: str) -> tuple[str, Priority]:
        """Validate generated text as an answer of this taxonomy (the grammar should guarantee it; a model
        or runtime bug must still not reach the output topic). Unless the taxonomy lets the model decide
        the priority (`score_priority`), it is the intent's policy priority, as in `score` mode: words in a
        ticket then raise its priority only by changing its intent."""
        try:
            answer = msgspec.json.decode(text, type=_Answer)
        except msgspec.DecodeError as error:
            raise InvalidOutput(f"{text!r}: {error}") from None
        if answer.intent not in self.labels or answer.priority not in self.taxonomy.priorities:
            raise InvalidOutput(f"{text!r}: not in the taxonomy")
        if not self.taxonomy.prompt.score_priority:
            return answer.intent, self.taxonomy.policy_priority(answer.intent)
        return answer.intent, next(p for p in self.taxonomy.priorities if p == answer.priority)

    def label_confidence(self, tokens: list[int], token_probs: list[float], intent: str) -> float:
        """Product of the probabilities of the generated tokens that spell the intent's value."""
        begin = len(INTENT_OPENING)
        end = begin + len(intent)
        spans = [len(self.decode(tokens[:k])) for k in range(len(tokens) + 1)]
        confidence = 1.0
        for k, probability in enumerate(token_probs[: len(tokens)]):
            if spans[k] < end and spans[k + 1] > begin:
                confidence *= probability
        return min(1.0, max(0.0, confidence))

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

    def _check_split(self) -> None:
        for ticket in ("Where is my card?", "x", " leading space", "ünïcödé 日本 🙂"):
            if self.prefix_ids + self.encode(self.builder.suffix(ticket)) != self.encode(
                self.builder.full(ticket)
            ):
                raise UserError(
                    f"{self.model_id}: the chat template cannot be split before the user turn with identical "
                    "tokens, so the shared prefix cannot be reused"
                )

    @staticmethod
    def _context_length(folder: Any) -> int:
        config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
        model = config.get("model", {})
        return int(model.get("context_length") or config.get("search", {}).get("max_length") or 4096)


class Context:
    """One prefix-prefilled Generator serving requests one at a time (not thread-safe: one per thread)."""

    def __init__(self, engine: Engine, mode: Mode) -> None:
        self.engine = engine
        self.mode: Mode = mode
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
            score_ids, generate_ids, truncated = self.engine.prepare(request.text)
            if self._generator is None:
                self._build()
            if self.mode == "score":
                intent, priority, confidence, scores = self._score(score_ids, request.deadline)
            else:
                intent, priority, confidence, scores = self._generate(generate_ids, request.deadline)
        except DeadlineExceeded:
            result = self.engine.fallback("deadline_exceeded", started, truncated)
        except InvalidOutput as error:
            log.warning("invalid model output", request_id=request.request_id, output=str(error)[:200])
            result = self.engine.fallback("invalid_output", started, truncated)
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
        score_ids, _, _ = self.engine.prepare(text)
        try:
            return dict(zip(self.engine.labels, self._label_probs(score_ids, deadline), strict=True))
        finally:
            self._reset()

    def answer_logits(self, text: str) -> FloatArray:
        """The logits over the whole vocabulary where `score` mode reads the intent (right after
        `{"intent": "`): what fine-tuning the output layer's intent rows starts from
        (worker/learning/fine_tune.py)."""
        score_ids, _, _ = self.engine.prepare(text)
        try:
            generator = self._require()
            generator.append_tokens(score_ids)
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
        generator = self._require()
        if time.monotonic() >= deadline:
            raise DeadlineExceeded
        generator.append_tokens(ids)
        logprobs = self._continuations(self.engine.label_ids, deadline)
        probs: FloatArray = np.exp(logprobs - np.logaddexp.reduce(logprobs))
        return probs

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
        generator = self._require()
        if time.monotonic() >= deadline:
            raise DeadlineExceeded
        generator.append_tokens(ids)
        start = generator.token_count()
        token_probs: list[float] = []
        for _ in range(self.engine.max_answer_tokens + 1):
            if generator.is_done() or generator.token_count() >= self.engine.max_length:
                break
            if time.monotonic() >= deadline:
                raise DeadlineExceeded
            logits = generator.get_logits()[0, -1]
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            token_probs.append(math.exp(float(log_softmax(logits)[token])))
        tokens = [int(t) for t in generator.get_sequence(0)[start:]]
        # Done means EOS or a completed grammar (llguidance ends the sequence itself); anything else
        # is the step bound or max_length cutting an unfinished answer.
        if not generator.is_done():
            raise InvalidOutput(f"unfinished after {len(tokens)} tokens: {self._decode(tokens)!r}")
        if tokens and tokens[-1] in self.engine.eos_ids:
            tokens.pop()
        text = self._decode(tokens)
        intent, priority = self.engine.parse_answer(text)
        confidence = self.engine.label_confidence(tokens, token_probs, intent)
        return intent, priority, confidence, {intent: confidence}

    # -- lifecycle ----------------------------------------------------------------------------------------

    def _decode(self, tokens: list[int]) -> str:
        return self.engine.decode(tokens)

    def _require(self) -> og.Generator:
        if self._generator is None:
            raise RuntimeError("context has no generator")
        return self._generator

    def _build(self) -> None:
        """(Re)create the Generator and prefill the shared prefix; in generate mode it is a guided one,
        whose first creation per model also warms the grammar compiler."""
        self._generator = None
        generator = og.Generator(self.engine.model, self.engine.params(guided=self.mode == "generate"))
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
            generator = self._require()
            if time.monotonic() >= deadline:
                raise DeadlineExceeded
            generator.append_tokens(ids)
            continuations = [self.engine.label_ids[self.engine.labels.index(label)] for label in labels]
            logprobs = self._continuations(continuations, deadline)
            probs: FloatArray = np.exp(logprobs - np.logaddexp.reduce(logprobs))
            return probs
        finally:
            self._reset()
