"""Held-out evaluation, checkpoints you can list, jobs on workers (issue 18).

Revision ID: 0007
Revises: 0006
- ``samples.split``: ``train`` (every row written before) or ``eval``; a step's eval rows sit beside its training
  rows, so the position constraint gains the split.
- ``checkpoints``: the attempt that wrote it, the model folder's size, ``adapter`` or ``full``, and the value of
  ``metric_for_best_model`` at its step (all null for checkpoints recorded before).
- ``jobs``: exports and playground generations that workers run; ``uploads``: the images a token uploaded, which
  count against its quota.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("split", sa.String(8), nullable=False, server_default="train"))
        batch.drop_constraint("uq_samples_position", type_="unique")
        batch.create_unique_constraint("uq_samples_position", ["run_id", "split", "step", "group", "index"])
        batch.create_index("ix_samples_split", ["run_id", "split", "step", "id"], unique=False)
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("kind", sa.String(8), nullable=True))
        batch.add_column(sa.Column("metric", sa.Float(), nullable=True))
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=True),
        sa.Column("queue", sa.String(100), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("created_by", sa.Integer(), sa.ForeignKey("api_tokens.id", ondelete="SET NULL"), nullable=True),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("started_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
    )
    op.create_index("ix_jobs_status", "jobs", ["status", "created_at", "id"])
    op.create_index("ix_jobs_run", "jobs", ["run_id", "created_at"])
    op.create_table(
        "uploads",
        sa.Column("sha256", sa.String(64), sa.ForeignKey("images.sha256"), primary_key=True),
        sa.Column("token_id", sa.Integer(), sa.ForeignKey("api_tokens.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    )
    op.create_index("ix_uploads_token", "uploads", ["token_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_uploads_token", table_name="uploads")
    op.drop_table("uploads")
    op.drop_index("ix_jobs_run", table_name="jobs")
    op.drop_index("ix_jobs_status", table_name="jobs")
    op.drop_table("jobs")
    with op.batch_alter_table("checkpoints") as batch:
        for column in ("metric", "kind", "bytes", "attempt"):
            batch.drop_column(column)
    op.execute("DELETE FROM samples WHERE split <> 'train'")  # the old constraint cannot hold eval rows beside them
    with op.batch_alter_table("samples") as batch:
        batch.drop_index("ix_samples_split")
        batch.drop_constraint("uq_samples_position", type_="unique")
        batch.create_unique_constraint("uq_samples_position", ["run_id", "step", "group", "index"])
        batch.drop_column("split")
