#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set up, lint, type-check, pytest, then the wheel smoke test
# (the built wheel in fresh virtual environments). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
.venv/bin/python -m pytest "$@"
bash scripts/wheel_smoke.sh
