"""Images a token uploaded (the playground): the image itself is content-addressed in ``images`` like every rollout
image; an ``uploads`` row per (image, token) is what counts against the token's quota and the server's budget.

A refused upload leaves nothing behind. :func:`store_upload` charges the upload first and writes it after:

1. the PNG is staged under a temporary name beside its final path (when the image is not on disk already), on a
   file system with room for it (``COLLAGE_MIN_FREE_DISK_MB`` kept free);
2. one transaction inserts the rows and sums the token's uploads (its quota) and every token's (the budget),
   and is rolled back when either is over (429 / 507): the staged file is removed;
3. only a committed upload is published: written to the bucket (with object storage), then renamed into place.
   When that fails the rows are taken back out and the staged file removed (503).

The sums hold under concurrent uploads: the new row is inserted first and the totals summed after it, in the same
transaction. SQLite serialises writers (the insert holds the only write lock until the commit); on PostgreSQL a
transaction-level advisory lock orders every upload's accounting, so two uploads are summed one after the other.
An image uploaded again by the same token is not counted again. Uploads are kept like the rest of the image store.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import delete, func, select, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.store.engine import session_scope
from collage.app.store.errors import StoreError
from collage.app.store.tables import Image, Upload, table_of, utcnow
from collage.training.infra.diskspace import human, space_or_none
from collage.training.infra.objectstore import ObjectMirror, StorageError

from .images import relative_path
from .sql import dialect_insert

UPLOADS_LOCK = 0x636F6C6C  # the advisory lock (PostgreSQL) that orders the uploads' accounting: "coll"


class UploadRefused(StoreError):
    """The upload cannot be kept; nothing of it was stored. ``status``: the HTTP status that says why."""

    status = 400


class QuotaExceeded(UploadRefused):
    """The upload would take the token past its quota."""

    status = 429

    def __init__(self, used: int, size: int, quota: int):
        self.used, self.size, self.quota = used, size, quota
        super().__init__(
            f"this upload ({size} bytes) would take this token's uploads to {used + size} bytes, over its quota of "
            f"{quota} bytes ({quota / (1 << 20):.0f} MB, COLLAGE_UPLOAD_QUOTA_MB): reuse an image uploaded before "
            "(GET /api/v1/uploads lists them) or ask the operator for a larger quota"
        )


class BudgetExceeded(UploadRefused):
    """Every token's uploads together would pass the server's budget for them, or its disk is nearly full."""

    status = 507


class NotStored(UploadRefused):
    """The charged upload could not be written (the bucket or the disk refused it); its charge was taken back."""

    status = 503


@dataclass(frozen=True)
class StoredUpload:
    sha256: str
    width: int
    height: int
    bytes: int
    created_at: datetime
    new: bool  # False: this token had uploaded the same image before (not counted again)


@dataclass(frozen=True)
class UploadLimits:
    quota: int  # bytes one token's uploads may hold
    budget: int  # bytes every token's uploads together may hold
    min_free: int  # bytes the artifacts' file system keeps free


def store_upload(
    engine: Engine,
    artifacts: Path,
    token_id: int,
    png: bytes,
    size: tuple[int, int],
    limits: UploadLimits,
    mirror: ObjectMirror | None = None,
) -> StoredUpload:
    """Charge, then write, an uploaded PNG (the module's docstring says in which order and why)."""
    sha = hashlib.sha256(png).hexdigest()
    rel = relative_path(sha)
    final = artifacts / rel
    staged = None if final.exists() else _stage(final, png, limits.min_free)
    try:
        stored, image_is_new = add_upload(engine, token_id, sha, rel, *size, len(png), limits)
        if staged is not None:
            try:
                _publish(staged, final, rel, png, mirror)
            except NotStored:
                if stored.new:  # only what this upload added: an earlier upload of the image stays
                    _take_back(engine, token_id, sha, image_is_new)
                raise
            staged = None
    finally:
        if staged is not None:
            staged.unlink(missing_ok=True)
    return stored


def _stage(final: Path, png: bytes, min_free: int) -> Path:
    """``png`` under a temporary name beside ``final``; refused when the disk would keep less than ``min_free``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    free = space_or_none(final.parent)
    if free is not None and free.free - len(png) < min_free:
        raise BudgetExceeded(
            f"the server's disk for uploads has {free}: an upload of {human(len(png))} would leave less than the "
            f"{human(min_free)} it keeps free (COLLAGE_MIN_FREE_DISK_MB); ask the operator to free space"
        )
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(png)
    except OSError as exc:
        Path(name).unlink(missing_ok=True)
        raise BudgetExceeded(f"the server could not stage the upload on its disk: {exc.strerror or exc}") from exc
    return Path(name)


def _publish(staged: Path, final: Path, rel: str, png: bytes, mirror: ObjectMirror | None) -> None:
    """The committed upload in the bucket (first: a local file means the bucket has it), then in place here."""
    try:
        if mirror is not None:
            mirror.put_bytes(rel, png, once=True, content_type="image/png")
        os.replace(staged, final)
    except (StorageError, OSError) as exc:
        raise NotStored(f"the upload could not be stored, and was not kept: {exc}") from exc


def add_upload(
    engine: Engine, token_id: int, sha: str, path: str, width: int, height: int, size: int, limits: UploadLimits
) -> tuple[StoredUpload, bool]:
    """Record an image (its file is staged under ``path``, relative to the artifacts) as uploaded by ``token_id``;
    :class:`QuotaExceeded` when the token's uploads, :class:`BudgetExceeded` when every token's, would then pass
    their limit (the transaction is rolled back). Also says whether the ``images`` row is new."""
    now = utcnow()
    image = {"sha256": sha, "width": width, "height": height, "format": "png", "size_bytes": size, "path": path,
             "created_at": now}  # fmt: skip
    with session_scope(engine) as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPLOADS_LOCK})
        images = table_of(Image)
        inserted = session.execute(
            dialect_insert(session, images)
            .on_conflict_do_nothing(index_elements=["sha256"])
            .returning(images.c.sha256),
            [image],
        ).first()
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
            return StoredUpload(sha, width, height, before.bytes, before.created_at, new=False), False
        total = used_bytes(session, token_id)
        if total > limits.quota:
            raise QuotaExceeded(total - size, size, limits.quota)  # session_scope rolls the rows back
        everyone = int(session.scalar(select(func.sum(col(Upload.bytes)))) or 0)
        if everyone > limits.budget:
            raise BudgetExceeded(
                f"the server's uploads would take {human(everyone)}, over the {human(limits.budget)} they may "
                "use together (COLLAGE_UPLOAD_BUDGET_MB): reuse an image uploaded before, or ask the operator"
            )
    return StoredUpload(sha, width, height, size, now, new=True), inserted is not None


def _take_back(engine: Engine, token_id: int, sha: str, image_is_new: bool) -> None:
    """Undo a committed upload whose file could not be written: its row, and the image's if the upload made it."""
    with session_scope(engine) as session:
        session.execute(delete(Upload).where(col(Upload.sha256) == sha, col(Upload.token_id) == token_id))
        if image_is_new:
            session.execute(delete(Image).where(col(Image.sha256) == sha))


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
