"""The encoder stage: a sentence encoder run by plain onnxruntime, with a linear head over its embedding.

ORT GenAI serves decoders only and refuses WordPiece tokenizers, so a pretrained sentence encoder (here
all-MiniLM-L6-v2) runs with the `onnxruntime` package (installed with onnxruntime-genai; the `cuda` extra's
onnxruntime-gpu gives it CUDA) and the Hugging Face `tokenizers` library. Its folder (`encoder.json` marks
one) holds the tokenizer, the head (`head.npz`: weight LxD, bias L), the labels the head was trained for in
its row order with their fingerprint, and the taxonomy they come from; the ONNX encoder is in the folder too,
or, too large for the repository, in the user cache, where `triage-worker model fetch` resolves it with Maven
(worker/learning/artifacts.py). `model train --encoder` builds the folder (worker/learning/encoder_stage.py).

It fills the same `Classification` as the ORT GenAI engine (`confidence` is the head's calibrated
probability, blended with the vote of the nearest training tickets where the folder keeps them
(worker/inference/neighbours.py); `scores` the top labels; the priority the taxonomy's policy priority of
the intent), so any classifier pool runs it and the pipeline cannot tell the two apart. One ONNX call per
ticket cannot be stopped halfway: the deadline is checked before it (an encoder step is a few milliseconds).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import structlog

from worker.cache import cache_root
from worker.classification import Classification, ClassifyRequest, fallback_answer
from worker.errors import UserError
from worker.inference.loading import model_id
from worker.inference.neighbours import NeighbourVote
from worker.inference.out_of_scope import OutOfScopeDetector, read_statistics
from worker.inference.taxonomy import Taxonomy
from worker.messages import FallbackReason
from worker.settings import InferenceSettings

log = structlog.get_logger(__name__)

MANIFEST = "encoder.json"
# The folder, inside a model folder, of the encoder stage trained with it (`DIR/encoder/`, what `triage-worker
# model train` writes next to the first stage).
OWN_STAGE_DIR = "encoder"
TOP_K_SCORES = 5
# onnxruntime's name of each provider of the settings.
_ORT_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "dml": "DmlExecutionProvider",
}

FloatArray = npt.NDArray[np.float32]


class EncoderManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`encoder.json`: what the folder holds and what its head was trained for."""

    kind: Literal["sentence-encoder"]
    encoder: str  # the ONNX file's name, in the folder or in `cache`
    # When the folder does not hold the encoder: its folder under the user cache, the pom (relative to a
    # source checkout) that resolves the jar holding it, that jar's member, and the file's sha256.
    cache: str | None = None
    maven_pom: str | None = None
    jar_member: str | None = None
    encoder_sha256: str | None = None
    tokenizer: str = "tokenizer.json"
    head: str = "head.npz"
    # Tokens per ticket (special tokens included); longer tickets are cut and reported `truncated`.
    max_tokens: int = 128
    # Head rows, in order, and `ordered_labels_sha256` of them.
    labels: tuple[str, ...]
    labels_sha256: str
    # The out-of-scope statistics beside the head (worker/inference/out_of_scope.py), if training fitted them.
    out_of_scope: str | None = None
    # Divides the head's logits before the softmax (fitted out of fold at training: calibrated confidence).
    temperature: float = 1.0
    # Where the encoder came from and how it was reduced (for the model card; not read at run time).
    source: dict[str, str] = msgspec.field(default_factory=dict)


def ordered_labels_sha256(labels: Sequence[str]) -> str:
    """sha256 of the labels in order, one a line: a model folder's record of the taxonomy it knows."""
    return hashlib.sha256("\n".join(labels).encode("utf-8")).hexdigest()


