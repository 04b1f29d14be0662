"""The Celery task: one run, idempotent (the store claim decides whether this delivery does anything)."""

from __future__ import annotations

import logging
import os

from collage.app.db import engine_for
from collage.app.settings import get_settings
from collage.app.store.writer import StoreWriter

from .celery_app import TASK_NAME, celery_app
from .registry import Registration
from .shutdown import StopFlag
from .supervisor import Slot, supervise

log = logging.getLogger("collage.worker")

# set by `collage worker` in the worker process before it consumes anything
SLOT = Slot(gpus=[])
REGISTRATION: Registration | None = None
STOP = StopFlag()  # raised by the worker's signal handling; the supervisor stops the run it watches


@celery_app.task(name=TASK_NAME, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_training(run_id: str) -> str | None:
    settings = get_settings()
    engine = engine_for(settings.database_url)
    writer = StoreWriter(engine, settings.artifacts)
    worker = REGISTRATION.name if REGISTRATION is not None else "worker"
    if STOP.requested:  # shutting down: take nothing new (the run stays queued; reconciliation re-sends it)
        log.info("run %s: this worker is shutting down, not starting it", run_id)
        return None
    if REGISTRATION is not None:
        REGISTRATION.set_run(run_id)
    try:
        return supervise(
            writer,
            run_id,
            worker,
            SLOT,
            cancel_grace=settings.cancel_grace,
            heartbeat_every=settings.heartbeat_interval,
            stop=STOP,
            nice=settings.training_nice(embedded=bool(os.environ.get("COLLAGE_PARENT_PID"))),
        )
    finally:
        if REGISTRATION is not None:
            REGISTRATION.set_run(None)
