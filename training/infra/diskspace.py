"""A full disk is fatal, and said so: which path, how much space is left.

A write that fails for lack of space is not retried (it would fail again until someone frees space) and is
not reported as whatever the library that hit it calls it ("iostream error", "database or disk is full"):
:class:`DiskFull` names the path and the free space of its file system.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from collage.training.infra.errors import RunError

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# what libraries say instead of raising OSError(ENOSPC): safetensors (Rust's io::ErrorKind), SQLite, PostgreSQL
_FULL_TEXTS = ("no space left on device", "storagefull", "database or disk is full", "diskfull", "disk full")


@dataclass(frozen=True)
class Space:
    free: int  # bytes an unprivileged writer may still use
    total: int

    def __str__(self) -> str:
        return f"{human(self.free)} free of {human(self.total)}"


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def space(path: Path) -> Space:
    """The free and total space of the file system ``path`` (or its nearest existing folder) lives on."""
    info = os.statvfs(existing_ancestor(path))
    return Space(free=info.f_bavail * info.f_frsize, total=info.f_blocks * info.f_frsize)


class DiskFull(RunError):
    """A write failed because the file system holding ``where`` is full; ``free``: what is left there, when
    known (:meth:`at` measures it for a local path)."""

    exit_code = 1

    def __init__(self, where: Path | str, what: str, free: Space | None = None):
        self.where = str(where)
        self.free = free
        left = f" ({free})" if free is not None else ""
        super().__init__(f"no space left on device: {what} {self.where}{left}; free some space, then resume the run")

    @classmethod
    def at(cls, path: Path | str, what: str) -> DiskFull:
        return cls(path, what, space_or_none(Path(path)))


def space_or_none(path: Path) -> Space | None:
    try:
        return space(path)
    except OSError:
        return None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def full_disk_error(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that says a disk is full (a :class:`DiskFull`, an ``OSError`` ENOSPC or
    EDQUOT, or a library's words for it), else ``None``."""
    for error in _chain(exc):
        if isinstance(error, DiskFull):
            return error
    for error in _chain(exc):
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return error
        text = str(error).lower()
        if any(t in text for t in _FULL_TEXTS):
            return error
    return None


def as_disk_full(exc: BaseException, fallback: Path) -> DiskFull | None:
    """``exc`` as a :class:`DiskFull` naming the path that filled up (the failed write's own file name, else
    ``fallback``), or ``None`` when ``exc`` is not about a full disk."""
    found = full_disk_error(exc)
    if found is None:
        return None
    if isinstance(found, DiskFull):
        return found
    path = Path(found.filename) if isinstance(found, OSError) and found.filename else fallback
    return DiskFull.at(path, "writing")
