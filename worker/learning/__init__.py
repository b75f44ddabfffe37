"""Learning: the trainers that turn a team's tickets (or its taxonomy alone) into a model folder.

Library code inside the package, so that an installed `triage-worker` trains without a checkout: nothing here
looks for the repository's `data/` or `tools/`. `data` reads the tickets teams have (CSV, JSON lines, the
BANKING77 layout, FeedbackEvents); `encoder_stage` fits the cascade's escalation stage (a linear head over the
shipped sentence encoder, or zero-shot prototypes from the taxonomy's texts); `first_stage` trains the ORT
GenAI model; `compose` writes both into one self-contained folder. `worker/cli/model_command.py` and
`worker/cli/taxonomy_command.py` are their command lines.

The training libraries (the `train` extra: torch, transformers, tokenizers, onnx, onnx_ir, scikit-learn) are
no runtime dependency, so every module here imports them inside its functions.
"""
