"""The ORT GenAI folder of a local Hugging Face model (`model export`, and the first stage's last step).

The export needs torch, transformers and onnx, which are never runtime dependencies: they come with the
optional `export` extra and are imported only by onnxruntime-genai's model builder, in a child process, so
the worker itself never loads them. A folder with a `taxonomy.toml` (a model trained for it) also gets
`trained_labels.json`, which every start checks the configured taxonomy against (worker/inference/pairing.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

from worker.errors import UserError
from worker.inference.pairing import write_trained_labels
from worker.inference.taxonomy import load_taxonomy

Precision = Literal["int4", "int8", "fp16", "fp32"]
_EXPORT_MODULES = ("torch", "transformers", "onnx", "onnx_ir")
# Files the builder does not know about but the worker reads from a model folder.
_CARRIED_FILES = ("taxonomy.toml",)


def export_model(
    hf_dir: Path, out_dir: Path, precision: Precision = "int4", provider: str = "cpu", quiet: bool = False
) -> None:
    """Run the ORT GenAI builder on `hf_dir`, writing the model folder to `out_dir`.

    The builder runs as `python -m onnxruntime_genai.models.builder` (its documented interface) with this
    interpreter; its cache goes to a temporary folder so nothing is left behind in the working directory.
    """
    missing = [name for name in _EXPORT_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"model export needs {', '.join(missing)}: pip install 'triage-worker[export]'")
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="triage-export-") as cache:
        command = [
            sys.executable, "-m", "onnxruntime_genai.models.builder",
            "-i", str(hf_dir), "-o", str(out_dir), "-p", precision, "-e", provider, "-c", cache,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise UserError(f"model builder failed (exit {result.returncode}) {' '.join(detail)}".strip())
    for name in _CARRIED_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
    if (out_dir / "taxonomy.toml").is_file():
        # A model trained for its taxonomy: starts check the configured one against this record.
        write_trained_labels(out_dir, load_taxonomy(out_dir / "taxonomy.toml"))
    _portable_tokenizer_class(out_dir / "tokenizer_config.json")


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 saves its fast tokenizer's class as TokenizersBackend, which ORT GenAI refuses before
    0.13 (DirectML's newest installable build is 0.12.2); PreTrainedTokenizerFast names the same
    tokenizer.json to every version (measured: identical answers under 0.12.2 and 0.18.0)."""
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
