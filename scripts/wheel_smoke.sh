#!/usr/bin/env bash
# The wheel as a new user gets it: built from this checkout, installed into fresh virtual environments (never
# the development .venv), used from a folder outside the checkout.
#   1. [web] alone (no torch): `collage db upgrade`, `collage serve --workers 0`, GET /login and a static asset;
#      torch is absent, `collage train` says which extra to install, and no generic top-level module exists.
#   2. [all]: pip resolves it from the wheel (a dry run); the wheel installed, with .venv's distributions lent to it
#      (every [all] requirement checked); `collage train` on a tiny model for 2 steps.
# Prints each environment's install footprint (docs/packaging.md records them).
# Installs use --no-compile: each environment runs a few commands, which import a few hundred modules, and
# compiling every module of torch, transformers and their dependencies at install is CPU CI does not need.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
server=""
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
say() { echo "wheel-smoke: $*"; }

# an isolated PEP 517 build, as pip or `python -m build` does it for a user (setuptools' build/lib is reused
# between builds: clear it, or a module deleted from the checkout would still ship)
rm -rf build/lib build/bdist.*
.venv/bin/python -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/collage_rl-*.whl)
wheel_name=$(basename "$wheel")
say "built $wheel_name"
.venv/bin/python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
assert tops == {"collage"}, f"top-level entries besides collage/: {tops - {'collage'}}"
need = ["collage/templates/base.html", "collage/app/static/collage.js",
        "collage/app/static/vendor/uplot-1.6.32/uPlot.iife.min.js", "collage/app/static/vendor/uplot-1.6.32/LICENSE",
        "collage/migrations/alembic.ini", "collage/migrations/env.py", "collage/migrations/script.py.mako",
        "collage/migrations/versions/0001_initial_schema.py"]
missing = [n for n in need if n not in names]
assert not missing, f"missing from the wheel: {missing}"
assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc") or n.startswith("collage/tests")]
print(f"wheel-smoke: {len(names)} files, only collage/ at the top, templates, static and migrations inside")
PY

cd "$work"  # nothing of the checkout on sys.path from here on

say "fresh venv with [web]"
"$PYTHON" -m venv web
web/bin/python -m pip install --quiet --upgrade pip 2>/dev/null
web/bin/python -m pip install --quiet --no-compile "$wheel[web]" 2>&1 | grep -v "^WARNING: Location" || true
web/bin/python - <<'PY'
import importlib.util
for name in ("app", "worker", "training", "migrations", "templates"):
    assert importlib.util.find_spec(name) is None, f"a generic top-level module {name!r} was installed"
for heavy in ("torch", "transformers", "accelerate"):
    assert importlib.util.find_spec(heavy) is None, f"the web extra installed {heavy}"
import collage.app.main, collage.app.cli  # noqa: E401,F401
print("wheel-smoke: no top-level app/worker/training/migrations; no torch in the web install")
PY
export COLLAGE_HOME="$work/home" HF_HUB_OFFLINE=1
unset COLLAGE_DATABASE_URL COLLAGE_BROKER_URL COLLAGE_ARTIFACTS
web/bin/collage --version
web/bin/collage db upgrade
if web/bin/collage train "$ROOT/examples/grpo-count-red.yaml" >"$work/train-web.log" 2>&1; then
  say "collage train ran without the worker extra"; exit 1
