"""The installation's shared secrets (issue 21: stateless web replicas).

Revision ID: 0008
Revises: 0007
- ``installation_secrets``: one row per secret every process of the installation shares, by name. ``signing`` (the
  key that signs the API's pagination cursors) used to be ``$COLLAGE_HOME/secret``, one per home: two web replicas
  with homes of their own then refused each other's cursors. The row is made by the first process that needs it
  (an insert that does nothing when another process got there first), never by this migration, so a database
  restored from a dump keeps its key.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "installation_secrets",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(128), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("installation_secrets")
