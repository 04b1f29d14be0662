#!/usr/bin/env bash
# The main job, from a fresh machine: set up, check the synthetic multi-image dataset against the tiny model,
# then train the GRPO example (tiny Qwen2-VL on count-red, CPU, about a minute). Output: out/demo/ (replaced
# on every run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false

demo=out/demo
rm -rf "$demo"
mkdir -p "$demo"
.venv/bin/collage data check synth:count-red --model tiny:qwen2-vl --max-prompt-length 256
.venv/bin/collage train examples/grpo-count-red.yaml --out "$demo/grpo-count-red"
.venv/bin/python - "$demo/grpo-count-red" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
first = sum(r["reward"] for r in rows[:5]) / 5
last = sum(r["reward"] for r in rows[-5:]) / 5
print(f"mean reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f}")
PY
echo
echo "Run output: $demo/grpo-count-red/ (config.yaml, metrics.jsonl, samples.jsonl, images/, checkpoints/)"
