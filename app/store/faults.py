"""How the store fails, in one place: which database errors mean "the store is unavailable now" (locked, timed out,
unreachable, connection dropped) rather than a bug (the API answers them 503 with ``Retry-After``, never 500;
writers retry the ones that a new connection may cure), and a store whose disk is full (SQLite's SQLITE_FULL,
PostgreSQL's SQLSTATE 53100), reported as a :class:`~collage.training.infra.diskspace.DiskFull` naming where, never
retried as if the connection had dropped."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from collage.training.infra.diskspace import DiskFull, full_disk_error

# OperationalError: SQLite's "database is locked", PostgreSQL's lock_timeout, a refused or dropped connection, a
# full disk; InterfaceError: a connection already closed; PoolTimeout: every pooled connection busy too long
STORE_FAULTS: tuple[type[Exception], ...] = (OperationalError, InterfaceError, DisconnectionError, PoolTimeout)


def is_store_fault(exc: BaseException) -> bool:
    return isinstance(exc, STORE_FAULTS)


def dropped_connection(exc: BaseException) -> bool:
    """The connection itself was lost (the server ended it, restarted, or a network fault): trying again on a new
    connection may well succeed."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, (DisconnectionError, InterfaceError))


def retryable(exc: BaseException) -> bool:
    """A write that failed this way may succeed on a new connection (every store write is idempotent); a full disk
    is an OperationalError too, but retrying cannot help."""
    if is_disk_full(exc):
        return False
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, (OperationalError, InterfaceError, DisconnectionError))


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
