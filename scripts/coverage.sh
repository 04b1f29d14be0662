#!/usr/bin/env bash
# Coverage of the collage package by the fast tier (`pytest -m "not slow"`), printed per module with the lines
# never run. Not part of CI's test command: on a 2-core machine it adds about two minutes to the run.
# Extra arguments go to pytest (e.g. a test file, or `-m ""` for every in-process test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -p no:cacheprovider -m "not slow" --cov=collage --cov-report=term:skip-covered "$@"
