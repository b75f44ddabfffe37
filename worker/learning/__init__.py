"""Learning: building model folders from a team's tickets (the `train` extra: torch, transformers,
tokenizers, onnx, onnx_ir, scikit-learn; none of them is a runtime dependency, so every module here imports
them inside its functions).

- `first_stage.train_first_stage`: the cascade's first stage, a small Llama (the `triage-mini`
  architecture) trained from scratch in a time budget, distilled from a teacher's intent probabilities, and
  exported as one self-contained ORT GenAI folder.
"""
