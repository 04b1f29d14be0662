"""Export jobs (``jobs`` of kind ``export``): their bounds per token and where their folders are.

An export writes a whole model under ``COLLAGE_ARTIFACTS/exports/<job id>/`` (gigabytes for a real model), so a
token has at most one export in flight (:func:`admit`: the count and the insert are one transaction) and keeps only its newest finished export on disk: when one succeeds, the token's earlier exports are removed
(:func:`older_exports`, :func:`mark_removed`) and their downloads answer 410 saying why. :func:`list_exports`
reads them back, newest first: a run's, or a token's.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.core.status import ENDED, JobKind
from collage.app.store.engine import session_scope
from collage.app.store.tables import ApiToken, Job, utcnow

from . import jobs

EXPORTS_FOLDER = "exports"


def export_path(job_id: str) -> str:
    """Where an export's folder is, relative to ``COLLAGE_ARTIFACTS`` (the job's ``result.path``)."""
    return f"{EXPORTS_FOLDER}/{job_id}"


def exports_root(artifacts: Path) -> Path:
    return Path(artifacts) / EXPORTS_FOLDER


def admit(engine: Engine, token: ApiToken, job: Job) -> Job | None:
    """Insert the export ``job`` unless ``token`` has one in flight; returns that one instead (nothing inserted):
    :func:`~collage.app.store.jobs.admit`, one at a time."""
    busy = jobs.admit(engine, token, job, limit=1)
    return busy[0] if busy else None


def older_exports(engine: Engine, job: Job) -> list[Job]:
    """The same token's earlier exports that have ended, but for succeeded ones already removed: whatever of them
    may still be on disk."""
    if job.created_by is None:
        return []
    with Session(engine) as session:
        rows = session.scalars(
            select(Job).where(
                col(Job.kind) == JobKind.EXPORT.value,
                col(Job.created_by) == job.created_by,
                col(Job.status).in_([s.value for s in ENDED]),
                col(Job.id) != job.id,
            )
        )
        return [j for j in rows if not (isinstance(j.result, dict) and j.result.get("removed"))]


def mark_removed(engine: Engine, job_id: str, why: str) -> None:
    """An export's folder is gone: its download answers 410 with ``why``."""
    with session_scope(engine) as session:
        job = session.get(Job, job_id)
        if job is not None and isinstance(job.result, dict):
            job.result = {**job.result, "removed": why, "removed_at": utcnow().isoformat()}


LIST_DEFAULT = 50  # exports one listing answers unless asked for fewer or more
LIST_MAX = 200


def list_exports(
    engine: Engine, *, run_id: str | None = None, created_by: int | None = None, limit: int = LIST_DEFAULT
) -> list[tuple[Job, str | None]]:
    """Export jobs, newest first (ties by id), at most ``limit``: of the run ``run_id`` and/or made by the token id
    ``created_by`` (neither: every export). Each with the name of the token that asked for it (None: no token, or
    one that is gone); tokens are revoked, never deleted, so a revoked token's name stays."""
    query = (
        select(Job, col(ApiToken.name))
        .outerjoin(ApiToken, col(ApiToken.id) == col(Job.created_by))
        .where(col(Job.kind) == JobKind.EXPORT.value)
    )
    if run_id is not None:
        query = query.where(col(Job.run_id) == run_id)
    if created_by is not None:
        query = query.where(col(Job.created_by) == created_by)
    query = query.order_by(col(Job.created_at).desc(), col(Job.id).desc()).limit(limit)
    with Session(engine, expire_on_commit=False) as session:
        rows = session.execute(query).all()
        for job, _ in rows:
            session.expunge(job)
        return [(job, name) for job, name in rows]
