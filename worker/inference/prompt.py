"""Prompt rendering shared by the engine and the model trainer: this module is the prompt's contract.

The trainer must build its training text with these functions, so that the model sees at inference exactly
the text it was trained on. Nothing here imports onnxruntime-genai: the chat template and the tokenizer are
passed in (`ChatRenderer`, `TextTokenizer`), either ORT GenAI's or the pure-Python `chatml` renderer.

The rendered prompt is split into a *prefix* (everything before the ticket that is identical for every
ticket: prefilled once per context and reused with `rewind_to`) and a *suffix* (the rest of the user turn
with the ticket, and the assistant header). The split must keep encode(prefix) + encode(suffix) ==
encode(full): the engine passes the test (`accepts`) and the builder takes the first split, in order of
preference, that passes.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Sequence
from typing import Protocol

from worker.inference.taxonomy import Normalization, Taxonomy

# (messages, add_generation_prompt) -> rendered text.
ChatRenderer = Callable[[list[dict[str, str]], bool], str]

# The answer opens with this; in score mode the prompt ends with it and each label continues it.
INTENT_OPENING = '{"intent": "'
PRIORITY_OPENING = '", "priority": "'

# Tickets of every kind the prefix split is tested with: plain, one letter, a leading space, non-Latin.
SPLIT_PROBES = ("Where is my card?", "x", " leading space", "ünïcödé 日本 🙂")
# (prefix, whole prompt) -> whether the prefix and the rest tokenise exactly as the whole (the engine's test).
SplitTest = Callable[[str, str], bool]

# Tokens are at most this many characters in any vocabulary we meet (byte-level BPE merges are short);
# cutting the text to budget * this before encoding bounds the cost of a 100 KB ticket.
_MAX_CHARS_PER_TOKEN = 16


class TextTokenizer(Protocol):
    """What truncation needs from a tokenizer (ORT GenAI's `og.Tokenizer` fits)."""

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


def chatml(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The ChatML template of the project's own models, without needing a tokenizer."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n" if add_generation_prompt else text


def normalize(text: str, normalization: Normalization) -> str:
    """Apply the taxonomy's ticket normalisation in code, because ORT GenAI's tokenizer ignores
    tokenizer.json normalizers: a model trained on NFKC-lowercased text must get the same text here."""
    if normalization == "nfkc_lower":
        return unicodedata.normalize("NFKC", text).lower()
    return text


def answer_json(intent: str, priority: str) -> str:
    """The exact assistant answer (before EOS): compact JSON with the separators the schema forces."""
    return json.dumps({"intent": intent, "priority": priority}, ensure_ascii=False, separators=(", ", ": "))


def max_ticket_chars(max_tokens: int) -> int:
    """Characters of a ticket that can matter for a budget of `max_tokens`: anything beyond is cut anyway,
    so callers may drop it early (e.g. before sending a 1 MB ticket to a worker process)."""
    return max_tokens * _MAX_CHARS_PER_TOKEN


def truncate_ticket(text: str, tokenizer: TextTokenizer, max_tokens: int) -> tuple[str, bool]:
    """Cut `text` to at most `max_tokens` tokens at a safe boundary; returns (text, truncated).

    The cut is made on the text, never in the token ids passed to the model: the kept token ids are decoded
    (dropping a trailing partial UTF-8 character, which decodes to U+FFFD) and the cut moves back to the
    last whitespace when there is one nearby, so no character or word is split mid-way and the re-encoded
    text is a clean prefix of the ticket.
    """
    head = text[: max_ticket_chars(max_tokens)]
    ids = list(tokenizer.encode(head))
    if len(ids) <= max_tokens:
        return head, len(head) < len(text)
    kept = tokenizer.decode(ids[:max_tokens]).rstrip("\ufffd")
    cut = len(kept) if head.startswith(kept) else min(len(kept), len(head))
    # Whitespace cut: back off at most a fifth of the kept text, so a long unbroken run still keeps most.
    space = max(head.rfind(" ", 0, cut + 1), head.rfind("\n", 0, cut + 1))
    if space >= cut * 4 // 5:
        cut = space
    while cut > 0 and len(tokenizer.encode(head[:cut])) > max_tokens:
        cut = cut * 9 // 10
    return head[:cut].rstrip(), True


class PromptBuilder:
    """Renders the prompt of one taxonomy with one model's chat template."""

    def __init__(
        self, taxonomy: Taxonomy, render: ChatRenderer = chatml, accepts: SplitTest | None = None
    ) -> None:
        self.taxonomy = taxonomy
        self._render = render
        self.system_text = taxonomy.system_text()
        self.prefix = self._split_prefix(accepts or (lambda prefix, full: True))

    def messages(self, ticket: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_text}, {"role": "user", "content": ticket}]

    def full(self, ticket: str) -> str:
        """The whole prompt for a (normalised, truncated) ticket, ending at the assistant header."""
        return self._render(self.messages(ticket), True)

    def suffix(self, ticket: str) -> str:
        """The per-ticket part: the full prompt with the shared prefix removed."""
        return self.full(ticket)[len(self.prefix) :]

    def prepare(self, ticket: str) -> str:
        """Normalise the ticket text as the taxonomy says (truncation needs the tokenizer: see
        `truncate_ticket`)."""
        return normalize(ticket, self.taxonomy.prompt.ticket_normalization)

    def training_text(self, ticket: str, intent: str, priority: str, eos: str = "<|im_end|>") -> str:
        """Prompt + answer + EOS: one training example, exactly what the model must continue."""
        return self.full(ticket) + answer_json(intent, priority) + eos

    def _split_prefix(self, accepts: SplitTest) -> str:
        """The first of `prefix_choices` that `accepts` takes with every probe ticket (else the last of them:
        the engine's check then says why the prefix cannot be reused)."""
        choices = self.prefix_choices()
        fulls = [self.full(ticket) for ticket in SPLIT_PROBES]
        return next(
            (prefix for prefix in choices if all(accepts(prefix, full) for full in fulls)), choices[-1]
        )

    def prefix_choices(self) -> list[str]:
        """Where the shared prefix may end, in order of preference (those holding the instructions first),
        found by rendering with different tickets.

        - The system turn alone (no generation prompt), for ChatML- and Phi-style templates that close it.
        - Everything the renders share up to the last line break before the ticket, for templates that fold
          the system prompt into the user turn (Gemma's): without it the prefix is `<bos>` alone and every
          ticket re-reads the taxonomy (~10 s a ticket with Gemma 3 270M on 2 cores).
        - The last special-token start before the ticket, which never merges with its neighbours.
        """
        first, second = self.full("a"), self.full("b")
        common = 0
        for x, y in zip(first, second, strict=False):
            if x != y:
                break
            common += 1
        choices = []
        system_only = self._render(self.messages("")[:1], False)
        if first.startswith(system_only) and len(system_only) <= common:
            choices.append(system_only)
        line = first.rfind("\n", 0, common)
        if line > 0:
            choices.append(first[: line + 1])
        start = first.rfind("<", 0, common)
        choices.append(first[: start if start > 0 else common])
        # A prefix without the instructions saves nothing (Gemma's system-only render is `<bos>`).
        return sorted(dict.fromkeys(choices), key=lambda prefix: self.system_text not in prefix)
