"""``collage worker``: one Celery worker = one GPU slot (a set of GPUs, or the CPU), one run at a time."""

from __future__ import annotations

import logging
import os
import socket

from celery import signals
from sqlmodel import col

from collage.app.db import check_migrated, engine_for, session_scope
from collage.app.models import Event, Run
from collage.app.settings import get_settings
from collage.app.status import RunStatus
from collage.app.store.sql import changed_rows

log = logging.getLogger("collage.worker")


def run_worker(
    queues: list[str], gpus: list[int], name: str | None = None, loglevel: str = "INFO", quiet: bool = False
) -> None:
    settings = get_settings()
    engine = engine_for(settings.database_url)
    check_migrated(engine)
    from sqlalchemy import update

    from . import tasks
    from .celery_app import celery_app
    from .reaper import Reaper
    from .registry import Registration
    from .supervisor import Slot

    name = name or f"collage-{socket.gethostname()}-{os.getpid()}"
    tasks.SLOT = Slot(gpus=gpus)
    registration = Registration(engine, name, queues, gpus, every=settings.heartbeat_interval)
    registration.beat()
    registration.start()
    tasks.REGISTRATION = registration
    reaper = Reaper(engine, settings.heartbeat_timeout)
    reaper.start()

    @signals.worker_shutting_down.connect(weak=False)
    def _on_shutdown(**_kwargs):
        # a stopping worker asks its run to checkpoint and stop; `resume` continues it later
        run_id = registration.current_run
        if run_id is None:
            return
        with session_scope(engine) as session:
            moved = changed_rows(
                session,
                update(Run)
                .where(col(Run.id) == run_id, col(Run.status) == RunStatus.RUNNING)
                .values(status=RunStatus.CANCELLING),
            )
            if moved:
                session.add(
                    Event(
                        run_id=run_id, level="warning", message=f"worker {name} is shutting down: checkpoint, then stop"
                    )
                )

    log.info("worker %s: queues %s, GPU slot %s", name, ",".join(queues), gpus or "CPU")
    try:
        celery_app.worker_main(
            (["--quiet"] if quiet else [])  # a global option of Celery's command line: before "worker"
            + ["worker", "--pool", "solo", "--concurrency", "1", "--queues", ",".join(queues), "--hostname", name,
               "--loglevel", loglevel, "--without-gossip", "--without-mingle", "--without-heartbeat"]
        )  # fmt: skip
    finally:
        reaper.stop()
        registration.stop()
