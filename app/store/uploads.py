"""Images a token uploaded (the playground): the image itself is content-addressed in ``images`` like every rollout
image; an ``uploads`` row per (image, token) is what counts against the token's quota.

The quota holds under concurrent uploads of one token: the new row is inserted first and the token's total summed
after it, in the same transaction, which is rolled back when the total is over. SQLite serialises writers (the
insert holds the only write lock until the commit); on PostgreSQL the token's row is locked first (``FOR
UPDATE``), so two uploads of one token are summed one after the other. An image uploaded again by the same token
is not counted again. Uploads are kept like the rest of the image store (nothing deletes images).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from ..db import session_scope
from ..errors import WebError
from ..models import ApiToken, Image, Upload, table_of, utcnow
from .sql import dialect_insert


class QuotaExceeded(WebError):
    """The upload would take the token past its quota (nothing was stored)."""

    def __init__(self, used: int, size: int, quota: int):
        self.used, self.size, self.quota = used, size, quota
        super().__init__(
            f"this upload ({size} bytes) would take this token's uploads to {used + size} bytes, over its quota of "
            f"{quota} bytes ({quota / (1 << 20):.0f} MB, COLLAGE_UPLOAD_QUOTA_MB): reuse an image uploaded before "
            "(GET /api/v1/uploads lists them) or ask the operator for a larger quota"
        )


@dataclass(frozen=True)
class StoredUpload:
    sha256: str
    width: int
    height: int
    bytes: int
    created_at: datetime
    new: bool  # False: this token had uploaded the same image before (not counted again)


def add_upload(
    engine: Engine, token_id: int, sha: str, path: str, width: int, height: int, size: int, quota: int
) -> StoredUpload:
    """Record an image (already written under ``path``, relative to the artifacts) as uploaded by ``token_id``;
    :class:`QuotaExceeded` when the token's uploads would then exceed ``quota`` bytes."""
    now = utcnow()
    image = {"sha256": sha, "width": width, "height": height, "format": "png", "size_bytes": size, "path": path,
             "created_at": now}  # fmt: skip
    with session_scope(engine) as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(select(col(ApiToken.id)).where(col(ApiToken.id) == token_id).with_for_update())
        session.execute(
            dialect_insert(session, table_of(Image)).on_conflict_do_nothing(index_elements=["sha256"]), [image]
        )
        upload = {"sha256": sha, "token_id": token_id, "bytes": size, "created_at": now}
        table = table_of(Upload)
        insert = (
            dialect_insert(session, table)
            .values(**upload)
            .on_conflict_do_nothing(index_elements=["sha256", "token_id"])
        )
        # RETURNING, not the row count (psycopg reports -1 for an ORM session's INSERT): no row back, a conflict
        if session.execute(insert.returning(table.c.sha256)).first() is None:
            before = session.get(Upload, (sha, token_id))
            assert before is not None  # the conflict was this row
            return StoredUpload(sha, width, height, before.bytes, before.created_at, new=False)
        total = used_bytes(session, token_id)
        if total > quota:
            raise QuotaExceeded(total - size, size, quota)  # session_scope rolls the row back
    return StoredUpload(sha, width, height, size, now, new=True)


def used_bytes(session: Session, token_id: int) -> int:
    return int(session.scalar(select(func.sum(col(Upload.bytes))).where(col(Upload.token_id) == token_id)) or 0)


def list_uploads(session: Session, token_id: int, limit: int) -> list[tuple[Upload, Image]]:
    """The token's uploads, newest first, with their images."""
    rows = session.execute(
        select(Upload, Image)
        .join(Image, col(Image.sha256) == col(Upload.sha256))
        .where(col(Upload.token_id) == token_id)
        .order_by(col(Upload.created_at).desc(), col(Upload.sha256))
        .limit(limit)
    ).all()
    return [(u, i) for u, i in rows]
