#!/usr/bin/env bash
# GPU figures for the inference part of `make bench`, on a lent H200 (device tool). Not yet run: no device
# machine has been lent to this project's tasks so far; docs/performance.md says so until its output is committed.
#
# Here, first: `bash ../shared/gpu/fetch_wheels.sh` and carry the chunks (recipe: ../shared/gpu/README.md).
# Then one device call from the project root:
#   bash /tmp/w/device_install.sh && bash tools/bench_gpu.sh
# It builds a random-weight model of Phi-4-mini's layer shapes (int4, ORT GenAI builder with -e cuda; the
# vocabulary is the test tokenizer's, so the LM head is smaller than Phi-4-mini's) and runs
# tools.bench_inference with --provider cuda: prefix reuse in score and generate mode vs a new Generator per
# ticket (the seed design), one context vs process pools, and static batches vs batch 1. Output in $OUT.
set -euo pipefail
. /tmp/w/env.sh
out=${OUT:-results}
mkdir -p "$out"
model=/tmp/phi4mini-shape-int4
[ -d "$model" ] || python3 -m tools.export_test_model --shape phi4-mini --provider cuda --out "$model"
python3 -m tools.bench_inference --model "$model" --provider cuda --requests 200 \
  --json "$out/bench-gpu.json" | tee "$out/bench-gpu.txt"
