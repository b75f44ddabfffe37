"""Fine-tune the shipped sentence encoder on a team's labelled tickets before the encoder stage's head is fit.

A frozen encoder places a team's tickets where its pretraining put them; a short fine-tune moves tickets of
one intent together and intents apart, which both the head (accuracy) and the out-of-scope detector (distance
to the nearest training ticket) read. Measured on BANKING77 (train.csv only: 90 % to learn from, 10 % to
measure on, seed 11; 206 steps of 32 tickets, 12 minutes on two loaded cores): the head's accuracy 92.2 % with
the frozen encoder, 93.4 % with the tuned one, int8 as served (docs/your-taxonomy.md has the full figures).

1. Weights: the shipped encoder is an int8 ONNX export of BERT (bge-small-en-v1.5). Its weights are
   dequantised into a `transformers` BertModel of the same shape; each matrix is found by the name of the
   graph node that multiplies by it (`/encoder/layer.N/attention/self/query/MatMul`), so a graph of another
   shape is refused in one line rather than loaded wrong.
2. Fit: mean-pooled, L2-normalised embeddings (as served) against a cosine classifier (logits = `SCALE` x the
   cosine with each intent's row), cross-entropy, AdamW with a linear warm-up and decay over one pass of the
   tickets (`model train`; `passes` asks for more), stopped earlier at the time bound. The classifier's rows
   start at the intents' prototypes (their taxonomy texts embedded), so the first steps move the encoder, not
   a random head. Few-shot folders are not tuned: ten passes over 5 tickets per intent moved test accuracy
   by -0.2 to +1.0 points and made the cross-validated temperature overconfident (docs/your-taxonomy.md).
3. Write: exported to ONNX and quantised to int8 per channel (onnxruntime's dynamic quantisation), the same
   inputs and output as the shipped file, so `SentenceEmbedder` serves it unchanged. The classifier is thrown
   away: the encoder stage fits its own head on the tuned embeddings (worker/learning/encoder_stage.py).

Needs the `train` extra (torch, transformers, onnx); the caller asks `missing_modules` first.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from worker.errors import UserError

NEEDED_MODULES = ("torch", "transformers", "onnx")
# The cosine classifier's logit scale: with cosines in [-1, 1] the softmax needs a scale to become confident
# (20-30 is usual for normalised-softmax training; 20 was the one tried).
SCALE = 20.0
LEARNING_RATE = 5e-5
# The classifier's rows move faster than the encoder's weights: they start at prototypes, not at a fit.
CLASSIFIER_LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
BATCH = 32
WARMUP_SHARE = 0.1
# Tickets are short; cutting training batches here halves the work of a padded batch of long ones. Serving
# still reads up to the manifest's max_tokens.
TRAINING_TOKENS = 64
# Kept from the time bound for writing the tuned encoder (ONNX export and int8 quantisation: 15-25 s on two
# loaded cores), so that the whole fine-tune stays within it.
EXPORT_SECONDS = 30.0
# A time bound leaving fewer seconds than this for the steps is not worth loading torch for: the caller
# keeps the shipped encoder.
MIN_STEP_SECONDS = 60.0
# The BERT shape of the shipped encoder (bge-small-en-v1.5).
_BERT_SHAPE = {
    "vocab_size": 30522,
    "hidden_size": 384,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
}
_MATMUL_OUTPUT = re.compile(r"^/(?P<module>.+)/MatMul_output_0_output_quantized$")
_QUANTISED_PARTS = ("_quantized", "_scale", "_zero_point")
_EMBEDDINGS = ("word", "token_type", "position")

Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class TuningReport:
    """What the fine-tune did, for training.json and the model card."""

    steps: int
    planned_steps: int  # the passes asked for over the tickets
    tickets_seen: int
    seconds: float
    stopped_at_time_bound: bool
    final_loss: float
    recipe: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def missing_modules() -> list[str]:
    """The modules of the `train` extra that this interpreter cannot import."""
    return [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]


def tune_encoder(
    onnx_file: Path,
    tokenizer_file: Path,
    tickets: Sequence[tuple[str, int]],
    prototype_texts: Sequence[Sequence[str]],
    out_file: Path,
    *,
    max_seconds: float,
    seed: int,
    passes: int = 1,
    progress: Progress | None = None,
) -> TuningReport:
    """Fine-tune the encoder `onnx_file` on (text, intent index) `tickets` for at most `passes` passes
    (each in its own order) or `max_seconds`, the classifier's rows starting at each intent's
    `prototype_texts` (its taxonomy texts), and write the tuned encoder to `out_file` as int8 ONNX. Reports
    (steps done, steps planned); with no step done (loading took the whole bound) nothing is written."""
    import torch
    import torch.nn.functional as functional

    started = time.monotonic()
    torch.manual_seed(seed)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = load_bert(onnx_file)
    tokenizer = _tokenizer(tokenizer_file)

    def embed(texts: Sequence[str]) -> Any:
        encodings = tokenizer.encode_batch(list(texts))
        mask = torch.tensor([e.attention_mask for e in encodings])
        states = model(
            input_ids=torch.tensor([e.ids for e in encodings]),
            attention_mask=mask,
            token_type_ids=torch.tensor([e.type_ids for e in encodings]),
        ).last_hidden_state
        pooled = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return functional.normalize(pooled, dim=1)

    model.eval()
    with torch.no_grad():
        rows = [functional.normalize(embed(texts).mean(0), dim=0) for texts in prototype_texts]
    classifier = torch.nn.Parameter(torch.stack(rows))
    model.train()
    optimiser = torch.optim.AdamW(
        [
            {"params": model.parameters(), "lr": LEARNING_RATE},
            {"params": [classifier], "lr": CLASSIFIER_LEARNING_RATE},
        ],
        weight_decay=WEIGHT_DECAY,
    )
    planned = max(1, passes * len(tickets) // BATCH)
    warmup = max(1, round(WARMUP_SHARE * planned))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda step: min(1.0, (step + 1) / warmup) * max(0.0, (planned - step) / planned)
    )
    shuffler = random.Random(seed)
    order: list[int] = []
    for _ in range(passes):  # each pass in its own order, one stream of batches across them
        shuffled = list(range(len(tickets)))
        shuffler.shuffle(shuffled)
        order += shuffled
    steps, loss_value = 0, float("nan")
    deadline = started + max_seconds - EXPORT_SECONDS
    while steps < planned and time.monotonic() < deadline:
        batch = [tickets[i] for i in order[steps * BATCH : (steps + 1) * BATCH]]
        logits = SCALE * embed([text for text, _ in batch]) @ functional.normalize(classifier, dim=1).T
        loss = functional.cross_entropy(logits, torch.tensor([intent for _, intent in batch]))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        steps += 1
        loss_value = float(loss.item())
        if progress is not None:
            progress(steps, planned)
    model.eval()
    if steps:  # nothing learnt, nothing written: the caller keeps the shipped encoder
        export_int8(model, out_file)
    return TuningReport(
        steps=steps,
        planned_steps=planned,
        tickets_seen=min(len(tickets), steps * BATCH),
        seconds=time.monotonic() - started,
        stopped_at_time_bound=steps < planned,
        final_loss=loss_value,
        recipe=(
            f"cosine classifier (scale {SCALE:g}) from the intents' prototypes, cross-entropy, AdamW lr "
            f"{LEARNING_RATE:g}, batch {BATCH}, at most {_passes(passes)}, {TRAINING_TOKENS} tokens, "
            "int8 per channel"
        ),
    )


def _passes(count: int) -> str:
    return "one pass" if count == 1 else f"{count} passes"


def load_bert(onnx_file: Path) -> Any:
    """The int8 ONNX BERT encoder `onnx_file` as a float32 `transformers` BertModel (see the module)."""
    import onnx
    import torch
    from onnx import numpy_helper
    from transformers import BertConfig, BertModel

    graph = onnx.load(str(onnx_file)).graph
    stored = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer}

    def dequantised(base: str) -> Any:
        try:
            values = stored[base + "_quantized"].astype(np.float32)
            zero_point = stored[base + "_zero_point"].astype(np.float32)
            return (values - zero_point) * stored[base + "_scale"]
        except KeyError:
            raise UserError(
                f"{onnx_file}: not the int8 BERT export the encoder fine-tune knows ({base} missing)"
            ) from None

    weights = {
        name: value
        for name, value in stored.items()
        if not name.startswith("onnx::") and not name.endswith(_QUANTISED_PARTS)
    }
    for kind in _EMBEDDINGS:
        weights[f"embeddings.{kind}_embeddings.weight"] = dequantised(f"embeddings.{kind}_embeddings.weight")
    for node in graph.node:
        match = _MATMUL_OUTPUT.match(node.output[0]) if node.op_type == "MatMulInteger" else None
        if match:
            # ONNX multiplies by (in, out); torch's Linear holds (out, in).
            module = match["module"].replace("/", ".")
            weights[module + ".weight"] = dequantised(node.input[1].removesuffix("_quantized")).T.copy()
    model = BertModel(BertConfig(**_BERT_SHAPE), add_pooling_layer=False)
    missing, unexpected = model.load_state_dict(
        {name: torch.tensor(value) for name, value in weights.items()}, strict=False
    )
    if missing or unexpected:
        raise UserError(
            f"{onnx_file}: not the BERT shape the encoder fine-tune knows "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    return model


def export_int8(model: Any, out_file: Path) -> None:
    """`model` (a BertModel) as an int8 ONNX file with the shipped encoder's inputs and output."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # The token states alone, so that the graph has the one output the shipped file has, and the inputs by
    # name (BertModel's positional order differs between transformers releases).
    class LastHiddenState(torch.nn.Module):  # type: ignore[misc]  # torch is untyped here (pyproject.toml)
        def __init__(self, bert: Any) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = tuple(torch.ones(2, 8, dtype=torch.long) for _ in names)
    float_file = out_file.with_name(out_file.name + ".float32")
    with torch.no_grad():
        torch.onnx.export(
            LastHiddenState(model),
            example,
            str(float_file),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes={name: {0: "batch", 1: "tokens"} for name in [*names, "last_hidden_state"]},
            opset_version=17,
            dynamo=False,
        )
    try:
        quantize_dynamic(str(float_file), str(out_file), weight_type=QuantType.QInt8, per_channel=True)
    finally:
        float_file.unlink(missing_ok=True)


def _tokenizer(tokenizer_file: Path) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_truncation(TRAINING_TOKENS)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    return tokenizer
