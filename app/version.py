"""Collage's one version string: the installed distribution's metadata (set in pyproject.toml)."""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "collage-rl"


@lru_cache(maxsize=1)
def collage_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # a checkout used without installing it (PYTHONPATH tricks)
        return "0+unknown"
