"""A worker's free disk (issue 21d: /health reports the workers' disks).

Revision ID: 0011
Revises: 0010
- ``workers.disk_info``: the file systems holding the worker's home and artifacts (its cache of the bucket), each
  with its free and total bytes, as the worker measured them at its last heartbeat; null for a worker that has not
  reported them (one started before this migration).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("disk_info", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("disk_info")
