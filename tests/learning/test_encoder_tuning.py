"""`worker.learning.encoder_tuning`: the shipped encoder fine-tuned on a full folder's tickets, served as the
folder's own encoder.

The fine-tune needs the `train` extra (torch, transformers, onnx), which `make test` does not install: those
tests skip there, saying so. What a folder records about its encoder runs everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tools import REPO
from worker.cli.cli import main
from worker.errors import UserError
from worker.inference.encoder import read_manifest
from worker.inference.taxonomy import load_taxonomy
from worker.learning import compose, encoder_stage, encoder_tuning
from worker.learning.evaluation import read_examples
from worker.settings import DEFAULT_ESCALATION_DIR

BANK_DESK_PATH = REPO / "taxonomies" / "bank-desk.toml"
TINY = REPO / "tests" / "models" / "tiny"
MISSING = encoder_tuning.missing_modules()
needs_train_extra = pytest.mark.skipif(
    bool(MISSING),
    reason=f"the encoder fine-tune needs {', '.join(MISSING)} (pip install 'triage-worker[train]'), which "
    "this venv does not have",
)
TEXTS = [
    "I am still waiting on my card?",
    "my transfer to my landlord never arrived",
    "why was I charged twice for one coffee",
]


def test_a_folder_says_why_its_encoder_was_not_tuned() -> None:
    """Only a full folder is tuned, with the extra, when asked, and when the time bound leaves room; the
    model card says which encoder the figures are of."""
    minutes = 20 * 60 * compose.TUNING_SHARE
    assert compose._why_not_tuned("full", False, minutes) == "not asked for (--no-encoder-tuning)"
    assert "few-shot" in (compose._why_not_tuned("few-shot", True, minutes) or "")
    assert "zero-shot" in (compose._why_not_tuned("zero-shot", True, minutes) or "")
    assert "--max-minutes" in (compose._why_not_tuned("full", True, 60.0) or "")
    assert compose._why_not_tuned("full", True, minutes) == (
        None if not MISSING else f"it needs {', '.join(MISSING)}: pip install 'triage-worker[train]'"
    )
    card = compose.tuning_paragraph(None, "not asked for (--no-encoder-tuning)")
    assert "not fine-tuned (not asked for (--no-encoder-tuning))" in card
    tuned = encoder_tuning.TuningReport(100, 281, 3200, 330.0, True, 0.3, "a recipe")
    card = compose.tuning_paragraph(tuned.as_dict(), None)
    assert "100 of 281 steps, 3200 tickets, 5.5 min (stopped at the time bound)" in card


def test_model_train_refuses_no_encoder_tuning_where_nothing_is_tuned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["model", "train", "--zero-shot", "--taxonomy", str(BANK_DESK_PATH), "--out", str(tmp_path / "m")]
    assert main([*argv, "--no-encoder-tuning"]) == 2
    assert "model train --zero-shot does not take --no-encoder-tuning" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@needs_train_extra
def test_the_shipped_encoder_loads_into_torch_as_it_serves() -> None:
    """The dequantised BertModel gives the embeddings the int8 ONNX file serves (to int8 rounding)."""
    import torch

    model = encoder_tuning.load_bert(encoder_stage.shipped_encoder_files()[0]).eval()
    tokenizer = encoder_tuning._tokenizer(encoder_stage.shipped_encoder_files()[1])
    encodings = tokenizer.encode_batch(TEXTS)
    mask = torch.tensor([e.attention_mask for e in encodings])
    with torch.no_grad():
        states = model(
            input_ids=torch.tensor([e.ids for e in encodings]),
            attention_mask=mask,
            token_type_ids=torch.tensor([e.type_ids for e in encodings]),
        ).last_hidden_state
    pooled = ((states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).numpy()
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    served = encoder_stage.open_embedder(threads=2).embed(TEXTS)
    assert (pooled * served).sum(axis=1).min() > 0.99


@needs_train_extra
def test_an_encoder_of_another_shape_is_refused_in_one_line() -> None:
    with pytest.raises(UserError, match="not the int8 BERT export the encoder fine-tune knows"):
        encoder_tuning.load_bert(TINY / "model.onnx")


@needs_train_extra
def test_a_full_folder_serves_its_fine_tuned_encoder_and_says_so(tmp_path: Path) -> None:
    """With the extra, `model train --data` on a full export tunes the encoder within its share of the time
    bound; the folder carries the tuned encoder (not the shipped file), its records say how it was tuned,
    and it classifies as well as the shipped encoder does on held-out tickets."""
    taxonomy = load_taxonomy(BANK_DESK_PATH)
    mapping = {
        row.split(",")[0]: row.split(",")[1]
        for row in (REPO / "taxonomies" / "bank-desk.banking77.csv").read_text().splitlines()[1:]
    }
    banking77 = load_taxonomy(REPO / "taxonomies" / "banking77.toml")
    rows = [(e.text, mapping[e.intent]) for e in read_examples(REPO / "data/banking77/train.csv", banking77)]
    taken: dict[str, int] = {}
    export = tmp_path / "export.jsonl"
    with export.open("w") as handle:
        for text, intent in rows[::7]:
            if taken.setdefault(intent, 0) < 30:
                taken[intent] += 1
                handle.write(json.dumps({"text": text, "intent": intent}) + "\n")
    out = tmp_path / "desk"
    argv = ["model", "train", "--data", str(export), "--taxonomy", str(BANK_DESK_PATH), "--out", str(out)]
    assert main([*argv, "--max-minutes", "12"]) == 0
    record = json.loads((out / "training.json").read_text())
    tuning = record["encoder_tuning"]
    assert tuning is not None, record["encoder_tuning_missing"]
    assert tuning["steps"] > 0 and tuning["seconds"] <= 12 * 60 * compose.TUNING_SHARE + 15
    manifest = read_manifest(out / "encoder")
    shipped = read_manifest(DEFAULT_ESCALATION_DIR)
    assert manifest.encoder_sha256 != shipped.encoder_sha256 and "fine-tuned" in manifest.source["encoder"]
    assert "fine-tuned on the training tickets" in (out / "README.md").read_text()
    assert record["encoder_stage"]["validation_accuracy"] >= 0.75
    assert len(taxonomy.labels) == len(manifest.labels)
