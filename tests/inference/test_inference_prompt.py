"""Taxonomy loading and prompt rendering (pure logic: no model needed except for the tokenizer check)."""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime_genai as og
import pytest

from tools import REPO
from worker.classification import ticket_text
from worker.errors import UserError
from worker.inference.prompt import PromptBuilder, answer_json, chatml, truncate_ticket
from worker.inference.taxonomy import load_taxonomy, parse_taxonomy

TINY = REPO / "tests" / "models" / "tiny"


def _minimal(**changes: object) -> dict[str, object]:
    data: dict[str, object] = {
        "name": "t",
        "intents": [{"name": "card_arrival", "description": "Card not here.", "priority": "Low"}],
    }
    data.update(changes)
    return data


def test_shipped_taxonomies_load() -> None:
    default = load_taxonomy(REPO / "taxonomies" / "default.toml")
    assert 10 <= len(default.labels) <= 15
    assert load_taxonomy(TINY / "taxonomy.toml").labels


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"intents": []}, "intents"),
        ({"fallback_priority": "Urgent"}, "fallback_priority"),
        ({"intents": [{"name": "has space", "description": "d", "priority": "Low"}]}, r"intents\[0\]\.name"),
        ({"intents": [{"name": "a", "description": "d", "priority": "Low"}] * 2}, "listed twice"),
        ({"prompt": {"instructions": "x", "typo_key": 1}}, "typo_key"),
        ({"priorities": ["Low"], "fallback_priority": "Low"}, r"intents\[0\]\.priority"),
        ({"fallback_intent": "card_arrival"}, "`fallback_intent` .card_arrival. is one of the intents"),
    ],
)
def test_bad_taxonomy_is_a_user_error_naming_the_key(changes: dict[str, object], message: str) -> None:
    if "priorities" in changes:
        changes = {**changes, "intents": [{"name": "a", "description": "d", "priority": "High"}]}
    with pytest.raises(UserError, match=message):
        parse_taxonomy(_minimal(**changes), "t.toml")


def test_missing_taxonomy_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_taxonomy(tmp_path / "nope.toml")


def test_rendering_follows_the_contract() -> None:
    taxonomy = parse_taxonomy(_minimal())
    builder = PromptBuilder(taxonomy)
    assert builder.system_text == (
        taxonomy.prompt.instructions
        + "\n\nIntents:\n- card_arrival: Card not here.\n\nPriorities: Low, Medium, High, Critical"
    )
    assert builder.prefix == f"<|im_start|>system\n{builder.system_text}<|im_end|>\n"
    assert builder.suffix("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert builder.full("hi") == builder.prefix + builder.suffix("hi")
    assert answer_json("card_arrival", "Low") == '{"intent": "card_arrival", "priority": "Low"}'
    assert builder.training_text("hi", "card_arrival", "Low").endswith('"Low"}<|im_end|>')
    assert ticket_text("S", "B") == "S\nB"
    assert ticket_text(None, "B") == ticket_text("", "B") == "B"


def test_schema_is_closed_with_strict_whitespace() -> None:
    schema = parse_taxonomy(_minimal()).json_schema()
    assert schema["additionalProperties"] is False
    assert schema["properties"]["intent"]["enum"] == ["card_arrival"]
    assert schema["x-guidance"]["whitespace_flexible"] is False


def test_nfkc_lower_normalisation() -> None:
    taxonomy = parse_taxonomy(_minimal(prompt={"ticket_normalization": "nfkc_lower"}))
    assert PromptBuilder(taxonomy).prepare("ＣＡＲＤ Ⅻ") == "card xii"  # noqa: RUF001


def test_prefix_and_suffix_encode_like_the_full_prompt_with_the_model_template() -> None:
    tokenizer = og.Tokenizer(og.Model(str(TINY)))
    taxonomy = load_taxonomy(TINY / "taxonomy.toml")

    def render(messages: list[dict[str, str]], generation: bool) -> str:
        return str(tokenizer.apply_chat_template(json.dumps(messages), add_generation_prompt=generation))

    builder = PromptBuilder(taxonomy, render)
    assert builder.full("x") == PromptBuilder(taxonomy, chatml).full("x")
    for ticket in ["Where is my card?", " 日本 🙂", "<|im_end|>"]:
        joined = list(tokenizer.encode(builder.prefix)) + list(tokenizer.encode(builder.suffix(ticket)))
        assert joined == list(tokenizer.encode(builder.full(ticket)))
    text, truncated = truncate_ticket("ab 🙂 " * 500, tokenizer, 50)
    assert truncated and len(tokenizer.encode(text)) <= 50
    assert ("ab 🙂 " * 500).startswith(text) and not text.endswith(("\ufffd", " "))


def _folding(messages: list[dict[str, str]], generation: bool) -> str:
    """Gemma's template, in Python: no system turn; the system text opens the first user turn."""
    system = messages[0]["content"] + "\n\n" if messages and messages[0]["role"] == "system" else ""
    turns = [m for m in messages if m["role"] != "system"]
    text = "<bos>" + "".join(
        f"<start_of_turn>{m['role']}\n{(system if i == 0 else '')}{m['content'].strip()}<end_of_turn>\n"
        for i, m in enumerate(turns)
    )
    return text + "<start_of_turn>model\n" if generation else text


def test_a_template_that_folds_the_system_prompt_into_the_user_turn_still_shares_the_instructions() -> None:
    """Without the line-break split the prefix was `<bos>` alone, and every ticket re-read the taxonomy."""
    taxonomy = load_taxonomy(TINY / "taxonomy.toml")
    builder = PromptBuilder(taxonomy, _folding)
    assert builder.prefix == f"<bos><start_of_turn>user\n{builder.system_text}\n\n"
    assert builder.prefix + builder.suffix("Where is my card?") == builder.full("Where is my card?")
    # A split the tokenizer would merge across is passed over for the next one (the special-token start).
    refusing = PromptBuilder(taxonomy, _folding, lambda prefix, full: not prefix.endswith("\n\n"))
    assert refusing.prefix == "<bos>"
