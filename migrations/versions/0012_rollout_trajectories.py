"""Multi-turn rollouts with image tools: a rollout row's trajectory and its counts.

Revision ID: 0012
Revises: 0011
- ``samples.trajectory``: the rollout's turns (JSON: role, text, tool call, images by hash with their source box,
  error); null for a row without tools (every row written before this migration).
- ``samples.tool_calls``, ``samples.tool_errors``, ``samples.turns``: counts of the trajectory, 0 for rows without
  one, each indexed under the run like the other sorts of the rollout table.
- ``sample_tool_images``: each tool image a row's trajectory names, by hash (``position``: its index over the
  rollout's images), so that its ``images`` row is referenced (a foreign key) as long as the row is, as
  ``sample_images`` does for a row's own images.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

COUNTS = ("tool_calls", "tool_errors", "turns")


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("trajectory", sa.JSON(), nullable=True))
        for name in COUNTS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    for name in COUNTS:
        op.create_index(f"ix_samples_{name}", "samples", ["run_id", name, "id"], unique=False)
    op.create_table(
        "sample_tool_images",
        sa.Column("sample_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["sample_id"], ["samples.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["sha256"], ["images.sha256"]),
        sa.PrimaryKeyConstraint("sample_id", "position"),
    )
    op.create_index("ix_sample_tool_images_sha", "sample_tool_images", ["sha256"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_sample_tool_images_sha", table_name="sample_tool_images")
    op.drop_table("sample_tool_images")
    for name in COUNTS:
        op.drop_index(f"ix_samples_{name}", table_name="samples")
    with op.batch_alter_table("samples") as batch:
        for name in reversed(COUNTS):
            batch.drop_column(name)
        batch.drop_column("trajectory")
