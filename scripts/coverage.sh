#!/usr/bin/env bash
# Coverage of the collage package by the fast tiers (tests/unit and tests/store), printed per module with the
# lines never run. Not part of CI's test command: on a 2-core machine it adds minutes to the run.
# Arguments replace the folders (e.g. `tests/unit tests/store tests/training` for every in-process test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ "$#" -gt 0 ] || set -- tests/unit tests/store
exec .venv/bin/python -m pytest -p no:cacheprovider --cov=collage --cov-report=term:skip-covered "$@"
