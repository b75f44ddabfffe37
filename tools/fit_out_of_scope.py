"""Fit the out-of-scope detector and neighbour vote of an existing encoder-stage folder trained on
BANKING77-format data.

    python -m tools.fit_out_of_scope models/triage-encoder     # the shipped stage, from data/banking77

`model train` fits the detector with every folder it writes (worker/learning/out_of_scope.py); this gives one
to a folder written before, without touching its head: the statistics are the embeddings of the tickets the
head learnt from (train.csv minus the usual validation split, `stratified_split` with `--seed`, as the
shipped head was fitted) and the taxonomy's texts, with each one's intent for the neighbour vote
(worker/inference/neighbours.py); the weight of the stage's doubt is chosen on stand-in intents, the
threshold on the validation split for `--in-scope-loss`, both with the vote as served. Writes
`out_of_scope.npz`, names it in `encoder.json`, records the reports in `training.json` under `out_of_scope`
and `neighbour_vote` (the validation accuracy with and without it), and prints the model card's paragraph
(README.md is the folder's own prose: paste it there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import msgspec
import numpy as np

from tools import REPO
from worker.inference.encoder import MANIFEST, read_manifest
from worker.inference.neighbours import NeighbourVote
from worker.inference.out_of_scope import OUT_OF_SCOPE_FILE, write_statistics
from worker.inference.taxonomy import load_taxonomy
from worker.learning import encoder_stage
from worker.learning.compose import out_of_scope_paragraph
from worker.learning.evaluation import VALIDATION_SEED, read_examples, stratified_split
from worker.learning.folders import TRAINING_FILE
from worker.learning.out_of_scope import DEFAULT_IN_SCOPE_LOSS, fit_out_of_scope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="an encoder-stage folder (encoder.json, head.npz)")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "banking77" / "train.csv")
    parser.add_argument("--in-scope-loss", type=float, default=DEFAULT_IN_SCOPE_LOSS)
    parser.add_argument("--seed", type=int, default=VALIDATION_SEED, help="the head's validation split seed")
    args = parser.parse_args(argv)
    folder: Path = args.folder
    manifest = read_manifest(folder)
    taxonomy = load_taxonomy(folder / "taxonomy.toml")
    if list(taxonomy.labels) != list(manifest.labels):
        print(f"{folder}: taxonomy.toml's intents are not the head's rows", file=sys.stderr)
        return 1
    rows = [(e.text, e.intent) for e in read_examples(args.data, taxonomy)]
    train, validation = stratified_split(rows, lambda row: row[1], seed=args.seed)
    texts = [(text, i) for i, own in enumerate(encoder_stage.intent_texts(taxonomy)) for text in own]
    embedder = encoder_stage.open_embedder()
    stored = np.load(folder / manifest.head, allow_pickle=False)
    index = {label: i for i, label in enumerate(taxonomy.labels)}
    reference = encoder_stage.embed(embedder, [text for text, _ in train] + [text for text, _ in texts])
    intents = [index[intent] for _, intent in train] + [i for _, i in texts]
    vote = NeighbourVote(reference, np.asarray(intents, dtype=np.int32), len(index))
    head = encoder_stage.LinearHead(stored["weight"], stored["bias"], manifest.temperature, vote=vote)
    held = encoder_stage.embed(embedder, [text for text, _ in validation])
    held_intents = [index[intent] for _, intent in validation]
    detector, report = fit_out_of_scope(
        reference,
        intents,
        [True] * len(train) + [False] * len(texts),
        held,
        held_intents,
        in_scope_loss=args.in_scope_loss,
        seed=args.seed,
        doubt=head.doubt,
        fit_doubt=encoder_stage.doubt_fitter(manifest.temperature, args.seed, balanced=False),
    )
    write_statistics(folder / OUT_OF_SCOPE_FILE, detector, vote)
    without_vote = dataclasses.replace(head, vote=None)
    accuracies = {
        name: encoder_stage.measure(stage.probabilities(held), held_intents)[0]
        for name, stage in (("head", without_vote), ("with_vote", head))
    }
    updated = msgspec.structs.replace(manifest, out_of_scope=OUT_OF_SCOPE_FILE)
    (folder / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(updated)) + b"\n")
    training_file = folder / TRAINING_FILE
    training = json.loads(training_file.read_text(encoding="utf-8")) if training_file.is_file() else {}
    training["out_of_scope"] = report.as_dict()
    training["neighbour_vote"] = {
        "neighbours": vote.neighbours,
        "temperature": vote.temperature,
        "weight": vote.weight,
        "validation_accuracy_head_alone": accuracies["head"],
        "validation_accuracy": accuracies["with_vote"],
    }
    training_file.write_text(json.dumps(training, indent=2) + "\n", encoding="utf-8")
    size = (folder / OUT_OF_SCOPE_FILE).stat().st_size
    print(f"wrote {folder / OUT_OF_SCOPE_FILE} ({size / 1e6:.1f} MB), {MANIFEST}, {TRAINING_FILE}")
    print(
        f"validation accuracy {accuracies['head']:.2%} with the head alone, {accuracies['with_vote']:.2%} "
        f"with the vote of the {vote.neighbours} nearest training rows"
    )
    print(out_of_scope_paragraph(report.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
