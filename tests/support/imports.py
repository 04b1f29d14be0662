"""Running Collage's command line in a fresh interpreter as a user's install would (the checkout not on the path),
optionally with some top-level packages made unimportable (a node without an extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .waiting import scaled

# a `python -c` program: the packages in {blocked} cannot be imported, then `collage {argv}` runs
BLOCK = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from collage.app.cli.main import main
sys.exit(main({argv!r}))
"""


def run_python(code: str, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code`` in ``cwd`` with only what is installed importable (no PYTHONPATH)."""
    env = {**os.environ, **(env or {})}
    env.pop("PYTHONPATH", None)  # as a user runs it: only what is installed
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=scaled(timeout))  # fmt: skip
