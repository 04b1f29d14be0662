#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, lint, type-check, pytest, then the wheel smoke test
# (the built wheel in fresh virtual environments). Extra arguments go to pytest (and run it alone, in order).
#
# Without arguments five jobs run side by side, since most of their time is waiting on servers, workers and
# installs: the worker, browser and tracker tests (their own Redis server, `collage serve` on SQLite, or worker
# processes), the serve, playground, export and shutdown tests, every other test, the type check and the wheel
# smoke test. Each pytest session has its own COLLAGE_HOME and its own PostgreSQL database (tests/conftest.py), so
# they share nothing but the machine. The logs of the side jobs are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# one thread per torch process: the jobs below already keep both cores busy, and a second intra-op thread there
# spins and contends more than it computes (tests/test_training.py: 27% more CPU for 10% less time alone)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# Collage's own modules byte-compiled once: pip compiled the installed packages, but the checkout (an editable
# install) is compiled by whichever process imports it first, and never cached where PYTHONDONTWRITEBYTECODE is
# set (CI machines set it); the tests start hundreds of processes, each 0.3-0.7 s of CPU slower without it
.venv/bin/python -m compileall -q -j 0 app worker training migrations >/dev/null
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$#" -gt 0 ]; then
  bash scripts/typecheck.sh
  .venv/bin/python -m pytest "$@"
  bash scripts/wheel_smoke.sh
  exit 0
fi

started=$SECONDS
# worker processes, Redis, `collage serve` and Chromium: most of their time is waiting, so they run beside the rest
side=(tests/test_workers.py tests/test_dashboard.py tests/test_dash_charts.py tests/test_dash_look.py
      tests/test_dash_ops.py tests/test_dash_rollouts.py tests/test_trackers.py
      tests/test_multihost.py::test_a_killed_worker_host_s_run_resumes_on_the_other_host_from_the_bucket)
processes=(tests/test_dash_playground.py tests/test_dash_friction.py tests/test_dash_checkpoints.py
           tests/test_dash_eval.py tests/test_eval_e2e.py tests/test_shutdown.py tests/test_export_worker.py
           tests/test_playground_worker.py tests/test_cli_runs.py tests/test_faults.py tests/test_lifecycle.py
           tests/test_replicas.py tests/test_multihost.py::test_the_s3_server_down_for_30_seconds_mid_run_loses_nothing)
ignore=()
for f in "${side[@]}" "${processes[@]}"; do ignore+=("--ignore=${f%%::*}"); done  # a test's module, not its id
logs=$(mktemp -d)
bash scripts/typecheck.sh >"$logs/typecheck.log" 2>&1 &  # one core for a minute: beside the tests, not before
typecheck=$!
bash scripts/wheel_smoke.sh >"$logs/wheel.log" 2>&1 &
wheel=$!
.venv/bin/python -m pytest -p no:cacheprovider --durations=25 "${side[@]}" >"$logs/browser.log" 2>&1 &
browser=$!
.venv/bin/python -m pytest -p no:cacheprovider --durations=25 "${processes[@]}" >"$logs/processes.log" 2>&1 &
processes_job=$!
status=0
# the fast tier first (what `pytest -m "not slow"` runs on a laptop), then the slow in-process tests. Coverage is
# measured by scripts/coverage.sh, not here: on 2 cores it adds about two minutes to a run that must stay under 20
echo "---- fast tier (-m 'not slow')"
.venv/bin/python -m pytest -p no:cacheprovider -m "not slow" --durations=10 "${ignore[@]}" || status=1
echo "---- fast tier done after $((SECONDS - started)) s; the slow in-process tests"
.venv/bin/python -m pytest -p no:cacheprovider -m slow --durations=40 "${ignore[@]}" || status=1
echo "---- in-process tests done after $((SECONDS - started)) s"
wait "$typecheck" || status=1
echo "---- type check (mypy)"
cat "$logs/typecheck.log"
wait "$browser" || status=1
echo "---- worker, browser and tracker tests"
cat "$logs/browser.log"
wait "$processes_job" || status=1
echo "---- serve, playground, export and shutdown tests"
cat "$logs/processes.log"
wait "$wheel" || status=1
echo "---- wheel smoke test"
cat "$logs/wheel.log"
echo "---- all tests done after $((SECONDS - started)) s"
exit "$status"
