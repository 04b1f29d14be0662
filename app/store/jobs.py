"""Jobs: what a worker does for the dashboard besides training (an export, a playground generation).

A job lives in the ``jobs`` table and moves through the runs' states (``RunStatus``) by conditional UPDATEs, so
each step happens exactly once whoever races for it: ``queued`` -> ``running`` (a worker's claim) -> ``succeeded``
/ ``failed`` / ``cancelled``; a cancel of a queued job ends it at once, of a running one asks it to stop
(``cancelling``), which its handler sees between pieces of work. A running job beats (``heartbeat_at``); the
reaper fails one whose beat stopped (its worker died).

Jobs of queue ``Q`` travel on the broker queue ``Q.jobs`` (:func:`broker_queue`), apart from the runs of ``Q``:
a worker of ``Q`` takes both, one task at a time, so a job waits behind the training its worker is running (its
``queue_position`` says where it stands) or runs at once on an idle worker. A message is a token of its queue,
as for runs: it starts the job that has waited longest there.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.core.status import ACTIVE, ENDED, JobKind, RunStatus
from collage.app.store.engine import session_scope
from collage.app.store.tables import ApiToken, Job, utcnow

from .sql import changed_rows

JOBS_SUFFIX = ".jobs"


def broker_queue(queue: str) -> str:
    """The broker queue a job of ``queue`` travels on."""
    return queue + JOBS_SUFFIX


def new_job_id() -> str:
    return uuid.uuid4().hex[:16]


def _aware(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=timezone.utc) if value is not None and value.tzinfo is None else value


def create_job(
    engine: Engine,
    kind: JobKind,
    queue: str,
    request: Mapping[str, Any],
    run_id: str | None = None,
    created_by: ApiToken | None = None,
) -> Job:
    job = new_job(kind, queue, request, run_id, created_by)
    with Session(engine, expire_on_commit=False) as session:
        session.add(job)
        session.commit()
    return job


IN_FLIGHT = [RunStatus.QUEUED.value, *(s.value for s in ACTIVE)]


def in_flight(session: Session, kind: JobKind, token_id: int) -> list[Job]:
    """The token's jobs of ``kind`` that are queued or running, oldest first."""
    query = (
        select(Job)
        .where(col(Job.kind) == kind.value, col(Job.created_by) == token_id, col(Job.status).in_(IN_FLIGHT))
        .order_by(col(Job.created_at), col(Job.id))
    )
    return list(session.scalars(query))


def admit(engine: Engine, token: ApiToken, job: Job, limit: int) -> list[Job]:
    """Insert ``job`` unless ``token`` already has ``limit`` jobs of its kind in flight; returns those instead
    (nothing inserted), or ``[]`` when ``job`` was admitted.

    The count and the insert are one transaction, so concurrent requests of one token (on any web replica) are
    admitted one after the other and never more than ``limit`` get in: on PostgreSQL the token's row is locked
    first; on SQLite the insert is the transaction's first statement, which takes the store's only write lock
    until the commit, so the count after it sees every row committed before."""
    assert token.id is not None
    kind = JobKind(job.kind)
    with Session(engine, expire_on_commit=False) as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(select(col(ApiToken.id)).where(col(ApiToken.id) == token.id).with_for_update())
        session.add(job)
        session.flush()
        others = [j for j in in_flight(session, kind, token.id) if j.id != job.id]
        if len(others) >= limit:
            for other in others:  # kept as read: a rollback expires what the session holds
                session.expunge(other)
            session.rollback()
            return others
        session.commit()
    return []


def new_job(
    kind: JobKind,
    queue: str,
    request: Mapping[str, Any],
    run_id: str | None = None,
    created_by: ApiToken | None = None,
) -> Job:
    """A queued job, not yet in the store."""
    return Job(
        id=new_job_id(),
        kind=kind.value,
        run_id=run_id,
        queue=queue,
        request=dict(request),
        status=RunStatus.QUEUED.value,
        created_by=created_by.id if created_by is not None else None,
    )


def get_job(engine: Engine, job_id: str) -> Job | None:
    with Session(engine, expire_on_commit=False) as session:
        return session.get(Job, job_id)


def queued_jobs(session: Session, queue: str, kinds: Iterable[JobKind] | None = None) -> list[Job]:
    """The queued jobs of ``queue``, the one that has waited longest first (ties by id)."""
    query = select(Job).where(col(Job.status) == RunStatus.QUEUED, col(Job.queue) == queue)
    if kinds is not None:
        query = query.where(col(Job.kind).in_([k.value for k in kinds]))
    return list(session.scalars(query.order_by(col(Job.created_at), col(Job.id))))


def queue_position(engine: Engine, job: Job) -> int | None:
    """A queued job's 1-based place among the queued jobs of its queue (None once it left the queue)."""
    if job.status != RunStatus.QUEUED:
        return None
    with Session(engine) as session:
        order = queued_jobs(session, job.queue)
    return next((i + 1 for i, j in enumerate(order) if j.id == job.id), None)


