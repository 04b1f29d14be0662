"""Trigram indexes for the rollout table's text search (PostgreSQL only).

Revision ID: 0003
Revises: 0002
``q=`` filters the samples of a run with ILIKE on the completion and the prompt text; on PostgreSQL that costs
about 5 us per row without an index. pg_trgm GIN indexes make it an index lookup. SQLite needs nothing: its
scan of one run's rows is fast enough. If the extension cannot be created (no permission), the indexes are
skipped with a warning and search still works, only slower.
"""

from __future__ import annotations

import logging

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    savepoint = bind.begin_nested()
    try:
        op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        savepoint.commit()
    except Exception as exc:  # noqa: BLE001 - any refusal: keep going without the indexes
        savepoint.rollback()
        log.warning("pg_trgm is not available (%s): sample text search will not be indexed", exc)
        return
    op.execute("CREATE INDEX IF NOT EXISTS ix_samples_completion_trgm ON samples USING gin (completion gin_trgm_ops)")
    op.execute("CREATE INDEX IF NOT EXISTS ix_samples_prompt_text_trgm ON samples USING gin (prompt_text gin_trgm_ops)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX IF EXISTS ix_samples_prompt_text_trgm")
    op.execute("DROP INDEX IF EXISTS ix_samples_completion_trgm")
