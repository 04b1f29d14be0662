"""Dashboard v2: a run's free-text notes, a rollout row's scalar dataset columns, a worker's GPU description.

Revision ID: 0006
Revises: 0005
All three columns are nullable: rows written before this migration simply have none.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("notes", sa.Text(), nullable=True))
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("columns", sa.JSON(), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("gpu_info", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("gpu_info")
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("columns")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("notes")
