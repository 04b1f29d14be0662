"""Marks runs whose heartbeat stopped (worker killed, machine lost) as failed, with the reason."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.core.status import ACTIVE, RunStatus
from collage.app.store.jobs import reap_jobs
from collage.app.store.nodes import free_stale_reservations
from collage.app.store.tables import Run, utcnow
from collage.app.store.workers import forget_stale
from collage.app.store.writer import StoreWriter

log = logging.getLogger("collage.reaper")

STALE_WORKER_AFTER = 24 * 3600.0  # a worker silent this long (killed, host gone) leaves the registry


def reap(engine: Engine, timeout: float) -> list[str]:
    """One pass; returns the ids of the runs it ended. Safe to run on many hosts at once: each run moves by a
    conditional transition (still active, still under the same attempt, heartbeat still stale), so one pass
    wins it, and a training process that beats meanwhile keeps its run."""
    cutoff = utcnow() - timedelta(seconds=timeout)
    writer = StoreWriter(engine, Path("."))
    with Session(engine) as session:
        stale = session.execute(
            select(col(Run.id), col(Run.worker), col(Run.status), col(Run.attempt)).where(
                col(Run.status).in_(list(ACTIVE)), col(Run.heartbeat_at) < cutoff
            )
        ).all()
    reaped = []
    for run_id, worker, status, attempt in stale:
        reason = (
            f"no heartbeat for {timeout:.0f}s: worker {worker or '?'} lost (killed, stopped, or its machine went away)"
        )
        ended = RunStatus.CANCELLED if status == RunStatus.CANCELLING else RunStatus.FAILED
        if writer.transition(
            run_id,
            [status],
            ended,
            when_attempt=attempt,
            where=[col(Run.heartbeat_at) < cutoff],
            error=reason if ended == RunStatus.FAILED else None,
            message=f"{ended}: {reason}",
        ):
            reaped.append(run_id)
            log.warning("run %s attempt %s %s: heartbeat older than %ss", run_id, attempt, ended, timeout)
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
                reap_jobs(self.engine, self.timeout)
                forget_stale(self.engine, older_than=STALE_WORKER_AFTER)
                free_stale_reservations(self.engine)  # a gang claim's reservation whose attempt went nowhere
            except Exception:  # the store may be briefly unavailable: logged, tried again next time
                log.exception("reaper pass failed")

    def stop(self) -> None:
        self.stopped.set()
