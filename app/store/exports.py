"""Export jobs (``jobs`` of kind ``export``): their bounds per token and where their folders are.

An export writes a whole model under ``COLLAGE_ARTIFACTS/exports/<job id>/`` (gigabytes for a real model), so a
token has at most one export in flight (:func:`first_in_flight` decides races: of two created at once, the older
stays) and keeps only its newest finished export on disk: when one succeeds, the token's earlier exports are removed
(:func:`older_exports`, :func:`mark_removed`) and their downloads answer 410 saying why.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from ..db import session_scope
from ..models import ApiToken, Job, utcnow
from ..status import ACTIVE, ENDED, JobKind, RunStatus

EXPORTS_FOLDER = "exports"
IN_FLIGHT = [RunStatus.QUEUED.value, *(s.value for s in ACTIVE)]


def export_path(job_id: str) -> str:
    """Where an export's folder is, relative to ``COLLAGE_ARTIFACTS`` (the job's ``result.path``)."""
    return f"{EXPORTS_FOLDER}/{job_id}"


def exports_root(artifacts: Path) -> Path:
    return Path(artifacts) / EXPORTS_FOLDER


def in_flight(session: Session, token_id: int) -> list[Job]:
    """The token's exports that are queued or running, oldest first."""
    query = (
        select(Job)
        .where(col(Job.kind) == JobKind.EXPORT.value, col(Job.created_by) == token_id, col(Job.status).in_(IN_FLIGHT))
        .order_by(col(Job.created_at), col(Job.id))
    )
    return list(session.scalars(query))


def admit(engine: Engine, token: ApiToken, job: Job) -> Job | None:
    """Insert the export ``job`` unless ``token`` has one in flight; returns that one instead (nothing inserted).

    The look and the insert are one transaction that first locks the token's row (PostgreSQL), so requests of one
    token on different web replicas take turns: the second sees the first's job. SQLite has no row locks; a
    one-machine store has one web process, whose own lock (the router's) serialises them."""
    assert token.id is not None
    with Session(engine, expire_on_commit=False) as session:
        session.execute(select(col(ApiToken.id)).where(col(ApiToken.id) == token.id).with_for_update())
        busy = in_flight(session, token.id)
        if busy:
            return busy[0]
        session.add(job)
        session.commit()
    return None


def first_in_flight(engine: Engine, token_id: int) -> Job | None:
    """The token's oldest export in flight: the one it may have (a newer one, created in a race, gives way)."""
    with Session(engine) as session:
        jobs = in_flight(session, token_id)
    return jobs[0] if jobs else None


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
