"""Marks runs whose heartbeat stopped (worker killed, machine lost) as failed, with the reason."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from app.db import session_scope
from app.models import Event, Run, utcnow

log = logging.getLogger("collage.reaper")


def reap(engine: Engine, timeout: float) -> list[str]:
    """One pass; returns the ids of the runs it marked failed. Safe to run on many hosts at once: each run is
    moved by a conditional UPDATE, so only one pass wins it."""
    cutoff = utcnow() - timedelta(seconds=timeout)
    reaped = []
    with session_scope(engine) as session:
        stale = session.execute(
            select(Run.id, Run.worker, Run.status).where(
                Run.status.in_(("running", "cancelling")), Run.heartbeat_at < cutoff
            )
        ).all()
        for run_id, worker, status in stale:
            reason = f"no heartbeat for {timeout:.0f}s: worker {worker or '?'} lost (killed, or its machine went away)"
            ended = "cancelled" if status == "cancelling" else "failed"
            result = session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == status, Run.heartbeat_at < cutoff)
                .values(
                    status=ended, error=reason if ended == "failed" else None, finished_at=utcnow(), updated_at=utcnow()
                )
            )
            if result.rowcount == 1:
                session.add(
                    Event(run_id=run_id, level="error" if ended == "failed" else "info", message=f"{ended}: {reason}")
                )
                reaped.append(run_id)
    for run_id in reaped:
        log.warning("run %s marked failed: heartbeat older than %ss", run_id, timeout)
    return reaped


class Reaper(threading.Thread):
    def __init__(self, engine: Engine, timeout: float, every: float | None = None):
        super().__init__(name="collage-reaper", daemon=True)
        self.engine = engine
        self.timeout = timeout
        self.every = every if every is not None else max(0.5, timeout / 4)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                reap(self.engine, self.timeout)
            except Exception:  # noqa: BLE001 - the store may be briefly unavailable; try again next time
                log.exception("reaper pass failed")

    def stop(self) -> None:
        self.stopped.set()
