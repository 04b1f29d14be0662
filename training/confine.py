"""Files inside an operator-confined folder stay inside the operator's roots (torch-free: the web tier uses it too).

A folder an API client may name (a dataset under COLLAGE_DATA_ROOTS, a model under COLLAGE_MODEL_ROOTS) is checked
as a path; what a loader then opens inside it is checked here: every file it reads is resolved (symbolic links
followed) and must still lie under one of the roots, and must be a regular file (a FIFO or a device would block or
never end). :func:`folder_escape` walks a whole folder (a model's, a ``save_to_disk`` dataset's) without following
its links, and names the first entry that leads out.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

MAX_ENTRIES = 20_000  # a model or dataset folder with more entries than this is not walked (refused)


def under(path: Path, roots: Sequence[Path]) -> bool:
    """Whether the resolved ``path`` is one of ``roots`` (already resolved) or lies under one."""
    return any(path == root or path.is_relative_to(root) for root in roots)


def resolved_under(path: Path, roots: Sequence[Path]) -> Path | None:
    """``path`` resolved (links, ``..``) when it lies under one of ``roots``, else None (a loop, a NUL byte)."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    return real if under(real, roots) else None


def file_problem(path: Path, roots: Sequence[Path] | None) -> tuple[Path, str | None]:
    """The file a loader may open for ``path`` (resolved when confined) and why it may not, or None."""
    if roots is None:
        return path, None
    real = resolved_under(path, roots)
    if real is None:
        return path, "leads outside the folders it may be read from (a symbolic link, or ../)"
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        return real, f"cannot be read: {exc.strerror}"
    if not stat.S_ISREG(mode):
        return real, "is not a regular file"
    return real, None


def folder_escape(folder: Path, roots: Sequence[Path]) -> str | None:
    """Why a confined folder may not be opened, or None: the first entry that is a link resolving outside ``roots``,
    a FIFO, a device or a socket; or more than :data:`MAX_ENTRIES` entries. A linked folder that stays inside the
    roots is walked too (once: a loop of links ends there), since what it holds is read through it."""
    count, seen = 0, set()
    stack = [folder]
    while stack:
        top = stack.pop()
        real_top = resolved_under(top, roots)
        if real_top is None or real_top in seen:
            continue
        seen.add(real_top)
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except OSError:
            continue  # gone meanwhile, or unreadable: whatever opens it next fails on its own
        for entry in entries:
            count += 1
            if count > MAX_ENTRIES:
                return f"has more than {MAX_ENTRIES} files and folders"
            path = Path(entry.path)
            rel = path.relative_to(folder)
            try:
                mode = path.lstat().st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                real = resolved_under(path, roots)
                if real is None:
                    return f"holds {rel}, a link that leads outside the folders it may be read from"
                if real.is_dir():
                    stack.append(path)
                elif not real.is_file():
                    return f"holds {rel}, which is not a regular file"
            elif stat.S_ISDIR(mode):
                stack.append(path)
            elif not stat.S_ISREG(mode):
                return f"holds {rel}, which is not a regular file"
    return None
