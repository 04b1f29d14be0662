"""One installable namespace, with real processes: the wheel builds without setuptools warnings and ships the static
files, nothing but ``collage`` is importable outside the checkout, `collage --version` is the one version string,
and a missing extra is named in one line. (scripts/wheel_smoke.sh builds the wheel and installs it into fresh
environments; these tests cover what the development install can show.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.imports import BLOCK, run_python

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from tests.support.waiting import scaled

ROOT = Path(__file__).resolve().parents[2]


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


SHIPPED = ["pyproject.toml", "README.md", "LICENSE", "app", "worker", "training", "migrations", "templates"]


def test_the_wheel_builds_without_setuptools_warnings_and_ships_the_static_files(tmp_path):
    """`python -m build` of a copy of the sources: no "absent from the packages configuration" warning (there
    were 92 lines of them), and the dashboard's scripts, styles and vendored libraries are in the wheel."""
    pytest.importorskip("build")
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for item in SHIPPED:  # a copy: the build writes build/ and *.egg-info next to the sources
        if (ROOT / item).is_dir():
            shutil.copytree(ROOT / item, src / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / item, src / item)
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                           str(src)], capture_output=True, text=True, timeout=scaled(300))  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "absent from the `packages` configuration" not in output and "Package would be ignored" not in output, [
        line for line in output.splitlines() if "WARNING" in line
    ]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in (p.relative_to(ROOT / "app").as_posix() for p in (ROOT / "app" / "static").rglob("*") if p.is_file()):
        assert f"collage/app/{rel}" in names, rel


def test_only_the_collage_namespace_is_importable_outside_the_checkout(tmp_path):
    done = run_python(
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
                          cwd=tmp_path, timeout=scaled(60))  # fmt: skip
    assert done.stdout.strip() == f"collage {want}"
    from collage.app.version import collage_version

    assert collage_version() == want


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
    done = run_python(BLOCK.format(blocked=blocked, argv=argv), cwd=ROOT, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and f"pip install 'collage-rl[{extra}]'" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
