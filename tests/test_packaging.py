"""One installable namespace: every package folder ships under ``collage.*``, nothing generic is importable,
one version string, and a missing extra is named in one line. (scripts/wheel_smoke.sh builds the wheel and
installs it into fresh environments; these tests cover what the development install can show.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _python(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env.pop("PYTHONPATH", None)  # as a user runs it: only what is installed
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_every_package_folder_is_shipped_under_collage():
    setuptools = PYPROJECT["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in mapping.items():
        assert name.startswith("collage.") and (ROOT / folder).is_dir(), name
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, f"missing from [tool.setuptools] packages: {found - listed}; stale: {listed - found}"


def test_only_the_collage_namespace_is_importable_outside_the_checkout(tmp_path):
    done = _python(
        """
        import importlib.util
        generic = [n for n in ("app", "worker", "training", "migrations", "templates") if importlib.util.find_spec(n)]
        import collage.app.cli, collage.training.config, collage.worker.broker, collage.templates, collage.migrations
        print(generic, collage.templates.__file__)
        """,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[] "), done.stdout


def test_one_version_string_from_the_package_metadata(tmp_path):
    want = PYPROJECT["project"]["version"]
    done = subprocess.run([sys.executable, "-m", "collage.app.cli", "--version"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)  # fmt: skip
    assert done.stdout.strip() == f"collage {want}"
    from collage.app.version import collage_version

    assert collage_version() == want


BLOCK = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from collage.app.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "blocked,argv,extra",
    [
        (["torch", "transformers"], ["train", "examples/grpo-count-red.yaml", "--out", "{out}"], "worker"),
        (["torch"], ["models", "build-tiny", "llava", "--out", "{out}"], "worker"),
        (["torch"], ["worker"], "worker"),
        (["fastapi"], ["serve", "--workers", "0"], "web"),
        (["torch"], ["serve", "--workers", "1"], "worker"),
        (["psycopg"], ["db", "upgrade"], "postgres"),
    ],
)
def test_a_missing_extra_is_named_in_one_line(tmp_path, blocked, argv, extra):
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in argv]
    env = {"COLLAGE_HOME": str(tmp_path / "home")}
    if extra == "postgres":
        env["COLLAGE_DATABASE_URL"] = "postgresql://nobody@127.0.0.1:1/none"
    done = _python(BLOCK.format(blocked=blocked, argv=argv), cwd=ROOT, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and f"pip install 'collage-rl[{extra}]'" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
