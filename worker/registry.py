"""Workers announce themselves in the store every few seconds: ``GET /health`` lists the live ones."""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.db import session_scope
from collage.app.models import Worker, table_of, utcnow
from collage.app.store.sql import upsert


class Registration(threading.Thread):
    def __init__(self, engine: Engine, name: str, queues: list[str], gpus: list[int], every: float = 5.0):
        super().__init__(name="collage-registration", daemon=True)
        self.engine, self.name, self.queues, self.gpus, self.every = engine, name, queues, gpus, every
        self.stopped = threading.Event()
        self.current_run: str | None = None

    def beat(self) -> None:
        row = {"name": self.name, "hostname": socket.gethostname(), "pid": os.getpid(), "queues": self.queues,
               "gpus": self.gpus, "current_run_id": self.current_run, "started_at": utcnow(), "last_seen": utcnow()}  # fmt: skip
        with session_scope(self.engine) as session:
            upsert(
                session,
                table_of(Worker),
                [row],
                ["name"],
                ["hostname", "pid", "queues", "gpus", "current_run_id", "last_seen"],
            )

    def set_run(self, run_id: str | None) -> None:
        self.current_run = run_id
        self.beat()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - try again next time
                pass

    def stop(self) -> None:
        self.stopped.set()
        with session_scope(self.engine) as session:
            session.execute(delete(Worker).where(col(Worker.name) == self.name))


def live_workers(engine: Engine, within: float) -> list[dict]:
    cutoff = utcnow() - timedelta(seconds=within)
    with Session(engine) as session:
        rows = session.scalars(select(Worker).where(col(Worker.last_seen) >= cutoff).order_by(Worker.name)).all()
        return [
            {"name": w.name, "hostname": w.hostname, "pid": w.pid, "queues": w.queues, "gpu_slots": w.gpus,
             "current_run": w.current_run_id, "last_seen": w.last_seen.isoformat()}
            for w in rows
        ]  # fmt: skip


def forget_stale(engine: Engine, older_than: float) -> None:
    cutoff = utcnow() - timedelta(seconds=older_than)
    with session_scope(engine) as session:
        session.execute(delete(Worker).where(col(Worker.last_seen) < cutoff))