fi
grep -q "pip install 'collage-rl\[worker\]'" "$work/train-web.log" || { cat "$work/train-web.log"; exit 1; }
say "without torch, collage train says: $(tail -1 "$work/train-web.log")"
port=$(web/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
web/bin/collage serve --port "$port" --workers 0 >"$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 1 120); do
  curl -fsS "http://127.0.0.1:$port/api/v1/health" >/dev/null 2>&1 && break
  kill -0 "$server" 2>/dev/null || { cat "$work/serve.log"; exit 1; }
  sleep 0.5
done
# to a file first: `curl | grep -q` fails under pipefail when grep stops reading early (curl: Failed writing body)
curl -fsS -o "$work/login.html" "http://127.0.0.1:$port/login"
grep -q "<form" "$work/login.html" || { say "GET /login failed"; cat "$work/serve.log"; exit 1; }
curl -fsS -o /dev/null "http://127.0.0.1:$port/static/vendor/uplot-1.6.32/uPlot.iife.min.js"
curl -fsS -o "$work/collage.css" "http://127.0.0.1:$port/static/collage.css"
grep -q "{" "$work/collage.css"
say "collage serve --workers 0 from the [web] install serves /login and its static assets"
kill "$server"; wait "$server" 2>/dev/null || true; server=""

say "fresh venv with [all]"
"$PYTHON" -m venv full
full/bin/python -m pip install --quiet --upgrade pip 2>/dev/null
# pip resolves [all] from the wheel's own metadata, as for a user: every requirement found (nothing installed)
full/bin/python -m pip install --quiet --dry-run --ignore-installed --report "$work/all.json" "$wheel[all]" 2>&1 |
  grep -v "^WARNING: Location" || true
say "pip resolves $wheel_name[all] to $(full/bin/python -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["install"]))' "$work/all.json") distributions"
# The distributions themselves are the development .venv's, lent through a .pth line (appended to sys.path, so the
# checkout's editable install is not), instead of unpacking torch and its CUDA libraries, 5.8 GB, a second time:
# on a CI machine with a slow disk that took eleven minutes and slowed every test beside it. The wheel itself is
# installed for real (its own collage/, entry point and data files), and every [all] requirement is checked below.
lent=$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$lent" >"$(full/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/lent-by-wheel-smoke.pth"
full/bin/python -m pip install --quiet --no-compile --no-deps --force-reinstall "$wheel" 2>&1 |
  grep -v -e "^WARNING: Location" -e "outside environment" || true
full/bin/python - "$wheel" <<'PY'
import sys, zipfile
from importlib import metadata
from pathlib import Path
from packaging.requirements import Requirement

import sysconfig

import collage.app

site = Path(sysconfig.get_paths()["purelib"]).resolve()
assert Path(collage.app.__file__).resolve().parents[2] == site, f"collage comes from {collage.app.__file__}"
dist = next(d for d in metadata.distributions() if d.metadata["Name"] == "collage-rl")  # this venv's, first on the path
assert Path(str(dist.locate_file(""))).resolve() == site, f"collage-rl's metadata is {dist.locate_file('')}'s"
requires = [Requirement(r) for r in dist.requires or []]
extras, todo = set(), ["all"]
while todo:  # [all] and the extras it names
    extra = todo.pop()
    extras.add(extra)
    for req in requires:
        if req.marker and req.marker.evaluate({"extra": extra}) and req.name == "collage-rl":
            todo += [e for e in req.extras if e not in extras]
unmet = []
for req in requires:
    if req.name == "collage-rl" or (req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras | {""})):
        continue
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        unmet.append(f"{req} (not installed)")
        continue
    if not req.specifier.contains(version, prereleases=True):
        unmet.append(f"{req} (found {version})")
assert not unmet, f"[all] requirements not met: {unmet}"
print(f"wheel-smoke: collage from the wheel; all {len(requires)} requirements of [{', '.join(sorted(extras))}] met")
PY
cat >"$work/tiny.yaml" <<'YAML'
name: wheel-smoke
model: {path: "tiny:qwen2-vl"}
dataset: {source: "synth:count-red", rows: 16, max_images: 2}
rewards: [{name: accuracy}]
train: {max_steps: 2, per_device_train_batch_size: 4, num_generations: 2, max_completion_length: 8}
resources: {gpus: 0}
YAML
OMP_NUM_THREADS=1 full/bin/collage train "$work/tiny.yaml" --out "$work/run" --quiet
test "$(wc -l <"$work/run/metrics.jsonl")" -eq 2
say "collage train from the [all] install ran 2 steps"
say "install footprint: [web] $(du -sm web | cut -f1) MB (virtual environment; [all] is lent .venv's distributions here, see docs/packaging.md)"