def is_encoder_folder(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def encoder_stage_only(folder: Path) -> Path | None:
    """The encoder stage that serves as the model of a `model train` folder written without its first stage
    (no `train` extra: no genai_config.json, the stage in `DIR/encoder/`); None for any other folder. Its
    card says `classify --model DIR` and `run --model DIR` take it whole, so `DIR` serves that stage (its
    records say `DIR`'s name, and no cascade runs over the stage itself)."""
    if (folder / "genai_config.json").is_file() or is_encoder_folder(folder):
        return None
    stage = folder / OWN_STAGE_DIR
    return stage if is_encoder_folder(stage) else None


def serves_encoder_stage(folder: Path) -> bool:
    """Whether `folder` is served by an `EncoderEngine`: an encoder stage, or a folder with only one."""
    return is_encoder_folder(folder) or encoder_stage_only(folder) is not None


def read_manifest(folder: Path) -> EncoderManifest:
    try:
        manifest = msgspec.json.decode((folder / MANIFEST).read_bytes(), type=EncoderManifest)
    except (OSError, msgspec.DecodeError) as error:
        raise UserError(f"{folder / MANIFEST}: {error}") from None
    if ordered_labels_sha256(manifest.labels) != manifest.labels_sha256:
        raise UserError(f"{folder / MANIFEST}: labels_sha256 does not match its labels (edited by hand?)")
    return manifest


def out_of_scope_promise(folder: Path) -> float | None:
    """The share of new in-scope tickets the out-of-scope detector of the encoder stage `folder` serves
    (itself, or a `model train` folder's only stage) was fitted to flag at most: what its card promises and
    the worker's `triage_out_of_scope_expected_ratio` exports. None where no such detector is (another
    kind of folder, none fitted, or one the engine could not read either: it would not serve)."""
    stage = folder if is_encoder_folder(folder) else encoder_stage_only(folder)
    if stage is None:
        return None
    try:
        statistics = read_manifest(stage).out_of_scope
        if statistics is None:
            return None
        with np.load(stage / statistics, allow_pickle=False) as stored:  # one member read, not the rows
            return round(float(stored["in_scope_loss"]), 6)  # stored as float32: 0.02, not 0.0199999996
    except (UserError, OSError, KeyError, ValueError):
        return None


def encoder_file(folder: Path, manifest: EncoderManifest) -> Path:
    """The ONNX encoder: in the folder, else in the user cache where `triage-worker model fetch` puts it."""
    candidates = [folder / manifest.encoder]
    if manifest.cache is not None:
        cached = cache_root() / manifest.cache
        if (cached / ".complete").is_file():
            candidates.append(cached / manifest.encoder)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UserError(
        f"{folder}: its encoder {manifest.encoder} is not downloaded yet: run `triage-worker model fetch` "
        "once (it uses Maven; `make setup` does it), or put the file into the folder"
    )


def mean_pool(states: npt.NDArray[Any], mask: npt.NDArray[Any]) -> FloatArray:
    """Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2: the mean of the
    token states over the attention mask, L2-normalised. `states` (B, S, D), `mask` (B, S) of 0/1."""
    weights = mask[:, :, None].astype(np.float32)
    pooled = (states * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    normalised: FloatArray = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return normalised.astype(np.float32)


def _module(name: str) -> Any:
    if importlib.util.find_spec(name) is None:
        raise UserError(f"the encoder stage needs the `{name}` package: pip install {name}")
    return importlib.import_module(name)


class SentenceEmbedder:
    """An ONNX sentence encoder (inputs input_ids, attention_mask and maybe token_type_ids; first output the
    token states) and its `tokenizers` tokenizer: texts → normalised embeddings. Also the teacher's
    embedder in `model eval` and training."""

    def __init__(
        self,
        onnx_file: Path,
        tokenizer_file: Path,
        threads: int,
        provider: str = "cpu",
        max_tokens: int = 128,
    ) -> None:
        onnxruntime = _module("onnxruntime")
        # As for ORT GenAI (worker/inference/genai.py): the library's switch, besides the variable.
        onnxruntime.disable_telemetry_events()
        tokenizers = _module("tokenizers")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        name = _ORT_PROVIDERS[provider]
        if name not in onnxruntime.get_available_providers():
            raise UserError(
                f"the encoder stage asks for {name}, which this onnxruntime build lacks "
                f"(it has {', '.join(onnxruntime.get_available_providers())})"
            )
        try:
            self._session = onnxruntime.InferenceSession(str(onnx_file), options, providers=[name])
        except Exception as error:  # onnxruntime raises its own exception types for a bad file
            raise UserError(f"cannot load the encoder {onnx_file}: {str(error).splitlines()[0]}") from None
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        self._tokenizer.enable_truncation(max_tokens)
        # Pad a batch to its longest text only (packaged tokenizers pad every text to their maximum): the
        # same embeddings, the pad positions being masked out, for a fraction of the work.
        self._tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.max_tokens = max_tokens
        # The embedding width: the token states' last dimension (384 for the shipped encoder).
        self.dimensions = int(self._session.get_outputs()[0].shape[-1])

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> FloatArray:
        """(len(texts), D) normalised embeddings, `batch_size` texts per encoder call."""
        parts = [self.embed_batch(texts[i : i + batch_size])[0] for i in range(0, len(texts), batch_size)]
        return np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)

    def embed_batch(self, texts: Sequence[str]) -> tuple[FloatArray, list[bool]]:
        """One encoder call: the texts' embeddings, and for each whether it was cut to `max_tokens`."""
        encodings = self._tokenizer.encode_batch(list(texts))
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        states = self._session.run(None, {k: v for k, v in feeds.items() if k in self._inputs})[0]
        return mean_pool(states, feeds["attention_mask"]), [bool(e.overflowing) for e in encodings]


class EncoderEngine:
    """A loaded encoder stage: embedder, head and taxonomy; `new_context` as the ORT GenAI `GenAIEngine` has.
    `taxonomy` from `taxonomy_path` is the stage's, as resolved where it is assembled (for a cascade's stage,
    the first stage's); a UserError when the head was not trained for all of its labels."""

    def __init__(self, settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path) -> None:
        self.settings = settings
        given = Path(settings.model).expanduser()
        folder = encoder_stage_only(given) or given
        manifest = read_manifest(folder)
        self.taxonomy = taxonomy
        self.taxonomy_path = taxonomy_path
        unknown = sorted(set(self.taxonomy.labels) - set(manifest.labels))
        if unknown:
            raise UserError(
                f"{folder}: its head was trained for {len(manifest.labels)} labels, without "
                f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} of {self.taxonomy_path}"
            )
        self.model_id = model_id(given)  # a folder with only an encoder stage: the folder's own name
        self.labels = manifest.labels
        self._labels_known = np.array([label in self.taxonomy.labels for label in manifest.labels])
        try:
            head = np.load(folder / manifest.head, allow_pickle=False)
            self._weight = np.asarray(head["weight"], dtype=np.float32)
            self._bias = np.asarray(head["bias"], dtype=np.float32)
        except (OSError, KeyError, ValueError) as error:
            raise UserError(f"cannot read the head {folder / manifest.head}: {error}") from None
        if self._weight.shape[0] != len(manifest.labels) or self._bias.shape != (len(manifest.labels),):
            raise UserError(f"{folder / manifest.head}: its shape does not fit {len(self.labels)} labels")
        self._temperature = manifest.temperature
        self.embedder = SentenceEmbedder(
            encoder_file(folder, manifest),
            folder / manifest.tokenizer,
            settings.intra_op_num_threads,
            settings.provider,
            manifest.max_tokens,
        )
        self.out_of_scope: OutOfScopeDetector | None = None
        self.vote: NeighbourVote | None = None
        if manifest.out_of_scope is not None:
            self.out_of_scope, self.vote = read_statistics(
                folder / manifest.out_of_scope, self.embedder.dimensions, len(manifest.labels)
            )

    def new_context(self, mode: object = None) -> EncoderContext:
        """A context: stateless here (the session is shared), kept for the pools' one interface."""
        return EncoderContext(self)

    def fallback(self, reason: FallbackReason, started: float) -> Classification:
        latency_ms = (time.monotonic() - started) * 1000.0
        return fallback_answer(reason, self.taxonomy.fallback_label, self.model_id, latency_ms)

    def classify_batch(self, requests: Sequence[ClassifyRequest]) -> list[Classification]:
        """Classify several tickets in one encoder call (a batching pool); never raises. Requests already
        past their deadline are answered `overloaded` without running."""
        started = time.monotonic()
        live = [r for r in requests if r.deadline > started]
        answers: dict[int, Classification] = {}
        if live:
            try:
                embeddings, truncated = self.embedder.embed_batch([r.text for r in live])
                # One product with the training rows serves the neighbour vote and the out-of-scope distance
                # alike: both read the rows of one file (`read_statistics`).
                similarities = (
                    None if self.out_of_scope is None else embeddings @ self.out_of_scope.reference.T
                )
                probabilities = self._probabilities(embeddings, similarities)
                scope_scores = (
                    None
                    if self.out_of_scope is None or similarities is None
                    else self.out_of_scope.scores_from_similarities(similarities, probabilities.max(axis=1))
                )
            except Exception:
                log.exception("encoder error", requests=len(live))
                answers = {r.request_id: self.fallback("model_error", started) for r in live}
            else:
                latency_ms = (time.monotonic() - started) * 1000.0
                for row, (request, probs, cut) in enumerate(zip(live, probabilities, truncated, strict=True)):
                    answer = self._answer(probs, cut, latency_ms)
                    if scope_scores is not None:
                        answer = self._scoped(answer, float(scope_scores[row]))
                    answers[request.request_id] = answer
        return [answers.get(r.request_id) or self.fallback("overloaded", started) for r in requests]

    def _probabilities(self, embeddings: FloatArray, similarities: FloatArray | None) -> FloatArray:
        """The head's calibrated probabilities, blended with the neighbour vote where the folder has one
        (`similarities`: the tickets' with the rows it reads)."""
        logits = (embeddings @ self._weight.T + self._bias) / self._temperature
        # Labels the taxonomy does not have are never answered: the rest is renormalised.
        logits = np.where(self._labels_known, logits, -np.inf)
        shifted = logits - logits.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        probabilities: FloatArray = exp / exp.sum(axis=1, keepdims=True)
        if self.vote is None:
            return probabilities
        assert similarities is not None, "a vote comes with the detector whose rows it reads"
        votes = self.vote.votes_from_similarities(similarities, self._labels_known)
        return self.vote.blend(probabilities, votes)

    def _answer(self, probs: FloatArray, truncated: bool, latency_ms: float) -> Classification:
        order = np.argsort(-probs)[:TOP_K_SCORES]
        intent = self.labels[int(order[0])]
        return Classification(
            intent=intent,
            priority=self.taxonomy.policy_priority(intent),
            confidence=float(probs[order[0]]),
            scores={self.labels[int(i)]: float(probs[i]) for i in order},
            model=self.model_id,
            latency_ms=latency_ms,
            truncated=truncated,
        )

    def _scoped(self, answer: Classification, score: float) -> Classification:
        """`answer` with its out-of-scope score; past the threshold, the taxonomy's out-of-scope intent
        instead, the head's answer kept as the nearest intent."""
        assert self.out_of_scope is not None
        if score <= self.out_of_scope.threshold:
            return msgspec.structs.replace(answer, out_of_scope_score=score)
        intent = self.taxonomy.out_of_scope_label
        return msgspec.structs.replace(
            answer,
            intent=intent,
            priority=self.taxonomy.policy_priority(intent),
            confidence=0.0,
            out_of_scope=True,
            out_of_scope_score=score,
            nearest_intent=answer.intent,
            nearest_confidence=answer.confidence,
        )


class EncoderContext:
    """Classifies one ticket at a time with its engine (the `Context` interface of the pools)."""

    def __init__(self, engine: EncoderEngine) -> None:
        self.engine = engine

    def classify(self, request: ClassifyRequest) -> Classification:
        return self.engine.classify_batch([request])[0]
