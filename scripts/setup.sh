#!/usr/bin/env bash
# Creates .venv and installs Collage with its dev extra. Idempotent: a second run with an unchanged
# pyproject.toml only checks the stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "Collage needs Python >= 3.10 (found $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi

stamp=.venv/.collage-install-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/collage ]; then
  exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch/torchvision come with lower bounds only: pip takes whatever build the machine offers (CPU or CUDA).
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "$want" > "$stamp"
echo "installed Collage into .venv"
