"""The answers a taxonomy allows, as the model's own tokenizer spells them: a token trie for `generate` mode.

`generate` mode decodes the intent greedily, one token at a time, allowing at each step only the tokens that
continue some label as the tokenizer would write it after `{"intent": "` (the same continuations `score` mode
ranks). Each step's probability is the model's, renormalised over the allowed tokens, so the product along a
label's path is the probability of that label among the taxonomy's labels: the labels' probabilities sum
to one, and `confidence` means what it means in `score` mode.

Why not the runtime's JSON-schema guidance (llguidance) as before: with a 49k-token vocabulary ORT GenAI
0.18's guidance forced splits of a label the model never writes (after `"lost_or` it forbade the natural
`_st` and forced `_` then `st`), and the probabilities read beside it were unmasked, so a correct answer's
`confidence` came out near 1e-10 (issue #45). The trie uses the tokenisation the engine checks at load, and
the mask is ours, so we renormalise over exactly what was allowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass
class TrieNode:
    """One position inside the labels' token sequences: the tokens allowed next and where each leads.

    `label` is set on a leaf (a label's last token was taken); `labels` counts the labels below, so a branch
    not taken whose subtree holds one label gives that label's exact probability."""

    children: dict[int, TrieNode] = field(default_factory=dict)
    label: int | None = None
    labels: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        return np.fromiter(self.children, dtype=np.int64, count=len(self.children))

    def forced(self) -> tuple[list[int], TrieNode]:
        """The run of tokens with no choice from here (one child each), and the node it ends on: appended in
        one call instead of one model step each."""
        run: list[int] = []
        node = self
        while node.label is None and len(node.children) == 1:
            token, node = next(iter(node.children.items()))
            run.append(token)
        return run, node


def build_trie(sequences: Sequence[Sequence[int]]) -> TrieNode:
    """The trie of `sequences` (one per label, in label order), which must be prefix-free: no label's
    tokens may start another's, or the shorter label could never be told from the longer one."""
    root = TrieNode()
    for index, sequence in enumerate(sequences):
        node = root
        node.labels.append(index)
        for token in sequence:
            if node.label is not None:
                raise ValueError(f"label {node.label}'s tokens start label {index}'s")
            node = node.children.setdefault(int(token), TrieNode())
            node.labels.append(index)
        if node.children or node.label is not None:
            raise ValueError(f"label {index}'s tokens start another label's")
        node.label = index
    return root


@dataclass(frozen=True)
class Decision:
    """One choice on the way down: the node, the model's logits of the tokens allowed there (in
    `node.tokens` order) and the index of the one taken. Kept raw so that a temperature can weigh them
    afterwards (worker/learning/calibration.py fits it from the same decisions)."""

    node: TrieNode
    logits: npt.NDArray[np.float64]
    taken: int

    @classmethod
    def greedy(cls, node: TrieNode, logits: npt.NDArray[np.floating]) -> Decision:
        """The most likely allowed token under any temperature (the argmax does not move)."""
        allowed = np.asarray(logits, dtype=np.float64)[node.tokens]
        return cls(node, allowed, int(np.argmax(allowed)))

    @property
    def child(self) -> TrieNode:
        return self.node.children[self.token]

    @property
    def token(self) -> int:
        return int(self.node.tokens[self.taken])


def log_softmax(logits: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Log-probabilities over the last axis (float64, shifted by the maximum for stability)."""
    values = logits.astype(np.float64)
    shifted = values - values.max(axis=-1, keepdims=True)
    result: npt.NDArray[np.float64] = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


def weigh(decisions: Sequence[Decision], temperature: float = 1.0) -> tuple[float, dict[int, float]]:
    """The probability of the path's label (each decision renormalised over its allowed tokens, logits
    divided by `temperature`), and the exact probability of every label alone on a branch not taken."""
    logprob = 0.0
    settled: dict[int, float] = {}
    for decision in decisions:
        steps = log_softmax(decision.logits / temperature)
        for index, token in enumerate(decision.node.tokens):
            child = decision.node.children[int(token)]
            if index != decision.taken and len(child.labels) == 1:
                settled[child.labels[0]] = math.exp(logprob + float(steps[index]))
        logprob += float(steps[decision.taken])
    return math.exp(logprob), settled
