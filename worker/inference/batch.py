"""Static batches for the `batch` pool: `generate` mode for up to `batch_size` tickets in one Generator.

On a GPU a batch-1 step is launch-bound, so B rows cost little more than one (measured on an H200: batch 32
generate 9.5x the requests/s of batch 1). Rows are the full prompt (prefix + ticket), right-padded with the
pad token, from which ORT GenAI derives the attention mask; every row matched its single run (measured).
A batch has no prefix reuse: ORT GenAI only rewinds a batch to length 0.

`score` requests are served one by one by the runner's prefix context (see pool.py for why).
"""

from __future__ import annotations

import time

import numpy as np
import structlog

from worker.classification import Classification, ClassifyRequest
from worker.inference.answer_trie import Decision, TrieNode
from worker.inference.engine import GenAIEngine
from worker.inference.genai import og

log = structlog.get_logger(__name__)


class BatchRunner:
    """Runs a list of requests as one static batch (generate mode) or through one context (score mode)."""

    def __init__(self, engine: GenAIEngine) -> None:
        self.engine = engine
        self.context = engine.new_context()
        self.context.classify(ClassifyRequest(-1, "Warm-up: where is my card?", time.monotonic() + 60.0))
        if engine.settings.mode == "generate":  # warm the batched path too
            self.classify_batch([ClassifyRequest(-1, "warm-up", time.monotonic() + 60.0)] * 2)

    def classify_batch(self, requests: list[ClassifyRequest]) -> list[Classification]:
        """One result per request, in order; never raises."""
        # A taxonomy whose priority the model decides needs a second walk per row: one by one, as in score.
        one_by_one = self.engine.settings.mode == "score" or self.engine.priority_ids
        if one_by_one or len(requests) == 1:
            return [self.context.classify(request) for request in requests]
        started = time.monotonic()
        results: list[Classification | None] = [None] * len(requests)
        live = []
        for index, request in enumerate(requests):
            if started >= request.deadline:
                results[index] = self.engine.fallback("overloaded", started)
            else:
                live.append(index)
        if live:
            try:
                for index, result in zip(
                    live, self._generate([requests[i] for i in live], started), strict=True
                ):
                    results[index] = result
            except Exception:
                log.exception("model error in a batch", size=len(live))
                for index in live:
                    results[index] = self.engine.fallback("model_error", started)
        return [r if r is not None else self.engine.fallback("model_error", started) for r in results]

    def _generate(self, requests: list[ClassifyRequest], started: float) -> list[Classification]:
        """The rows walk the label trie together (`generate` mode of engine.py, one row each): every step
        the allowed tokens of each row's node are kept from its logits and renormalised, the most likely is
        chosen by us and written into the logits so the runtime's greedy step takes it, and a row that has
        its label (or ran out of time) is steered to EOS."""
        engine = self.engine
        prepared = [engine.prepare(request.text) for request in requests]
        rows = [engine.prefix_ids + ids for ids, _ in prepared]
        width = max(len(row) for row in rows)
        pad = int(engine.tokenizer.pad_token_id)
        batch = np.full((len(rows), width), pad, dtype=np.int32)
        for index, row in enumerate(rows):
            batch[index, : len(row)] = row
        generator = og.Generator(engine.model, engine.params(batch_size=len(rows)))
        generator.append_tokens(batch)
        eos = min(engine.eos_ids)
        nodes: list[TrieNode] = [engine.label_trie] * len(rows)
        decisions: list[list[Decision]] = [[] for _ in rows]
        finished_at: list[float | None] = [None] * len(rows)
        expired = [False] * len(rows)
        while not all(at is not None or out for at, out in zip(finished_at, expired, strict=True)):
            now = time.monotonic()
            logits = np.asarray(generator.get_logits()[:, -1], dtype=np.float32)
            chosen = np.full(len(rows), eos, dtype=np.int64)
            for index, request in enumerate(requests):
                if finished_at[index] is not None or expired[index]:
                    continue
                if now >= request.deadline:
                    expired[index] = True
                    continue
                node = nodes[index]
                if len(node.children) == 1:  # no choice: one token a step, as every row steps together
                    chosen[index], nodes[index] = next(iter(node.children.items()))
                else:
                    decision = Decision.greedy(node, logits[index])
                    decisions[index].append(decision)
                    chosen[index], nodes[index] = decision.token, decision.child
                if nodes[index].label is not None:
                    finished_at[index] = time.monotonic()
            steered = np.full_like(logits, -np.inf)
            steered[np.arange(len(rows)), chosen] = 0.0
            generator.set_logits(steered)
            generator.generate_next_token()
        results = []
        for index, (_, truncated) in enumerate(prepared):
            end, leaf = finished_at[index], nodes[index].label
            if expired[index] or end is None or leaf is None:
                results.append(engine.fallback("deadline_exceeded", started, truncated))
                continue
            confidence, scores = engine.walked_answer(leaf, decisions[index], self.context.temperature)
            intent = engine.labels[leaf]
            results.append(
                Classification(
                    intent=intent,
                    priority=engine.taxonomy.policy_priority(intent),
                    confidence=confidence,
                    scores=scores,
                    model=engine.model_id,
                    latency_ms=(end - started) * 1000.0,
                    truncated=truncated,
                    taxonomy=engine.taxonomy_mark,
                )
            )
        return results
