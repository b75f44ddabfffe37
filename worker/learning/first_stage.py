"""The cascade's first stage, trained in a time budget: a small Llama (the `triage-mini` architecture) learnt
from scratch on a team's tickets, distilled from a teacher, exported with the ORT GenAI builder.

`train_first_stage` is the whole recipe; every phase is bounded by `max_seconds` (export included), by
choosing how much work to do from measured speeds, never by stopping a phase half-way:

1. Validation: the rows given, else a stratified 10 % of `labelled` when every intent has at least
   `Recipe.min_rows_to_hold_out` rows; else none (few-shot, zero-shot: nothing to spare).
2. Teacher (`teacher(texts)`: intent probabilities, columns in `taxonomy.labels` order), in chunks for
   `Recipe.teacher_share` of the budget: the `unlabelled` tickets first (half of that time at most: real
   phrasings the labels do not cover), then the augmented copies of the labelled rows (words dropped, one
   adjacent pair swapped), then the labelled rows themselves (a head fit on them mostly repeats their
   label). The intent target of a labelled row or copy is the label-smoothed hard label mixed with the
   teacher's probabilities (a copy the teacher had no time for takes its original's); an unlabelled
   ticket's is the teacher's probabilities alone. The pretrained teacher knows that paraphrases mean the
   same, which a few thousand tickets cannot teach a model trained from scratch.
3. Tokenizer: byte-level BPE on the rendered training texts, with one added token per intent (`name"`) so
   that `score` mode decides an intent in one model step; no normalizer, no prefix space (ORT GenAI ignores
   both: the taxonomy's ticket normalisation is applied in code, `worker.inference.prompt`).
4. Training on the prompt that `worker.inference.prompt` renders (byte-identical to the engine's): loss on
   the answer tokens, the soft target on the intent token, an auxiliary language-modelling loss on the
   ticket, random token replacement in the ticket. The shared system prompt runs once per step. The number
   of steps is the smaller of `Recipe.max_epochs` epochs and what the time left allows at the measured step
   time (re-measured as it goes, so a machine that slows down shortens the run rather than overrunning).
5. Calibration: one temperature, fitted on the validation rows (without them: fitted to the teacher's
   probabilities on fresh augmented copies), folded into the intent tokens' output weights, so that `score`
   mode's `confidence` is a probability of being right with no change to the engine.
6. Export (int4 by default), tokenizer parity with ORT GenAI, and the validation figures of the folder as
   the engine serves it (`worker.inference.engine.GenAIEngine`, score mode).

Few examples (fewer than `Recipe.few_shot_rows` rows per intent on average, zero-shot included) change
three things: more augmented copies per ticket (up to `Recipe.few_shot_copies`, so that an epoch has at
least `Recipe.min_examples` examples), more weight on the teacher (`Recipe.few_shot_teacher_weight`: five
tickets cannot outvote a pretrained encoder), and no held-out validation split.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from worker.inference.prompt import INTENT_OPENING, PromptBuilder, answer_json
from worker.inference.taxonomy import Taxonomy

if TYPE_CHECKING:
    import numpy

Teacher = Callable[[Sequence[str]], "numpy.ndarray[Any, Any]"]
Precision = Literal["int4", "int8", "fp32"]

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|pad|>")
EOS = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_RECORD = "training.json"
# Texts per teacher call when its time is bounded (an encoder stage labels a few hundred a second).
_TEACHER_CHUNK = 256
# Modules the recipe needs (the `train` extra); `missing_modules` names those that cannot be imported.
NEEDED_MODULES = ("torch", "transformers", "tokenizers", "onnx", "onnx_ir", "safetensors")


@dataclass(frozen=True)
class Shape:
    """The Llama's size. `triage-mini` is hidden 384, 4 layers, 6 heads, MLP 1024 (9.4 M parameters); in a
    budget of minutes a narrower, shallower one sees more tickets and wins: on BANKING77 with 6 minutes,
    256 x 2 layers reached 81.2 % validation accuracy against 63.9 % for 256 x 4 (3.1 M against 4.7 M
    parameters; 345 against 251 steps)."""

    vocab_size: int = 3000
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 704


@dataclass(frozen=True)
class Recipe:
    """Everything else that decides the trained weights (recorded in the folder's training.json)."""

    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 60
    weight_decay: float = 0.1
    label_smoothing: float = 0.1
    aux_lm_weight: float = 0.3
    replace_prob: float = 0.12
    teacher_weight: float = 0.5  # the teacher's share in a labelled ticket's intent target
    copies: int = 3  # augmented copies of each labelled ticket (as the teacher's budget allows)
    word_dropout: float = 0.15
    swap_prob: float = 0.3
    max_epochs: int = 8
    teacher_share: float = 0.25  # of max_seconds, for every teacher call together
    threads: int = 1  # torch threads: on a shared 2-core machine one thread was 5x faster than two
    val_fraction: float = 0.1
    min_rows_to_hold_out: int = 10  # per intent, to hold out a validation split when none is given
    few_shot_rows: int = 20  # mean rows per intent under which the few-shot adaptations apply
    few_shot_copies: int = 15
    few_shot_teacher_weight: float = 0.8
    min_examples: int = 3000  # few-shot: copies until an epoch has this many examples
    min_steps: int = 10  # even when the budget is spent, so that the folder is a trained model
    min_planned_steps: int = 150  # the epoch cap never plans fewer (day 0: a few texts an intent)


@dataclass(frozen=True)
class FirstStageReport:
    """What `train_first_stage` did, with the served folder's validation figures."""

    validation_accuracy: float | None  # of the exported folder, served by the engine in score mode
    ece: float | None  # expected calibration error of its `confidence` on the validation rows
    seconds: float
    precision: str
    parameters: int
    steps: int = 0
    epochs: float = 0.0
    temperature: float = 1.0
    validation_rows: int = 0
    train_examples: int = 0
    bytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    notes: tuple[str, ...] = ()


def missing_modules() -> list[str]:
    """The modules of the `train` extra that this interpreter cannot import."""
    import importlib.util

    return [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]


def augment(text: str, rng: random.Random, word_dropout: float, swap_prob: float) -> str:
    """A noisy copy of a ticket: each word dropped with probability `word_dropout` (one always stays) and,
    with probability `swap_prob`, one adjacent pair of the remaining words swapped."""
    words = text.split()
    if not words:
        return text
    kept = [word for word in words if rng.random() >= word_dropout] or [rng.choice(words)]
    if len(kept) > 1 and rng.random() < swap_prob:
        i = rng.randrange(len(kept) - 1)
        kept[i], kept[i + 1] = kept[i + 1], kept[i]
    return " ".join(kept)


def label_tokens(taxonomy: Taxonomy) -> list[str]:
    """One added token per intent: its name *with the closing quote*, because the engine scores each label
    as the continuation `name"` after `{"intent": "`. One token for that continuation makes `score` mode a
    single model step; the quote inside the token also keeps the answer's next token out of the label's
    score (without it, `"` would merge with the following `,` in training and not when scoring)."""
    return [f'{name}"' for name in taxonomy.labels]


def train_tokenizer(texts: list[str], taxonomy: Taxonomy, vocab_size: int) -> Any:
    """Byte-level BPE over the rendered training texts (so the template's words are single tokens), with
    the special tokens and one added token per intent kept out of the merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    split = re.compile("|".join(re.escape(t) for t in (*SPECIALS, *label_tokens(taxonomy))))
    pieces = [piece for text in texts for piece in split.split(text) if piece]
    tokenizer.train_from_iterator(pieces, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in label_tokens(taxonomy)])
    return tokenizer


@dataclass
class Example:
    ids: list[int]  # suffix token ids (after the shared prefix), answer and EOS included
    weights: list[float]  # predicting ids[i] is: 1 an answer token, 0.5 a ticket token, 0 not in the loss
    ticket: list[int]  # positions of ticket tokens (candidates for random replacement)
    intent_pos: int  # position of the intent token in ids
    label: int  # index of the intent in taxonomy.labels (the teacher's choice for an unlabelled ticket)
    soft: Any = None  # the teacher's probabilities over taxonomy.labels (numpy), None without a teacher
    mix: float = 0.0  # the teacher's share in the intent target (1: an unlabelled ticket)


def encode_examples(
    rows: Sequence[tuple[str, str]],
    builder: PromptBuilder,
    tokenizer: Any,
    label_ids: list[int],
    soft: Any = None,
    mix: float | Sequence[float] = 0.0,
) -> list[Example]:
    """Token ids of each example's suffix, with loss weights located through character offsets. With
    `mix` = 1 the hard label is the teacher's guess: the intent token then leaves the hard-label loss."""
    taxonomy = builder.taxonomy
    index = {name: i for i, name in enumerate(taxonomy.labels)}
    marker = builder.suffix("\x00")
    head, tail = marker.index("\x00"), len(marker) - marker.index("\x00") - 1
    examples = []
    for row, (text, intent) in enumerate(rows):
        suffix = builder.suffix(builder.prepare(text))
        answer = answer_json(intent, taxonomy.policy_priority(intent)) + EOS
        encoding = tokenizer.encode(suffix + answer, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets
        ticket_start, ticket_end = head, len(suffix) - tail
        weights, ticket_positions = [], []
        intent_pos = -1
        for pos, (start, end) in enumerate(offsets):
            if start >= len(suffix):
                weights.append(1.0)
                if start == len(suffix) + len(INTENT_OPENING):
                    intent_pos = pos
            elif start >= ticket_start and end <= ticket_end:
                weights.append(0.5)
                ticket_positions.append(pos)
            else:
                weights.append(0.0)
        label = index[intent]
        if intent_pos < 0 or ids[intent_pos] != label_ids[label]:
            raise RuntimeError(f"the intent of {text!r} is not one token: check the added intent tokens")
        share = mix if isinstance(mix, float) else mix[row]
        if share >= 1.0:
            weights[intent_pos] = 0.0
        examples.append(
            Example(
                ids, weights, ticket_positions, intent_pos, label, None if soft is None else soft[row], share
            )
        )
    return examples


def batches(examples: list[Example], size: int, rng: random.Random) -> list[list[Example]]:
    """Shuffled batches of similar length (less padding), in shuffled order."""
    order = examples[:]
    rng.shuffle(order)
    chunk = size * 20
    grouped: list[list[Example]] = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda e: len(e.ids))
        grouped.extend(part[i : i + size] for i in range(0, len(part), size))
    rng.shuffle(grouped)
    return grouped


class Trainer:
    """Owns the torch model and the tensors of one run."""

    def __init__(
        self,
        shape: Shape,
        recipe: Recipe,
        vocab: int,
        prefix_ids: list[int],
        special_ids: dict[str, int],
        label_ids: list[int],
        seed: int,
    ) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        self.recipe = recipe
        self.seed = seed
        torch.manual_seed(seed)
        self.config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            max_position_embeddings=1024,
            bos_token_id=special_ids["<|im_start|>"],
            eos_token_id=special_ids[EOS],
            pad_token_id=special_ids["<|pad|>"],
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(self.config)
        self.prefix = torch.tensor([prefix_ids])
        self.pad = special_ids["<|pad|>"]
        self.label_ids = torch.tensor(label_ids)
        self.normal_ids = (len(SPECIALS), min(label_ids))

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _hidden(self, ids: Any) -> Any:
        """Hidden states of `ids` (B, S) after the shared prefix: the prefix runs once, its keys and values
        are broadcast over the batch (right padding needs no mask: causal attention never looks ahead)."""
        torch = self.torch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cache = self.model.model(input_ids=self.prefix, use_cache=True).cache
            for layer in cache.layers:
                layer.keys = layer.keys.expand(ids.shape[0], -1, -1, -1)
                layer.values = layer.values.expand(ids.shape[0], -1, -1, -1)
            return self.model.model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state

    def _tensors(self, batch: list[Example], rng: random.Random | None) -> tuple[Any, Any, Any, Any, Any]:
        torch = self.torch
        width = max(len(e.ids) for e in batch)
        inputs = torch.full((len(batch), width), self.pad)
        targets = torch.full((len(batch), width), self.pad)
        weights = torch.zeros((len(batch), width))
        for row, example in enumerate(batch):
            ids = example.ids
            targets[row, : len(ids)] = torch.tensor(ids)
            weights[row, : len(ids)] = torch.tensor(example.weights)
            noisy = list(ids)
            if rng is not None:
                for pos in example.ticket:
                    if rng.random() < self.recipe.replace_prob:
                        noisy[pos] = rng.randrange(*self.normal_ids)
            inputs[row, : len(ids)] = torch.tensor(noisy)
        intent_pos = torch.tensor([e.intent_pos for e in batch])
        labels = torch.tensor([e.label for e in batch])
        return inputs, targets, weights, intent_pos, labels

    def loss(self, batch: list[Example], rng: random.Random) -> Any:
        """Next-token loss on the answer (and, weighted, the ticket) plus a soft target on the intent token:
        the label-smoothed hard label mixed with the teacher's probabilities by each example's `mix`."""
        import numpy as np

        torch = self.torch
        functional = torch.nn.functional
        recipe = self.recipe
        inputs, targets, weights, intent_pos, labels = self._tensors(batch, rng)
        hidden = self._hidden(inputs[:, :-1])
        rows = torch.arange(len(batch))
        mask = weights[:, 1:] > 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model.lm_head(hidden[mask]).float()
        token_loss = functional.cross_entropy(logits, targets[:, 1:][mask], reduction="none")
        answer = weights[:, 1:][mask] == 1.0
        lm = token_loss[answer].mean()
        if (~answer).any():
            lm = lm + recipe.aux_lm_weight * token_loss[~answer].mean()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            intent_logits = self.model.lm_head(hidden[rows, intent_pos - 1]).float()
        count = len(self.label_ids)
        target = functional.one_hot(labels, count).float()
        target = target * (1 - recipe.label_smoothing) + recipe.label_smoothing / count
        if batch[0].soft is not None:
            soft = torch.from_numpy(np.stack([e.soft for e in batch]).astype(np.float32))
            mix = torch.tensor([e.mix for e in batch]).unsqueeze(1)
            target = (1 - mix) * target + mix * soft
        intent = functional.cross_entropy(intent_logits[:, self.label_ids], target)
        return lm + intent

    def label_logits(self, examples: list[Example]) -> Any:
        """(N, labels) logits of the intent tokens at the intent position (what `score` mode compares)."""
        torch = self.torch
        parts = []
        self.model.eval()
        with torch.no_grad():
            for start in range(0, len(examples), 128):
                batch = examples[start : start + 128]
                inputs, _, _, intent_pos, _ = self._tensors(batch, None)
                hidden = self._hidden(inputs)
                rows = torch.arange(len(batch))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = self.model.lm_head(hidden[rows, intent_pos - 1]).float()
                parts.append(logits[:, self.label_ids])
        self.model.train()
        return torch.cat(parts).numpy()

    def fold_temperature(self, temperature: float) -> None:
        """Divide the intent tokens' logits by `temperature` for good: their output-weight rows are scaled,
        so the exported model serves calibrated label probabilities with no change to the engine (the engine
        renormalises over the labels; an intent's argmax is unchanged)."""
        with self.torch.no_grad():
            self.model.lm_head.weight[self.label_ids] /= temperature

    def fit(
        self,
        train: list[Example],
        until: float,
        reserve_steps: float,
        progress: Callable[[int, int], None] | None,
    ) -> dict[str, Any]:
        """Train until `until` (time.monotonic()) at the latest, less `reserve_steps` steps' worth of time
        kept for what follows (the validation pass): the number of steps is the smaller of `max_epochs`
        epochs and what the time left allows at the step time measured so far, re-estimated every 25 steps
        (the cosine schedule is stretched or shrunk with it, so it always ends at the last step)."""
        torch = self.torch
        recipe = self.recipe
        rng = random.Random(self.seed)
        steps_per_epoch = math.ceil(len(train) / recipe.batch_size)
        cap = max(recipe.min_planned_steps, recipe.max_epochs * steps_per_epoch)
        plan = {"total": cap, "warmup": min(recipe.warmup_steps, max(1, cap // 10))}
        decay: list[Any] = []
        no_decay: list[Any] = []
        for name, param in self.model.named_parameters():
            (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": recipe.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=recipe.lr,
            betas=(0.9, 0.98),
        )

        def lr_at(step: int) -> float:
            warmup, total = plan["warmup"], plan["total"]
            if step < warmup:
                return (step + 1) / warmup
            done = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * done))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
        started = time.monotonic()
        step = 0
        running = 0.0
        epoch_batches: list[list[Example]] = []
        while step < plan["total"]:
            if not epoch_batches:
                epoch_batches = batches(train, recipe.batch_size, rng)
            loss = self.loss(epoch_batches.pop(), rng)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            running += loss.item()
            if step == recipe.min_steps or (step > recipe.min_steps and step % 25 == 0):
                per_step = (time.monotonic() - started) / step
                affordable = int((until - time.monotonic()) / per_step - reserve_steps)
                plan["total"] = max(step, recipe.min_steps, min(cap, step + affordable))
                plan["warmup"] = min(recipe.warmup_steps, max(1, plan["total"] // 10))
            if progress is not None:
                progress(step, plan["total"])
        seconds = time.monotonic() - started
        return {
            "steps": step,
            "epochs": round(step / steps_per_epoch, 2),
            "seconds": round(seconds, 1),
            "seconds_per_step": round(seconds / max(1, step), 3),
            "mean_loss": round(running / max(1, step), 4),
        }


def save_hf_folder(hf_dir: Path, tokenizer: Any, model: Any, taxonomy_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token=EOS, pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(hf_dir)
    model.save_pretrained(hf_dir, safe_serialization=True)
    model.generation_config.save_pretrained(hf_dir)
    shutil.copyfile(taxonomy_path, hf_dir / "taxonomy.toml")


def check_parity(model_dir: Path, builder: PromptBuilder, hf_tokenizer: Any, texts: Sequence[str]) -> None:
    """ORT GenAI must encode every rendered prompt exactly as the trainer did, and the prefix/suffix split
    must not change the tokens."""
    from worker.inference.genai import og  # with its telemetry off (worker/inference/__init__.py)

    tokenizer = og.Tokenizer(og.Model(str(model_dir)))
    prefix = list(tokenizer.encode(builder.prefix))
    for text in texts:
        ticket = builder.prepare(text)
        full = builder.full(ticket) + INTENT_OPENING
        expected = hf_tokenizer.encode(full, add_special_tokens=False).ids
        got = list(tokenizer.encode(full))
        split = prefix + list(tokenizer.encode(builder.suffix(ticket) + INTENT_OPENING))
        if got != expected or split != expected:
            raise RuntimeError(f"ORT GenAI tokenizer parity failed on {text!r}")


def served_answers(model_dir: Path, texts: Sequence[str]) -> list[tuple[str, float]]:
    """(intent, confidence) for each of `texts`, as the engine serves an exported folder in `score` mode
    (one thread): the chosen intent and its renormalised probability."""
    from worker.inference.engine import GenAIEngine
    from worker.inference.loading import resolve_taxonomy
    from worker.settings import InferenceSettings

    settings = InferenceSettings(
        model=str(model_dir), taxonomy=str(model_dir / "taxonomy.toml"), mode="score", escalation="off"
    )
    context = GenAIEngine(settings, *resolve_taxonomy(settings)).new_context("score")
    answers = []
    for text in texts:
        distribution = context.label_distribution(text)
        chosen = max(distribution, key=lambda label: distribution[label])
        answers.append((chosen, distribution[chosen]))
    return answers


def served_figures(model_dir: Path, rows: Sequence[tuple[str, str]]) -> tuple[float, float]:
    """(accuracy, ECE) of an exported folder on `rows`, as the engine serves it (`served_answers`)."""
    from worker.learning.evaluation import expected_calibration_error

    answers = served_answers(model_dir, [text for text, _ in rows])
    correct = [chosen == intent for (chosen, _), (_, intent) in zip(answers, rows, strict=True)]
    return sum(correct) / len(rows), expected_calibration_error([c for _, c in answers], correct)


def _export_seconds(parameters: int) -> float:
    """What the export, the parity check and loading the folder take, estimated from the model's size
    (measured on the shared 2-core machine: 9-12 s for 0.2 to 9.4 M parameters, int4, at a load average
    of 3 to 8 from other jobs; the builder's start-up, which imports torch, is most of it)."""
    return 15.0 + 1.5e-6 * parameters


def train_first_stage(
    labelled: Sequence[tuple[str, str]],
    validation: Sequence[tuple[str, str]],
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    teacher: Teacher | None,
    out_dir: Path,
    *,
    unlabelled: Sequence[str] = (),
    max_seconds: float,
    seed: int = 77,
    progress: Callable[[int, int], None] | None = None,
    shape: Shape | None = None,
    recipe: Recipe | None = None,
    precision: Precision = "int4",
    log: Callable[[str], None] | None = None,
) -> FirstStageReport:
    """Train the first stage on `labelled` and write it to `out_dir` as a complete ORT GenAI folder
    (genai_config.json, model.onnx(.data), tokenizer files, chat template, taxonomy.toml,
    trained_labels.json, training.json) within `max_seconds`, export included. See the module's docstring.

    `shape` and `recipe` default to `Shape()` and `Recipe()`; `log` gets one line per phase."""
    started = time.monotonic()
    import numpy as np
    import torch

    from worker.learning.evaluation import fit_temperature, stratified_split
    from worker.learning.export import export_model

    deadline = started + max_seconds
    shape = shape or Shape()
    recipe = recipe or Recipe()
    say = log or (lambda _line: None)
    phases: dict[str, float] = {}
    notes: list[str] = []
    labels = list(taxonomy.labels)
    known = set(labels)
    unknown = sorted({intent for _, intent in (*labelled, *validation)} - known)
    if unknown:
        raise ValueError(f"intents not in the taxonomy: {', '.join(unknown[:10])}")
    if not labelled:
        raise ValueError("no labelled rows to train on")
    torch.set_num_threads(recipe.threads)

    # 1. Validation rows, and the few-shot adaptations.
    train_rows = list(labelled)
    val_rows = list(validation)
    counts = Counter(intent for _, intent in train_rows)
    few_shot = len(train_rows) / len(labels) < recipe.few_shot_rows
    if not val_rows and min(counts.get(label, 0) for label in labels) >= recipe.min_rows_to_hold_out:
        train_rows, val_rows = stratified_split(train_rows, lambda row: row[1], recipe.val_fraction, seed)
        notes.append(f"validation: {len(val_rows)} rows held out of labelled (stratified)")
    if few_shot:
        wanted = math.ceil(recipe.min_examples / len(train_rows)) - 1
        recipe = replace(
            recipe,
            copies=max(recipe.copies, min(recipe.few_shot_copies, wanted)),
            teacher_weight=recipe.few_shot_teacher_weight,
        )
        notes.append(
            f"few-shot ({len(train_rows) / len(labels):.1f} rows per intent): {recipe.copies} copies per "
            f"row, teacher weight {recipe.teacher_weight}"
        )
    missing = [label for label in labels if not counts.get(label)]
    if missing:
        notes.append(f"{len(missing)} intents have no labelled row (learnt from the teacher only, if any)")

    # 2. Teacher, in its share of the budget at its measured speed. What it labels, in order of value:
    # unlabelled tickets (real phrasings the labels do not cover), augmented copies, then the labelled rows
    # (the head was fit on them, so there it mostly repeats the label). A copy it has no time for takes its
    # original's probabilities; a row it has no time for keeps the smoothed hard label alone.
    mark = time.monotonic()
    copies_rng = random.Random(seed + 1)
    copies = [
        (augment(text, copies_rng, recipe.word_dropout, recipe.swap_prob), intent)
        for _ in range(recipe.copies)
        for text, intent in train_rows
    ]
    soft_train = soft_copies = soft_unlabelled = None
    mix_train = 0.0
    mix_copies: list[float] = [0.0] * len(copies)
    unlabelled_rows: list[tuple[str, str]] = []
    texts = [text for text, _ in train_rows]
    if teacher is not None:
        count = len(labels)
        until = mark + recipe.teacher_share * max_seconds
        pool = list(unlabelled)
        random.Random(seed + 2).shuffle(pool)
        # Half the teacher's time at most for unlabelled tickets, the rest for copies, then the rows.
        soft_unlabelled = _label_within(teacher, pool, count, mark + (until - mark) / 2)
        pool = pool[: len(soft_unlabelled)]
        chosen = soft_unlabelled.argmax(axis=1)
        unlabelled_rows = [(text, labels[int(i)]) for text, i in zip(pool, chosen, strict=True)]
        if len(unlabelled) > len(pool):
            notes.append(f"unlabelled: {len(pool)} of {len(unlabelled)} labelled by the teacher in its time")
        labelled_copies = _label_within(teacher, [text for text, _ in copies], count, until)
        row_soft = _label_within(teacher, texts, count, until, at_least=min(len(texts), 64))
        if len(row_soft) == len(texts):
            soft_train, mix_train = row_soft, recipe.teacher_weight
        else:
            soft_train = np.zeros((len(texts), count), dtype=np.float32)
            notes.append("labelled rows: smoothed hard labels only (no teacher time left for them)")
        soft_copies = np.zeros((len(copies), count), dtype=np.float32)
        soft_copies[: len(labelled_copies)] = labelled_copies
        # A copy the teacher had no time for takes its original's probabilities (none if it has none).
        for index in range(len(labelled_copies), len(copies)):
            soft_copies[index] = soft_train[index % len(texts)]
        if len(labelled_copies) < len(copies):
            notes.append(
                f"copies: {len(labelled_copies)} of {len(copies)} labelled by the teacher in its time"
            )
        mix_copies = [
            recipe.teacher_weight if index < len(labelled_copies) or mix_train else 0.0
            for index in range(len(copies))
        ]
    elif unlabelled:
        notes.append("unlabelled tickets unused: there is no teacher to label them")
    phases["teacher"] = time.monotonic() - mark
    say(
        f"teacher: {phases['teacher']:.1f} s; {len(copies)} copies, {len(unlabelled_rows)} unlabelled tickets"
    )

    # 3. Tokenizer and examples.
    mark = time.monotonic()
    builder = PromptBuilder(taxonomy)
    rendered = [
        builder.training_text(builder.prepare(text), intent, taxonomy.policy_priority(intent))
        for text, intent in (*train_rows, *unlabelled_rows)
    ]
    tokenizer = train_tokenizer(rendered, taxonomy, shape.vocab_size)
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIALS}
    label_ids = [tokenizer.token_to_id(token) for token in label_tokens(taxonomy)]
    prefix_ids = tokenizer.encode(builder.prefix, add_special_tokens=False).ids
    train = encode_examples(train_rows, builder, tokenizer, label_ids, soft_train, mix_train)
    train += encode_examples(copies, builder, tokenizer, label_ids, soft_copies, mix_copies)
    if unlabelled_rows:
        train += encode_examples(unlabelled_rows, builder, tokenizer, label_ids, soft_unlabelled, 1.0)
    val = encode_examples(val_rows, builder, tokenizer, label_ids)
    phases["tokenizer"] = time.monotonic() - mark

    # 4. Training, in the time left after the reserved end phases.
    mark = time.monotonic()
    trainer = Trainer(shape, recipe, tokenizer.get_vocab_size(), prefix_ids, special_ids, label_ids, seed)
    parameters = trainer.parameters()
    # Served validation runs about 100 tickets/s; calibration's validation pass is reserved in `fit`.
    reserve = _export_seconds(parameters) + len(val_rows) / 100 + 5
    say(
        f"training: {len(train)} examples, {parameters / 1e6:.1f} M parameters, "
        f"{deadline - time.monotonic() - reserve:.0f} s to train"
    )
    # The validation pass (forward only, batches of 128) was measured at about one training step per
    # training batch of rows.
    result = trainer.fit(train, deadline - reserve, len(val) / recipe.batch_size, progress)
    phases["training"] = time.monotonic() - mark
    say(f"trained {result['steps']} steps ({result['epochs']} epochs) in {phases['training']:.0f} s")

    # 5. Calibration.
    mark = time.monotonic()
    if val:
        logits = trainer.label_logits(val)
        truth = np.array([e.label for e in val])
        result["torch_val_accuracy"] = float((logits.argmax(axis=1) == truth).mean())
        temperature = fit_temperature(logits, truth)
    elif teacher is not None:
        # No held-out truth: match the teacher's (calibrated) probabilities on copies the model never saw.
        fresh = [
            (augment(text, copies_rng, recipe.word_dropout, recipe.swap_prob), intent)
            for text, intent in train_rows[:500]
        ]
        fresh_soft = _teacher(teacher, [text for text, _ in fresh], len(labels))
        logits = trainer.label_logits(encode_examples(fresh, builder, tokenizer, label_ids))
        temperature = _fit_temperature_to(logits, fresh_soft)
        notes.append("calibrated to the teacher's probabilities (no validation rows)")
    else:
        temperature = 1.0
        notes.append("not calibrated: no validation rows and no teacher")
    trainer.fold_temperature(temperature)
    phases["calibration"] = time.monotonic() - mark

    # 6. Export, parity, served figures.
    mark = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="first-stage-") as tmp:
        hf_dir, export_dir = Path(tmp) / "hf", Path(tmp) / "export"
        hf_dir.mkdir()
        save_hf_folder(hf_dir, tokenizer, trainer.model, taxonomy_path)
        export_model(hf_dir, export_dir, precision, quiet=True)
        sample = [text for text, _ in (*train_rows, *val_rows)]
        check_parity(
            export_dir, builder, tokenizer, random.Random(seed).sample(sample, min(200, len(sample)))
        )
        phases["export"] = time.monotonic() - mark
        mark = time.monotonic()
        accuracy = ece = None
        if val_rows:
            accuracy, ece = served_figures(export_dir, val_rows)
        phases["served_validation"] = time.monotonic() - mark
        out_dir.mkdir(parents=True, exist_ok=True)
        size = 0
        for path in export_dir.iterdir():
            if path.is_file():
                shutil.copyfile(path, out_dir / path.name)
                size += path.stat().st_size
    seconds = time.monotonic() - started
    report = FirstStageReport(
        validation_accuracy=accuracy,
        ece=ece,
        seconds=round(seconds, 1),
        precision=precision,
        parameters=parameters,
        steps=result["steps"],
        epochs=result["epochs"],
        temperature=temperature,
        validation_rows=len(val_rows),
        train_examples=len(train),
        bytes=size,
        phases={k: round(v, 1) for k, v in phases.items()},
        notes=tuple(notes),
    )
    record = {
        "report": asdict(report),
        "shape": asdict(shape),
        "recipe": asdict(recipe),
        "seed": seed,
        "max_seconds": max_seconds,
        "labelled_rows": len(train_rows),
        "augmented_copies": len(copies),
        "unlabelled_rows": len(unlabelled_rows),
        "teacher": teacher is not None,
        "training": result,
    }
    (out_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    say(
        f"first stage: {report.seconds:.0f} s, validation accuracy "
        f"{'n/a' if accuracy is None else f'{accuracy:.4f}'}, ECE {'n/a' if ece is None else f'{ece:.3f}'}"
    )
    return report


def _label_within(
    teacher: Teacher, texts: Sequence[str], labels: int, until: float, at_least: int = 0
) -> Any:
    """The teacher's probabilities for the first texts it labels before `until` (time.monotonic()), in
    chunks, and for at least `at_least` of them: (n, labels), n <= len(texts)."""
    import numpy as np

    parts = []
    done = 0
    while done < len(texts) and (done < at_least or time.monotonic() < until):
        chunk = texts[done : done + _TEACHER_CHUNK]
        parts.append(_teacher(teacher, chunk, labels))
        done += len(chunk)
    return np.concatenate(parts) if parts else np.zeros((0, labels), dtype=np.float32)


def _teacher(teacher: Teacher, texts: Sequence[str], labels: int) -> Any:
    """The teacher's probabilities for `texts`, checked: (len(texts), labels), rows summing to 1."""
    import numpy as np

    probabilities = np.asarray(teacher(texts), dtype=np.float32)
    if probabilities.shape != (len(texts), labels):
        raise ValueError(f"the teacher answered shape {probabilities.shape}, not {(len(texts), labels)}")
    sums = probabilities.sum(axis=1, keepdims=True)
    if not np.all(np.isfinite(probabilities)) or np.any(sums <= 0):
        raise ValueError("the teacher answered rows that are not probabilities")
    return probabilities / sums


def _fit_temperature_to(logits: Any, soft: Any) -> float:
    """Temperature (0.5 to 3) minimising the cross-entropy of softmax(logits / T) against `soft` targets."""
    import numpy as np

    def cross_entropy(temperature: float) -> float:
        scaled = logits / temperature
        scaled = scaled - scaled.max(axis=1, keepdims=True)
        log_probs = scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))
        return float(-(soft * log_probs).sum(axis=1).mean())

    return min((round(0.5 + 0.01 * i, 2) for i in range(251)), key=cross_entropy)
