"""The order of a queue: which queued run has waited longest. One rule for the API (``queue_position``) and the
workers (which run a broker message starts, see ``collage.worker.queueing``).

A run is queued at its creation or at its latest resume (the ``resume requested`` event the API writes); ties go
by id.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlmodel import Session, col

from collage.app.core.status import RunStatus
from collage.app.store.tables import Event, Run

RESUME_EVENT = "resume requested"  # the event the API writes when it puts an ended run back in the queue


def queue_of(config: dict[str, Any]) -> str:
    return (config.get("resources") or {}).get("queue") or "default"


@dataclass(frozen=True)
class Queued:
    run_id: str
    queued_at: datetime  # naive UTC


def queued_runs(session: Session, queue: str) -> list[Queued]:
    """The queued runs of ``queue``, the one that has waited longest first (ties by id)."""
    rows = session.execute(
        select(col(Run.id), col(Run.config), col(Run.created_at), col(Run.attempt)).where(
            col(Run.status) == RunStatus.QUEUED
        )
    ).all()
    mine = [r for r in rows if queue_of(r.config) == queue]
    resumed = [r.id for r in mine if r.attempt > 1]
    requeued: dict[str, datetime] = {}
    if resumed:
        requeued = dict(
            session.execute(
                select(col(Event.run_id), func.max(Event.time))
                .where(col(Event.run_id).in_(resumed), col(Event.message).startswith(RESUME_EVENT))
                .group_by(col(Event.run_id))
            ).all()
        )

    def naive(when: datetime) -> datetime:
        return when.replace(tzinfo=None) if when.tzinfo else when

    found = [Queued(r.id, naive(requeued.get(r.id) or r.created_at)) for r in mine]
    return sorted(found, key=lambda q: (q.queued_at, q.run_id))
