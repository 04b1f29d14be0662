"""Runs on several hosts (issue 29: resources.nodes).

Revision ID: 0013
Revises: 0012
- ``workers.reserved_for`` / ``reserved_attempt``: the run attempt that reserved this worker as one of its hosts
  (null: free). A gang claim sets them on every follower with one conditional update each, in one transaction.
- ``run_nodes``: one row per host of a run attempt on several hosts: its worker, the rendezvous endpoint (rank 0),
  when it started, its heartbeat and its end.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("reserved_for", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True))
        batch.add_column(sa.Column("reserved_attempt", sa.Integer(), nullable=True))
    op.create_table(
        "run_nodes",
        sa.Column("run_id", sa.String(length=32), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("attempt", sa.Integer(), primary_key=True),
        sa.Column("rank", sa.Integer(), primary_key=True),
        sa.Column("worker", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.Column("endpoint", sqlmodel.sql.sqltypes.AutoString(length=300), nullable=True),
        sa.Column("started_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("ended_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("run_nodes")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("reserved_attempt")
        batch.drop_column("reserved_for")
