#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, lint, type-check, pytest, then the wheel smoke test
# (the built wheel in fresh virtual environments). Extra arguments go to pytest (and run it alone, in order).
#
# Without arguments three jobs run side by side, since most of their time is waiting on servers, workers and
# installs: the worker, browser and tracker tests (their own Redis server, `collage serve` on SQLite, or worker
# processes), every other test, and the wheel smoke test. Each pytest session has its own COLLAGE_HOME and its own
# PostgreSQL database (tests/conftest.py), so they share nothing but the machine. The logs of the side jobs are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
if [ "$#" -gt 0 ]; then
  .venv/bin/python -m pytest "$@"
  bash scripts/wheel_smoke.sh
  exit 0
fi

side=(tests/test_workers.py tests/test_dashboard.py tests/test_dash_charts.py tests/test_dash_look.py
      tests/test_dash_ops.py tests/test_dash_rollouts.py tests/test_trackers.py)
ignore=()
for f in "${side[@]}"; do ignore+=("--ignore=$f"); done
logs=$(mktemp -d)
bash scripts/wheel_smoke.sh >"$logs/wheel.log" 2>&1 &
wheel=$!
.venv/bin/python -m pytest -p no:cacheprovider --durations=25 "${side[@]}" >"$logs/browser.log" 2>&1 &
browser=$!
status=0
.venv/bin/python -m pytest -p no:cacheprovider --durations=40 "${ignore[@]}" || status=1
wait "$browser" || status=1
echo "---- worker, browser and tracker tests"
cat "$logs/browser.log"
wait "$wheel" || status=1
echo "---- wheel smoke test"
cat "$logs/wheel.log"
exit "$status"
