#!/usr/bin/env bash
# The main job, from a fresh machine: set up, start `collage serve` (web app, API, one embedded worker; SQLite
# store and broker in out/demo-home) and submit the GRPO demo run (tiny Qwen2-VL on synthetic multi-image
# count-red, CPU; held-out accuracy from 0.00 at step 0 to about 0.7 in 1,500 steps, docs/demo.md). The run is
# training within a minute and ends in about 2.5 minutes; its progress shows here; the server keeps running
# for you to explore until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
export COLLAGE_HOME=${COLLAGE_HOME:-$PWD/out/demo-home}
PORT=${PORT:-8000}

.venv/bin/collage serve --port "$PORT" &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 120); do
  curl -fsS "http://127.0.0.1:$PORT/api/v1/health" >/dev/null 2>&1 && break
  sleep 0.5
done
# submit waits until serve's embedded worker takes runs (serve records its URL and readiness in COLLAGE_HOME)
.venv/bin/collage submit examples/grpo-count-red.yaml --server "http://127.0.0.1:$PORT" --follow || true
echo
echo "The server is still running: http://127.0.0.1:$PORT (API docs at /api/v1/docs, admin token in $COLLAGE_HOME/token)."
echo "A fresh one-time login link: COLLAGE_HOME=$COLLAGE_HOME .venv/bin/collage token link 'collage serve'"
echo "Its runs from here: COLLAGE_HOME=$COLLAGE_HOME .venv/bin/collage runs list (and runs logs RUN_ID, runs cancel RUN_ID)"
echo "Runs, metrics and rollouts are in $COLLAGE_HOME. Ctrl-C to stop."
wait $SERVER
