#!/usr/bin/env bash
# mypy on the library, the workers and the web tier (every module, zero errors), under their installed
# collage.* names: the checkout keeps app/, worker/, training/ at the top, so a link farm lays them out as the
# wheel does (mypy does not follow setuptools' editable import hooks).
set -euo pipefail
cd "$(dirname "$0")/.."
farm=build/typecheck
rm -rf "$farm" && mkdir -p "$farm/collage"
for d in app worker training migrations templates; do ln -s "../../../$d" "$farm/collage/$d"; done
MYPYPATH=$farm .venv/bin/mypy --config-file pyproject.toml -p collage.training -p collage.worker -p collage.app "$@"
