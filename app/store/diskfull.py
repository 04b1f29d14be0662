"""A store whose disk is full: recognised (SQLite's SQLITE_FULL, PostgreSQL's SQLSTATE 53100) and reported as a
:class:`~collage.training.diskspace.DiskFull` naming where, never retried as if the connection had dropped."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import Engine

from collage.training.diskspace import DiskFull, full_disk_error

PG_DISK_FULL = "53100"  # PostgreSQL's disk_full ("could not extend file ...: No space left on device")


def is_disk_full(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", None)
    if getattr(orig, "sqlstate", None) == PG_DISK_FULL or getattr(orig, "sqlite_errorname", None) == "SQLITE_FULL":
        return True
    return full_disk_error(exc) is not None


def sqlite_path(engine: Engine) -> Path | None:
    """The file of a SQLite store on disk (``None`` for PostgreSQL or an in-memory SQLite)."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        return None
    return Path(database).absolute()


def store_disk_full(engine: Engine) -> DiskFull:
    path = sqlite_path(engine)
    if path is not None:
        return DiskFull.at(path, "writing to the store")
    url = engine.url.set(password=None).render_as_string(hide_password=True)
    return DiskFull(f"{url} (the database server's disk)", "writing to the store")
