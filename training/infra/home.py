"""Where Collage keeps its caches: ``COLLAGE_HOME`` (default ``~/.collage``)."""

from __future__ import annotations

import os
from pathlib import Path


def collage_home() -> Path:
    return Path(os.environ.get("COLLAGE_HOME") or Path.home() / ".collage").expanduser()


def cache_dir(kind: str) -> Path:
    path = collage_home() / "cache" / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
