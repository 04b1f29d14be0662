"""Marks runs whose heartbeat stopped (worker killed, machine lost) as failed, with the reason."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import col

from collage.app.db import session_scope
from collage.app.models import Event, Run, utcnow
from collage.app.status import RunStatus
from collage.app.store.sql import changed_rows

from .registry import forget_stale

log = logging.getLogger("collage.reaper")

STALE_WORKER_AFTER = 24 * 3600.0  # a worker silent this long (killed, host gone) leaves the registry


def reap(engine: Engine, timeout: float) -> list[str]:
    """One pass; returns the ids of the runs it marked failed. Safe to run on many hosts at once: each run is
    moved by a conditional UPDATE, so only one pass wins it."""
    cutoff = utcnow() - timedelta(seconds=timeout)
    reaped = []
    with session_scope(engine) as session:
        stale = session.execute(
            select(col(Run.id), col(Run.worker), col(Run.status)).where(
                col(Run.status).in_((RunStatus.RUNNING, RunStatus.CANCELLING)), col(Run.heartbeat_at) < cutoff
            )
        ).all()
        for run_id, worker, status in stale:
            reason = f"no heartbeat for {timeout:.0f}s: worker {worker or '?'} lost (killed, or its machine went away)"
            ended = RunStatus.CANCELLED if status == RunStatus.CANCELLING else RunStatus.FAILED
            result = changed_rows(
                session,
                update(Run)
                .where(col(Run.id) == run_id, col(Run.status) == status, col(Run.heartbeat_at) < cutoff)
                .values(
                    status=ended,
                    error=reason if ended == RunStatus.FAILED else None,
                    finished_at=utcnow(),
                    updated_at=utcnow(),
                ),
            )
            if result == 1:
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
                forget_stale(self.engine, older_than=STALE_WORKER_AFTER)
            except Exception:  # the store may be briefly unavailable: logged, tried again next time
                log.exception("reaper pass failed")

    def stop(self) -> None:
        self.stopped.set()
