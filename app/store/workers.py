"""The workers table: who is alive (the runs list, the workers page, a queued run's "will it start" note, the
dispatcher's health) and forgetting the ones long gone (the reaper). Workers write their own rows
(:mod:`collage.worker.registry`); the web tier only reads them, through here."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.store.engine import session_scope
from collage.app.store.tables import Worker, utcnow


def live_workers(engine: Engine, within: float) -> list[dict[str, Any]]:
    """The workers seen in the last ``within`` seconds, by name, as the API shows them."""
    cutoff = utcnow() - timedelta(seconds=within)
    with Session(engine) as session:
        rows = session.scalars(select(Worker).where(col(Worker.last_seen) >= cutoff).order_by(Worker.name)).all()
        return [
            {"name": w.name, "hostname": w.hostname, "pid": w.pid, "queues": w.queues, "gpu_slots": w.gpus,
             "current_run": w.current_run_id, "last_seen": w.last_seen.isoformat(),
             "started_at": w.started_at.isoformat(), "gpu_info": w.gpu_info, "disk": w.disk_info}
            for w in rows
        ]  # fmt: skip


def forget_stale(engine: Engine, older_than: float) -> None:
    """Delete the rows of workers not seen for ``older_than`` seconds (a worker killed without its goodbye)."""
    cutoff = utcnow() - timedelta(seconds=older_than)
    with session_scope(engine) as session:
        session.execute(delete(Worker).where(col(Worker.last_seen) < cutoff))
