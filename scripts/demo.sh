#!/usr/bin/env bash
# The main job, from a fresh machine: set up, then build a tiny Qwen2-VL, write a synthetic multi-image
# dataset and check it against the model. Outputs land in out/demo/ (replaced on every run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

demo=out/demo
rm -rf "$demo"
mkdir -p "$demo"
.venv/bin/collage models build-tiny qwen2-vl --out "$demo/tiny-qwen2-vl"
.venv/bin/collage data synth count-red --rows 64 --min-images 0 --max-images 3 --out "$demo/count-red"
.venv/bin/collage data check "$demo/count-red" --model "$demo/tiny-qwen2-vl" --max-prompt-length 256
echo
echo "Demo output: $demo/ (tiny model in $demo/tiny-qwen2-vl, dataset in $demo/count-red/train.jsonl)"
