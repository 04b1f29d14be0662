"""Token roles and expiry, server-side browser sessions, one-time login links, run owners, event actors and an
audit log.

Revision ID: 0005
Revises: 0004
Existing tokens: the one `collage serve` made becomes admin, every other one member (no token gains power it
was not meant to have; an admin can promote with `collage token create`).
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _big_id():
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("role", sa.String(length=16), nullable=False, server_default="member"))
        batch.add_column(sa.Column("expires_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True))
    op.execute("UPDATE api_tokens SET role = 'admin' WHERE name = 'collage serve'")
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("created_by", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_runs_created_by", "api_tokens", ["created_by"], ["id"], ondelete="SET NULL")
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("actor", sa.String(length=100), nullable=True))
    op.create_table(
        "web_sessions",
        sa.Column("id_hash", sa.String(length=64), primary_key=True),
        sa.Column("token_id", sa.Integer(), sa.ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=False),
        sa.Column("csrf", sa.String(length=64), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("expires_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    )
    op.create_index("ix_web_sessions_token", "web_sessions", ["token_id"])
    op.create_table(
        "login_links",
        sa.Column("code_hash", sa.String(length=64), primary_key=True),
        sa.Column("token_id", sa.Integer(), sa.ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("expires_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("used_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", _big_id(), primary_key=True, autoincrement=True),
        sa.Column("time", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("login_links")
    op.drop_index("ix_web_sessions_token", table_name="web_sessions")
    op.drop_table("web_sessions")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("actor")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint("fk_runs_created_by", type_="foreignkey")
        batch.drop_column("created_by")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("expires_at")
        batch.drop_column("role")
