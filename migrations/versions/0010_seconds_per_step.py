"""A run's recent step time (issue 27: time left after a resume).

Revision ID: 0010
Revises: 0009
- ``runs.seconds_per_step``: the mean time of the current attempt's recent training steps, as the training process
  measured them (evaluations included). The time left is estimated from it; null until the attempt has finished a
  step (a resumed run says "estimating" instead of dividing the whole run's time by steps an earlier attempt did).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("seconds_per_step", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("seconds_per_step")
