"""Per-bucket min/max rollups of metrics, for fast downsampled charts of long runs.

Revision ID: 0004
Revises: 0003
Backfills the rollups of metrics already in the store.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

WIDTHS = (16, 256)  # keep in step with app/store/rollups.py


def upgrade() -> None:
    op.create_table(
        "metric_rollups",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("key", sa.String(length=100), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("min_step", sa.Integer(), nullable=False),
        sa.Column("min_value", sa.Float(), nullable=False),
        sa.Column("max_step", sa.Integer(), nullable=False),
        sa.Column("max_value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "key", "width", "bucket"),
    )
    bind = op.get_bind()
    rollups = sa.table(
        "metric_rollups", *(sa.column(c) for c in ("run_id", "key", "width", "bucket", "min_step", "min_value",
                                                  "max_step", "max_value"))
    )  # fmt: skip
    for (run_id,) in bind.execute(sa.text("SELECT DISTINCT run_id FROM metrics")).all():
        best: dict[tuple[str, int, int], list] = {}
        rows = bind.execute(
            sa.text("SELECT key, step, value FROM metrics WHERE run_id = :r AND value IS NOT NULL ORDER BY key, step"),
            {"r": run_id},
        )
        for key, step, value in rows:
            for w in WIDTHS:
                entry = best.setdefault((key, w, step // w), [step, value, step, value])
                if value < entry[1]:
                    entry[0], entry[1] = step, value
                if value > entry[3]:
                    entry[2], entry[3] = step, value
        if best:
            op.bulk_insert(rollups, [
                {"run_id": run_id, "key": k, "width": w, "bucket": b, "min_step": e[0], "min_value": e[1],
                 "max_step": e[2], "max_value": e[3]} for (k, w, b), e in best.items()
            ])  # fmt: skip


def downgrade() -> None:
    op.drop_table("metric_rollups")
