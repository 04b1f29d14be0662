#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, lint, type-check, pytest, then the wheel smoke test
# (the built wheel in fresh virtual environments). Extra arguments go to pytest (and run it alone, in order).
#
# Without arguments three jobs run side by side, one per group of tier folders (tests/support/tiers.py says what
# each tier may use): the in-process tiers (tests/unit, tests/store, tests/training), then the type check and the
# wheel smoke test; the process tests (tests/processes); the browser tests (tests/browser). Three jobs on two
# cores leave each test most of a core: every deadline in the suite is a condition's bound (tests/support/
# waiting.py), never a guess at how long a loaded machine takes. Each pytest session has its own COLLAGE_HOME and
# its own PostgreSQL database (tests/conftest.py), so they share nothing but the machine. Each job's log is
# printed at the end, with its time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# one thread per torch process: the jobs below already keep both cores busy, and a second intra-op thread there
# spins and contends more than it computes (the training tests: 27% more CPU for 10% less time alone)
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
pytest_run() { .venv/bin/python -m pytest -p no:cacheprovider --durations=25 "$@"; }
# the in-process tiers are the shortest job: the type check and the wheel smoke test follow them in it
in_process() { pytest_run tests/unit tests/store tests/training && bash scripts/typecheck.sh && bash scripts/wheel_smoke.sh; }
job in-process in_process  # tests/unit, tests/store, tests/training; then mypy and the wheel smoke test
job processes pytest_run tests/processes
job browser pytest_run tests/browser
status=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}" || status=1
  echo "==== ${names[$k]}"
  cat "$logs/${names[$k]}.log"
done
echo "---- all tests done after $((SECONDS - started)) s"
exit "$status"
