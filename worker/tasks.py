"""The Celery task: one run, idempotent (the store claim decides whether this delivery does anything)."""

from __future__ import annotations

import logging
import os

from celery import Task
from sqlmodel import Session

from collage.app.db import engine_for
from collage.app.models import Run
from collage.app.settings import get_settings
from collage.app.store.queueing import queue_of
from collage.app.store.writer import StoreWriter

from .celery_app import TASK_NAME, celery_app
from .queueing import claim_next
from .registry import Registration
from .shutdown import StopFlag
from .supervisor import Slot, run_claimed

log = logging.getLogger("collage.worker")

# set by `collage worker` in the worker process before it consumes anything
SLOT = Slot(gpus=[])
REGISTRATION: Registration | None = None
STOP = StopFlag()  # raised by the worker's signal handling; the supervisor stops the run it watches


@celery_app.task(bind=True, name=TASK_NAME, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_training(self: Task, run_id: str) -> str | None:
    """One message = one token of its queue: the run started is the one that has waited longest there
    (``queueing.claim_next``), usually ``run_id`` itself."""
    settings = get_settings()
    engine = engine_for(settings.database_url)
    writer = StoreWriter(engine, settings.artifacts)
    worker = REGISTRATION.name if REGISTRATION is not None else "worker"
    if STOP.requested:  # shutting down: take nothing new (the run stays queued; reconciliation re-sends it)
        log.info("run %s: this worker is shutting down, not starting it", run_id)
        return None
    run = claim_next(writer, _queue(self, writer, run_id), worker)
    if run is None:
        log.info("message for run %s: no run is queued in its queue (already claimed, cancelled or deleted)", run_id)
        return None
    if REGISTRATION is not None:
        REGISTRATION.set_run(run.id)
    try:
        return run_claimed(
            writer,
            run,
            worker,
            SLOT,
            cancel_grace=settings.cancel_grace,
            heartbeat_every=settings.heartbeat_interval,
            heartbeat_timeout=settings.heartbeat_timeout,
            start_timeout=settings.child_start_timeout,
            stop=STOP,
            nice=settings.training_nice(embedded=bool(os.environ.get("COLLAGE_PARENT_PID"))),
        )
    finally:
        if REGISTRATION is not None:
            REGISTRATION.set_run(None)


def _queue(task: Task, writer: StoreWriter, run_id: str) -> str:
    """The queue the message came from (its routing key), else the queue the named run's config gives."""
    routed = (task.request.delivery_info or {}).get("routing_key")
    if routed and (REGISTRATION is None or routed in REGISTRATION.queues):
        return str(routed)
    with Session(writer.engine) as session:
        run = session.get(Run, run_id)
    return queue_of(run.config) if run is not None else "default"
