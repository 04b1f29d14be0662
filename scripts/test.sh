#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, lint, type-check, pytest, then the wheel smoke test
# (the built wheel in fresh virtual environments). Extra arguments go to pytest (and run it alone, in order).
#
# Without arguments six jobs run side by side: the worker, browser and tracker tests (their own Redis server,
# `collage serve` on SQLite, or worker processes), the serve, playground, export and shutdown tests, the slow and
# the fast in-process tests, the type check and the wheel smoke test. The run is CPU-bound on 2 cores, so what
# matters is that no job is left running alone at the end. Each pytest session has its own COLLAGE_HOME and its
# own PostgreSQL database (tests/conftest.py), so they share nothing but the machine. Each job's log is printed
# at the end, with its time.
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
# Six jobs share the two cores; the in-process tiers run beside each other rather than one after the other, so no
# single job is left running alone at the end. The fast tier is what `pytest -m "not slow"` runs on a laptop.
# Coverage is measured by scripts/coverage.sh, not here: on 2 cores it adds about two minutes.
pytest_job "slow in-process tests" -m slow --durations=40 "${ignore[@]}"
pytest_job "worker, browser and tracker tests" --durations=25 "${side[@]}"
pytest_job "serve, playground, export and shutdown tests" --durations=25 "${processes[@]}"
pytest_job "fast tier (-m 'not slow')" -m "not slow" --durations=10 "${ignore[@]}"
job "type check (mypy)" bash scripts/typecheck.sh
job "wheel smoke test" bash scripts/wheel_smoke.sh
status=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}" || status=1
  echo "==== ${names[$k]}"
  cat "$logs/${names[$k]}.log"
done
echo "---- all tests done after $((SECONDS - started)) s"
exit "$status"
