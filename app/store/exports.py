"""Export jobs (``jobs`` of kind ``export``): their bounds per token and where their folders are.

An export writes a whole model under ``COLLAGE_ARTIFACTS/exports/<job id>/`` (gigabytes for a real model), so a
token has at most one export in flight (:func:`admit`: the count and the insert are one transaction) and keeps only its newest finished export on disk: when one succeeds, the token's earlier exports are removed
(:func:`older_exports`, :func:`mark_removed`) and their downloads answer 410 saying why.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from ..db import session_scope
from ..models import ApiToken, Job, utcnow
from ..status import ENDED, JobKind
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
