#!/usr/bin/env bash
# The CUDA path, proven in one device call on a lent H100/H200 (device tool). Not yet run: no device machine
# has been lent to this project's tasks so far; docs/performance.md says so until its output is committed.
#
# Here, first: `bash ../shared/gpu/fetch_wheels.sh` and carry the chunks (recipe: ../shared/gpu/README.md).
# Then one device call from the project root:
#   bash /tmp/w/device_install.sh && bash tools/bench_gpu.sh
# 1. It builds a random-weight model of Phi-4-mini's layer shapes (int4, ORT GenAI builder with -e cuda; the
#    vocabulary is the test tokenizer's, so the LM head is smaller than Phi-4-mini's): no hub there, and speed
#    does not depend on the weights' values. A published model's folder (`triage-worker model import ...
#    --provider cuda --precision fp16|int4`, built here) is too large to carry (64 MiB a call).
# 2. tools.bench_inference --provider cuda: prefix reuse in score and generate mode vs a new Generator per
#    ticket (the seed design), one context vs process pools, static batches vs batch 1.
# 3. The worker's own door, `triage-worker classify`, on the 154 sample tickets in score mode, generate mode
#    and generate mode through the batch pool: every record valid, none a fallback, tickets/s in its summary.
# Output in $OUT (bench-gpu.json, bench-gpu.txt, classify-*.jsonl and .txt).
set -euo pipefail
. /tmp/w/env.sh
out=${OUT:-results}
mkdir -p "$out"
model=/tmp/phi4mini-shape-int4
[ -d "$model" ] || python3 -m tools.export_test_model --shape phi4-mini --provider cuda --out "$model"
python3 -m tools.bench_inference --model "$model" --provider cuda --requests 200 \
  --json "$out/bench-gpu.json" | tee "$out/bench-gpu.txt"
tickets=/tmp/sample-tickets.jsonl
python3 -c 'import csv, json, sys
for i, row in enumerate(csv.DictReader(open("worker/dev/sample_tickets.csv", encoding="utf-8"))):
    print(json.dumps({"ticket_id": f"s{i}", "body": row["text"]}))' > "$tickets"
for run in score generate generate-batch; do
  mode=${run%%-*}
  pool=process; [ "$run" = generate-batch ] && pool=batch
  python3 -m worker classify --model "$model" --provider cuda --taxonomy tests/models/tiny/taxonomy.toml \
    --mode "$mode" --input "$tickets" --output "$out/classify-$run.jsonl" --deadline-ms 10000 \
    --set inference.escalation=off --set "inference.pool=$pool" 2>&1 | tail -5 | tee "$out/classify-$run.txt"
  python3 -c 'import json, sys
records = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
fallbacks = [r["fallback_reason"] for r in records if r["fallback"]]
bad = [r for r in records if not 0.0 < r["confidence"] <= 1.0 and not r["fallback"]]
print(f"{sys.argv[1]}: {len(records)} records, {len(fallbacks)} fallbacks {sorted(set(fallbacks))}, {len(bad)} confidences outside (0, 1]")
sys.exit(1 if len(records) != 154 or fallbacks or bad else 0)' "$out/classify-$run.jsonl" | tee -a "$out/classify-$run.txt"
done
