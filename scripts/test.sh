#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, lint, type-check, pytest, then the wheel smoke test
# (the built wheel in fresh virtual environments). Extra arguments go to pytest (and run it alone, in order).
#
# Without arguments eight jobs run side by side: four of tests that start processes (worker processes with their
# own Redis server, `collage serve` with Chromium, training and playground processes), two of slow in-process
# tests, the fast tier, and the type check followed by the wheel smoke test. What matters is that no job is left
# running alone at the end: the process tests mostly wait, the in-process ones are CPU-bound. Each pytest session
# has its own COLLAGE_HOME and its own PostgreSQL database (tests/conftest.py), so they share nothing but the
# machine. Each job's log is printed at the end, with its time.
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
# Module lists by kind. The process tests spend most of their time waiting (training runs, idle timeouts, a
# server down on purpose), so they are spread over several jobs; the in-process tests are CPU-bound.
workers=(tests/test_workers.py tests/test_trackers.py
         tests/test_multihost.py::test_a_killed_worker_host_s_run_resumes_on_the_other_host_from_the_bucket)
dashboard=(tests/test_dashboard.py tests/test_dash_charts.py tests/test_dash_look.py tests/test_dash_ops.py
           tests/test_dash_rollouts.py)
playground=(tests/test_dash_playground.py tests/test_shutdown.py tests/test_lifecycle.py tests/test_cli_runs.py
            tests/test_faults.py tests/test_replicas.py)
processes=(tests/test_dash_friction.py tests/test_dash_checkpoints.py tests/test_dash_eval.py tests/test_eval_e2e.py
           tests/test_export_worker.py tests/test_playground_worker.py
           tests/test_multihost.py::test_the_s3_server_down_for_30_seconds_mid_run_loses_nothing)
# the slow in-process tests that go through the API and the store (the rest train, generate and export)
slow_store=(tests/test_api.py tests/test_api_fuzz.py tests/test_roles.py tests/test_store_faults.py
            tests/test_data_door.py tests/test_api_hardening.py tests/test_large_data.py tests/test_check.py
            tests/test_packaging.py tests/test_export_jobs.py)
ignore=()
for f in "${workers[@]}" "${dashboard[@]}" "${playground[@]}" "${processes[@]}"; do
  ignore+=("--ignore=${f%%::*}")  # a test's module, not its id
done
slow_rest=("${ignore[@]}")
for f in "${slow_store[@]}"; do slow_rest+=("--ignore=$f"); done
logs=$(mktemp -d)
pids=()
names=()
# job NAME COMMAND...: runs beside the others, its output in $logs/NAME.log, its time on the log's last line
job() {
  local name=$1
  shift
  ( t=$SECONDS; status=0; "$@" >"$logs/$name.log" 2>&1 || status=$?
    echo "---- $name: exit $status after $((SECONDS - t)) s (finished $((SECONDS - started)) s in)" >>"$logs/$name.log"
    exit "$status" ) &
  pids+=($!)
  names+=("$name")
}
pytest_job() {
  local name=$1
  shift
  job "$name" .venv/bin/python -m pytest -p no:cacheprovider "$@"
}
checks() { bash scripts/typecheck.sh && bash scripts/wheel_smoke.sh; }
# Eight jobs share the two cores, so that no single job is left running alone at the end. The fast tier is what
# `pytest -m "not slow"` runs on a laptop. Coverage is measured by scripts/coverage.sh, not here: on 2 cores it
# adds about two minutes.
pytest_job "workers and trackers" --durations=15 "${workers[@]}"
pytest_job "dashboard" --durations=15 "${dashboard[@]}"
pytest_job "playground, shutdown and lifecycle" --durations=15 "${playground[@]}"
pytest_job "evaluation, export and friction" --durations=15 "${processes[@]}"
pytest_job "slow in-process tests: API and store" -m slow --durations=20 "${slow_store[@]}"
pytest_job "slow in-process tests: training" -m slow --durations=20 "${slow_rest[@]}"
pytest_job "fast tier (-m 'not slow')" -m "not slow" --durations=10 "${ignore[@]}"
job "type check (mypy), then the wheel smoke test" checks
status=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}" || status=1
  echo "==== ${names[$k]}"
  cat "$logs/${names[$k]}.log"
done
echo "---- all tests done after $((SECONDS - started)) s"
exit "$status"
