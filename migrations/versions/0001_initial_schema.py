"""initial schema

Revision ID: 0001
Revises:
The whole store: runs, tags, events, metrics, rollout samples, images, checkpoints, API tokens.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=100), nullable=False),
        sa.Column("token_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("prefix", sqlmodel.sql.sqltypes.AutoString(length=12), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("last_used_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_tokens_token_hash"), ["token_hash"], unique=True)

    op.create_table(
        "images",
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("format", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("path", sqlmodel.sql.sqltypes.AutoString(length=300), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("sha256"),
    )
    op.create_table(
        "runs",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.Column("algorithm", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("max_steps", sa.Integer(), nullable=False),
        sa.Column("model_path", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=False),
        sa.Column("dataset_source", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("started_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("heartbeat_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True),
        sa.Column("warning_count", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(["parent_id"], ["runs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index("ix_runs_created", ["created_at", "id"], unique=False)
        batch_op.create_index("ix_runs_status_created", ["status", "created_at", "id"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_step"),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("time", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("level", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_run", ["run_id", "id"], unique=False)

    op.create_table(
        "metrics",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("key", sqlmodel.sql.sqltypes.AutoString(length=100), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "key", "step"),
    )
    op.create_table(
        "run_tags",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("tag", sqlmodel.sql.sqltypes.AutoString(length=100), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "tag"),
    )
    with op.batch_alter_table("run_tags", schema=None) as batch_op:
        batch_op.create_index("ix_run_tags_tag", ["tag", "run_id"], unique=False)

    op.create_table(
        "samples",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("group", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.JSON(), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=False),
        sa.Column("completion", sa.Text(), nullable=False),
        sa.Column("rewards", sa.JSON(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("reward_sort", sa.Float(), nullable=False),
        sa.Column("advantage", sa.Float(), nullable=False),
        sa.Column("completion_length", sa.Integer(), nullable=False),
        sa.Column("truncated", sa.Boolean(), nullable=False),
        sa.Column("num_images", sa.Integer(), nullable=False),
        sa.Column("group_mean", sa.Float(), nullable=True),
        sa.Column("group_std", sa.Float(), nullable=True),
        sa.Column("zero_std", sa.Boolean(), nullable=False),
        sa.Column("dataset_row", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "step", "group", "index", name="uq_samples_position"),
    )
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.create_index("ix_samples_advantage", ["run_id", "advantage", "id"], unique=False)
        batch_op.create_index("ix_samples_length", ["run_id", "completion_length", "id"], unique=False)
        batch_op.create_index("ix_samples_reward", ["run_id", "reward_sort", "id"], unique=False)
        batch_op.create_index("ix_samples_step", ["run_id", "step", "id"], unique=False)

    op.create_table(
        "sample_images",
        sa.Column("sample_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["sample_id"], ["samples.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["sha256"],
            ["images.sha256"],
        ),
        sa.PrimaryKeyConstraint("sample_id", "position"),
    )
    with op.batch_alter_table("sample_images", schema=None) as batch_op:
        batch_op.create_index("ix_sample_images_sha", ["sha256"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sample_images", schema=None) as batch_op:
        batch_op.drop_index("ix_sample_images_sha")

    op.drop_table("sample_images")
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_index("ix_samples_step")
        batch_op.drop_index("ix_samples_reward")
        batch_op.drop_index("ix_samples_length")
        batch_op.drop_index("ix_samples_advantage")

    op.drop_table("samples")
    with op.batch_alter_table("run_tags", schema=None) as batch_op:
        batch_op.drop_index("ix_run_tags_tag")

    op.drop_table("run_tags")
    op.drop_table("metrics")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_run")

    op.drop_table("events")
    op.drop_table("checkpoints")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_status_created")
        batch_op.drop_index("ix_runs_created")

    op.drop_table("runs")
    op.drop_table("images")
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_tokens_token_hash"))

    op.drop_table("api_tokens")
