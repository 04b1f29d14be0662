"""Dialect-aware INSERT ... ON CONFLICT for the two supported databases (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import CursorResult, Table
from sqlmodel import Session


def dialect_insert(session: Session, table: Table) -> Any:
    """An INSERT with ``on_conflict_do_*`` for the session's database."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table)
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)
    raise RuntimeError(f"unsupported database dialect {dialect}: Collage runs on SQLite or PostgreSQL")


def upsert(session: Session, table: Table, rows: list[dict], keys: list[str], update_columns: list[str]) -> None:
    stmt = dialect_insert(session, table)
    stmt = stmt.on_conflict_do_update(index_elements=keys, set_={c: stmt.excluded[c] for c in update_columns})
    session.execute(stmt, rows)


def changed_rows(session: Session, stmt: Any) -> int:
    """Run an UPDATE or DELETE and return how many rows it changed (a conditional write's verdict)."""
    result: CursorResult = session.execute(stmt)  # type: ignore[assignment]
    return result.rowcount
