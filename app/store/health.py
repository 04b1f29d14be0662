"""Whether the store answers, for ``GET /health``: a round trip, and the schema at the newest migration."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

from collage.app.store.engine import DatabaseNotMigrated, check_migrated


def store_health(engine: Engine) -> dict[str, Any]:
    """``{"ok", "dialect"}``, with ``error`` when the store cannot be reached or is not migrated. Never raises:
    a failing store is what this reports. On a connection of its own, outside any request's session."""
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        check_migrated(engine)
    except DatabaseNotMigrated as exc:
        return {"ok": False, "dialect": engine.dialect.name, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - report any store failure
        return {"ok": False, "dialect": engine.dialect.name, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "dialect": engine.dialect.name}
