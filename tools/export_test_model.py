"""Build the small random-weight test model committed under tests/models/tiny/.

Run with the export venv (torch, transformers, tokenizers, onnx):
    /work/venv-export/bin/python -m tools.export_test_model [--out tests/models/tiny]

It trains a byte-level BPE tokenizer on BANKING77 training text (no normalizers, no prefix space — ORT GenAI
ignores both), writes a tiny Llama config with seeded random weights and a ChatML chat template, and exports
it with `triage-worker model export` (int4). The weights are random: the tests check the engine's
behaviour, not accuracy. Everything is seeded, so a rebuild gives the same tokenizer and weights.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import tempfile
from pathlib import Path

from tools import REPO
from worker.learning.export import export_model

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DATA = REPO / "data" / "banking77" / "train.csv"
# Layer shapes (hidden, intermediate, layers, attention heads, key/value heads): the committed test model, and
# Phi-4-mini's for GPU speed figures (tools/bench_gpu.sh; speed does not depend on the weights' values).
SHAPES = {"tiny": (128, 384, 2, 4, 2), "phi4-mini": (3072, 8192, 32, 24, 8)}
TAXONOMY = REPO / "tests" / "data" / "test_taxonomy.toml"


def corpus(limit: int) -> list[str]:
    with DATA.open(encoding="utf-8") as handle:
        texts = [row["text"] for row in csv.DictReader(handle)][:limit]
    # JSON punctuation and the label names, so answers tokenise into a few tokens, as in a real model.
    return [*texts, '{"intent": "card_arrival", "priority": "Low"}', "Low Medium High Critical"]


def build_hf_folder(hf_dir: Path, vocab_size: int, shape: str = "tiny") -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(4000), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(hf_dir)

    ids = {token: tokenizer.token_to_id(token) for token in SPECIALS}
    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|pad|>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    model.save_pretrained(hf_dir, safe_serialization=True)
    model.generation_config.save_pretrained(hf_dir)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "models" / "tiny")
    parser.add_argument("--precision", choices=["int4", "fp32"], default="int4")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu", help="the builder's -e")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tiny-hf-") as tmp:
        hf_dir = Path(tmp)
        build_hf_folder(hf_dir, args.vocab_size, args.shape)
        shutil.copyfile(TAXONOMY, hf_dir / "taxonomy.toml")
        if args.out.exists():
            shutil.rmtree(args.out)
        export_model(hf_dir, args.out, args.precision, args.provider, quiet=True)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
