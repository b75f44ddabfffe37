"""Taxonomy: the intents, priority levels and instruction text, loaded from a TOML file (config, not code).

Everything the model sees or may answer is derived from it: the system prompt, the label set scored in
`score` mode and the JSON schema that constrains `generate` mode. Changing the taxonomy therefore never
needs a code change, and a model trained on one taxonomy carries it in its folder (`taxonomy.toml`).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from worker.classification import FallbackLabel
from worker.errors import UserError
from worker.messages import PRIORITIES, Priority
from worker.small_files import read_small_file

Normalization = Literal["none", "nfkc_lower"]

# Intent names become JSON string values and label continuations: keep them free of quotes, backslashes and
# whitespace so that the label's tokens + `"` is always the exact continuation the model must produce.
INTENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")


class Intent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One label: its name (what the model answers), a one-line description and its policy priority, and
    optionally a few example phrases (what zero-shot training learns the intent from, with the name and
    description; never part of the prompt)."""

    name: str
    description: str
    priority: Priority
    examples: tuple[str, ...] = ()


class PromptOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the prompt is built from the taxonomy (see `worker/inference/prompt.py`)."""

    instructions: str = "Classify the customer support ticket. Answer with JSON: the intent and the priority."
    list_intents: bool = True
    ticket_normalization: Normalization = "none"
    max_ticket_tokens: int | None = None
    # Whether the model decides the priority (`score` scores the levels, `generate` keeps the generated one);
    # otherwise it is the chosen intent's policy priority, in both modes.
    score_priority: bool = False


class Taxonomy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A validated taxonomy; build it with `load_taxonomy` or `parse_taxonomy`."""

    name: str
    intents: tuple[Intent, ...]
    fallback_intent: str = "unclassified"
    fallback_priority: Priority = "Medium"
    # What "none of these" is called: the answer for a ticket the encoder stage finds out of scope
    # (worker/inference/out_of_scope.py), at the fallback priority. Default: `fallback_intent`.
    out_of_scope_intent: str | None = None
    priorities: tuple[Priority, ...] = PRIORITIES
    prompt: PromptOptions = PromptOptions()

    @property
    def labels(self) -> tuple[str, ...]:
        """Intent names in file order: the closed label set of `score` mode and the schema's enum."""
        return tuple(intent.name for intent in self.intents)

    @property
    def fallback_label(self) -> FallbackLabel:
        return FallbackLabel(self.fallback_intent, self.fallback_priority)

    @property
    def out_of_scope_label(self) -> str:
        return self.out_of_scope_intent or self.fallback_intent

    @property
    def verdict_labels(self) -> tuple[str, ...]:
        """What a reviewer may answer: one of the intents, or the out-of-scope intent ("none of these")."""
        return (*self.labels, self.out_of_scope_label)

    def policy_priority(self, intent: str) -> Priority:
        """The priority the taxonomy assigns to an intent (fallback priority for unknown names)."""
        for candidate in self.intents:
            if candidate.name == intent:
                return candidate.priority
        return self.fallback_priority

    def system_text(self) -> str:
        """The system message: instructions, optionally the intent list, then the priority levels."""
        parts = [self.prompt.instructions]
        if self.prompt.list_intents:
            lines = "\n".join(f"- {intent.name}: {intent.description}" for intent in self.intents)
            parts.append(f"Intents:\n{lines}")
        parts.append("Priorities: " + ", ".join(self.priorities))
        return "\n\n".join(parts)

    def json_schema(self) -> dict[str, Any]:
        """JSON schema for the runtime's guided decoding, as the seed design generated answers (the baseline
        of `make bench`'s P3; the engine writes labels down its own token trie): the two enum fields, no
        other keys, fixed whitespace.

        Free whitespace is switched off (`x-guidance`) because, measured, a model may otherwise pad with
        whitespace until max_length and never close the object; the separators match `answer_json`.
        """
        return {
            "type": "object",
            "properties": {
                "intent": {"type": "string", "enum": list(self.labels)},
                "priority": {"type": "string", "enum": list(self.priorities)},
            },
            "required": ["intent", "priority"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
        }


def parse_taxonomy(data: dict[str, Any], source: str = "taxonomy") -> Taxonomy:
    """Validate a decoded TOML document; every problem is a `UserError` naming the file and the key."""
    try:
        taxonomy = msgspec.convert(data, Taxonomy)
    except msgspec.ValidationError as error:
        raise UserError(f"{source}: invalid taxonomy: {error}") from None
    _check(taxonomy, source)
    return taxonomy


def load_taxonomy(path: str | Path) -> Taxonomy:
    """Read and validate a taxonomy TOML file."""
    file = Path(path)
    try:
        data = tomllib.loads(read_small_file(file, "a taxonomy").decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"taxonomy file not found: {file}") from None
    except OSError as error:
        raise UserError(f"cannot read taxonomy file {file}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise UserError(f"cannot read taxonomy file {file}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"{file}: not valid TOML: {error}") from None
    return parse_taxonomy(data, str(file))


def _check(taxonomy: Taxonomy, source: str) -> None:
    """Rules msgspec's types cannot express."""
    if not taxonomy.name.strip():
        raise UserError(f"{source}: `name` must not be empty")
    if not taxonomy.intents:
        raise UserError(f"{source}: `intents` must list at least one intent")
    if not taxonomy.priorities:
        raise UserError(f"{source}: `priorities` must list at least one level")
    if len(set(taxonomy.priorities)) != len(taxonomy.priorities):
        raise UserError(f"{source}: `priorities` has duplicates")
    if taxonomy.fallback_priority not in taxonomy.priorities:
        raise UserError(
            f"{source}: `fallback_priority` {taxonomy.fallback_priority!r} is not in `priorities`"
        )
    if not taxonomy.fallback_intent.strip():
        raise UserError(f"{source}: `fallback_intent` must not be empty")
    if taxonomy.fallback_intent in taxonomy.labels:
        # A fallback (no model answer) would then read as a confident answer downstream and in every figure.
        raise UserError(
            f"{source}: `fallback_intent` {taxonomy.fallback_intent!r} is one of the intents; it must be a "
            'name of its own (e.g. "unclassified") so that a fallback is never taken for an answer'
        )
    if taxonomy.out_of_scope_intent is not None and (
        not taxonomy.out_of_scope_intent.strip() or taxonomy.out_of_scope_intent in taxonomy.labels
    ):
        # An intent's name would make "none of these" read as that intent in every record and figure.
        raise UserError(
            f"{source}: `out_of_scope_intent` {taxonomy.out_of_scope_intent!r} must be a non-empty name "
            "that is not one of the intents"
        )
    if taxonomy.prompt.max_ticket_tokens is not None and taxonomy.prompt.max_ticket_tokens < 1:
        raise UserError(f"{source}: `prompt.max_ticket_tokens` must be at least 1")
    seen: set[str] = set()
    for index, intent in enumerate(taxonomy.intents):
        where = f"{source}: intents[{index}]"
        if not INTENT_NAME.match(intent.name):
            raise UserError(
                f"{where}.name {intent.name!r} must be letters, digits or _.:/- (no spaces or quotes)"
            )
        if intent.name in seen:
            raise UserError(f"{where}.name {intent.name!r} is listed twice")
        seen.add(intent.name)
        if intent.priority not in taxonomy.priorities:
            raise UserError(f"{where}.priority {intent.priority!r} is not in `priorities`")
        if "\n" in intent.description:
            raise UserError(f"{where}.description must be one line")
        for number, example in enumerate(intent.examples):
            if not example.strip() or "\n" in example:
                raise UserError(f"{where}.examples[{number}] must be one non-empty line")
