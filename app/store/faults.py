"""Which database errors mean "the store is unavailable now" (locked, timed out, unreachable, connection dropped)
rather than a bug: the API answers them 503 with ``Retry-After``, never 500."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

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