def claim_next_job(engine: Engine, queue: str, worker: str) -> Job | None:
    """Claim the job of ``queue`` that has waited longest (another worker may win one: then the next); None when
    nothing is queued there (a spare token)."""
    with Session(engine) as session:
        candidates = [j.id for j in queued_jobs(session, queue)]
    for job_id in candidates:
        now = utcnow()
        with session_scope(engine) as session:
            won = changed_rows(
                session,
                update(Job)
                .where(col(Job.id) == job_id, col(Job.status) == RunStatus.QUEUED)
                .values(status=RunStatus.RUNNING.value, worker=worker, started_at=now, heartbeat_at=now),
            )
        if won:
            return get_job(engine, job_id)
    return None


def _update(engine: Engine, job_id: str, states: Iterable[RunStatus], *where: Any, **values: Any) -> bool:
    conditions = [col(Job.id) == job_id, col(Job.status).in_([s.value for s in states]), *where]
    with session_scope(engine) as session:
        return bool(changed_rows(session, update(Job).where(*conditions).values(**values)))


def report_progress(engine: Engine, job_id: str, progress: float, message: str | None = None) -> bool:
    """A running job's progress (0..1) and what it does now; a beat of its heartbeat too. False: it was cancelled
    or ended meanwhile (its handler should stop)."""
    values: dict[str, Any] = {"progress": max(0.0, min(1.0, float(progress))), "heartbeat_at": utcnow()}
    if message is not None:
        values["message"] = message[:2000]
    return _update(engine, job_id, [RunStatus.RUNNING], **values)


def beat(engine: Engine, job_id: str) -> None:
    _update(engine, job_id, ACTIVE, heartbeat_at=utcnow())


def finish_job(
    engine: Engine,
    job_id: str,
    status: RunStatus,
    result: Mapping[str, Any] | None = None,
    error: str | None = None,
    message: str | None = None,
) -> bool:
    """End a running (or cancelling) job; False if it had already ended (the reaper, a cancel that won)."""
    values: dict[str, Any] = {"status": status.value, "finished_at": utcnow(), "error": error}
    if result is not None:
        values["result"] = dict(result)
    if status == RunStatus.SUCCEEDED:
        values["progress"] = 1.0
    if message is not None:
        values["message"] = message[:2000]
    return _update(engine, job_id, ACTIVE, **values)


def cancel_job(engine: Engine, job_id: str) -> str | None:
    """Cancel: a queued job ends ``cancelled`` at once, a running one becomes ``cancelling`` (its handler stops at
    its next check). Returns the job's status afterwards (None: no such job)."""
    now = utcnow()
    _update(engine, job_id, [RunStatus.QUEUED], status=RunStatus.CANCELLED.value, finished_at=now, message="cancelled")
    _update(engine, job_id, [RunStatus.RUNNING], status=RunStatus.CANCELLING.value, message="cancelling")
    job = get_job(engine, job_id)
    return job.status if job is not None else None


def fail_queued(engine: Engine, job_id: str, error: str) -> bool:
    """End a job that never left the queue (its broker message could not be sent) as failed, unless it moved
    meanwhile; False then."""
    values = {"error": error, "message": f"failed: {error}"[:2000], "finished_at": utcnow()}
    return _update(engine, job_id, [RunStatus.QUEUED], status=RunStatus.FAILED.value, **values)


def cancel_requested(engine: Engine, job_id: str) -> bool:
    with Session(engine) as session:
        status = session.scalars(select(col(Job.status)).where(col(Job.id) == job_id)).first()
    return status is None or status in (RunStatus.CANCELLING, RunStatus.CANCELLED)


def reap_jobs(engine: Engine, timeout: float) -> list[str]:
    """Fail the running jobs whose heartbeat is older than ``timeout`` seconds (their worker died)."""
    cutoff = utcnow() - timedelta(seconds=timeout)
    with Session(engine) as session:
        stale = session.execute(
            select(col(Job.id), col(Job.worker), col(Job.status)).where(
                col(Job.status).in_([s.value for s in ACTIVE]), col(Job.heartbeat_at) < cutoff
            )
        ).all()
    reaped = []
    for job_id, worker, status in stale:
        ended = RunStatus.CANCELLED if status == RunStatus.CANCELLING else RunStatus.FAILED
        reason = f"no heartbeat for {timeout:.0f}s: worker {worker or '?'} lost"
        if _update(
            engine,
            job_id,
            [RunStatus(status)],
            col(Job.heartbeat_at) < cutoff,  # a job that beat meanwhile keeps going
            status=ended.value,
            finished_at=utcnow(),
            error=reason if ended == RunStatus.FAILED else None,
            message=reason,
        ):
            reaped.append(job_id)
    return reaped


def ended(job: Job) -> bool:
    return job.status in ENDED


def model_summary(model: dict[str, Any]) -> dict[str, Any]:
    """How a resolved model (a job request's ``models`` entry) is shown: no server path but a base model's own."""
    return {
        "label": model["label"],
        "kind": model["kind"],
        "path": model["path"] if model["kind"] == "base" else None,
        "run": model.get("run"),
        "run_name": model.get("run_name"),
        "step": model.get("step"),
    }
