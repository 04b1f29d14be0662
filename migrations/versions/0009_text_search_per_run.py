"""The rollout table's text search indexed per run (PostgreSQL only; issue 21: the rollout table at 10M rows).

Revision ID: 0009
Revises: 0008
Every ``q=`` search names one run. 0003's trigram indexes cover the whole table, so once a term is common
across the store (2% of ten million rows) the planner stops using them and walks the run's rows in step order
running ILIKE on each until a page is full: about 3,000 rows a page for a term that is common in the run, every
row of the run for a term that is common elsewhere but rare in it. With ``btree_gin`` the run id joins the
trigrams in one GIN index, so a search reads the posting lists of that run's matches, whatever the rest of the
table holds. The table-wide indexes are dropped: no query uses them that the new ones cannot serve, and each
costs every insert.

If ``btree_gin`` cannot be created (no permission) or 0003 found no ``pg_trgm``, the indexes stay as they were,
with a warning. Building them reads the whole table and blocks writes to ``samples`` meanwhile: on a large store
run ``collage db upgrade`` while no run is training.
"""

from __future__ import annotations

import logging

from alembic import op
from sqlalchemy import text

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")

TEXT_COLUMNS = ("completion", "prompt_text")


def _has_extension(name: str) -> bool:
    return bool(op.get_bind().execute(text("SELECT 1 FROM pg_extension WHERE extname = :n"), {"n": name}).first())


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql" or not _has_extension("pg_trgm"):
        return
    savepoint = bind.begin_nested()
    try:
        op.execute("CREATE EXTENSION IF NOT EXISTS btree_gin")
        savepoint.commit()
    except Exception as exc:  # noqa: BLE001 - any refusal: keep 0003's table-wide indexes
        savepoint.rollback()
        log.warning("btree_gin is not available (%s): sample text search keeps its table-wide indexes", exc)
        return
    for column in TEXT_COLUMNS:
        op.execute(
            f"CREATE INDEX IF NOT EXISTS ix_samples_run_{column}_trgm ON samples USING gin (run_id, {column} gin_trgm_ops)"
        )
        op.execute(f"DROP INDEX IF EXISTS ix_samples_{column}_trgm")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql" or not _has_extension("pg_trgm"):
        return
    for column in TEXT_COLUMNS:
        op.execute(f"CREATE INDEX IF NOT EXISTS ix_samples_{column}_trgm ON samples USING gin ({column} gin_trgm_ops)")
        op.execute(f"DROP INDEX IF EXISTS ix_samples_run_{column}_trgm")
