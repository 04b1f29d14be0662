"""The Celery task: one run, idempotent (the store claim decides whether this delivery does anything)."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Task
from sqlalchemy import select
from sqlmodel import Session, col

from collage.app.core.settings import Settings, get_settings
from collage.app.store.engine import engine_for
from collage.app.store.nodes import node_of, node_queue, nodes_of, release, reservation, start_node
from collage.app.store.queueing import queue_of
from collage.app.store.tables import Run, RunNode
from collage.app.store.writer import StoreWriter

from .celery_app import FOLLOW_TASK_NAME, TASK_NAME, celery_app
from .queueing import claim_next
from .registry import Registration
from .shutdown import StopFlag
from .supervisor import Gang, Slot, run_claimed

log = logging.getLogger("collage.worker")

# set by `collage worker` in the worker process before it consumes anything
SLOT = Slot(gpus=[])
REGISTRATION: Registration | None = None
STOP = StopFlag()  # raised by the worker's signal handling; the supervisor stops the run it watches


@celery_app.task(bind=True, name=TASK_NAME, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_training(self: Task, run_id: str) -> str | None:
    """One message = one token of its queue: the run started is the one that has waited longest there
    (``queueing.claim_next``), usually ``run_id`` itself. A worker that another run's claim has reserved as one
    of its hosts serves that run first (the message that tells it so may still be on its way)."""
    settings = get_settings()
    writer = StoreWriter(engine_for(settings.database_url), settings.artifacts)
    worker = _name()
    if STOP.requested:  # shutting down: take nothing new (the run stays queued; reconciliation re-sends it)
        log.info("run %s: this worker is shutting down, not starting it", run_id)
        return None
    _follow_reservation(writer, worker)
    gang = Gang(settings.node_address, settings.rendezvous_port, live_within=3 * settings.heartbeat_interval + 5)
    run = claim_next(writer, _queue(self, writer, run_id), worker, gang)
    if run is None:
        _follow_reservation(writer, worker)
        log.info("message for run %s: no run is queued in its queue (already claimed, cancelled or deleted)", run_id)
        return None
    node = None
    if nodes_of(run.config) > 1:
        node = node_of(writer.engine, run.id, run.attempt, worker)
        for follower in _followers(writer, run):
            try:
                follow_run.apply_async(args=[run.id, run.attempt], queue=node_queue(follower))
            except Exception:  # the broker is away: a follower that never starts puts the run back in its queue
                log.exception("run %s: could not send worker %s its part", run.id, follower)
    try:
        return run_claimed(writer, run, worker, SLOT, node=node, address=settings.node_address, **_options(settings))
    finally:
        release(writer.engine, worker, run.id)


@celery_app.task(bind=True, name=FOLLOW_TASK_NAME, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def follow_run(self: Task, run_id: str, attempt: int) -> str | None:
    """This worker's part of a run on several hosts, sent to its own queue by the worker that claimed the run. A
    no-op when the part was already served (a redelivery) or the attempt is no longer running."""
    settings = get_settings()
    return _follow(StoreWriter(engine_for(settings.database_url), settings.artifacts), _name(), run_id, attempt)


def _follow_reservation(writer: StoreWriter, worker: str) -> None:
    reserved = reservation(writer.engine, worker)
    if reserved is not None:
        _follow(writer, worker, *reserved)


def _follow(writer: StoreWriter, worker: str, run_id: str, attempt: int) -> str | None:
    settings = get_settings()
    try:
        node = start_node(writer.engine, run_id, attempt, worker)
        if node is None:
            log.info("run %s attempt %s: no part of it is waiting for this worker", run_id, attempt)
            return None
        with Session(writer.engine, expire_on_commit=False) as session:
            run = session.get(Run, run_id)
        if run is None:
            return None
        log.info("run %s attempt %s: this worker is node %d of %d", run_id, attempt, node.rank, node.nodes)
        return run_claimed(writer, run, worker, SLOT, node=node, address=settings.node_address, **_options(settings))
    finally:
        release(writer.engine, worker, run_id)


def _followers(writer: StoreWriter, run: Run) -> list[str]:
    with Session(writer.engine) as session:
        rows = session.scalars(select(col(RunNode.worker)).where(
            col(RunNode.run_id) == run.id, col(RunNode.attempt) == run.attempt, col(RunNode.rank) > 0)).all()  # fmt: skip
    return list(rows)


def _options(settings: Settings) -> dict[str, Any]:
    return {
        "cancel_grace": settings.cancel_grace,
        "heartbeat_every": settings.heartbeat_interval,
        "heartbeat_timeout": settings.heartbeat_timeout,
        "start_timeout": settings.child_start_timeout,
        "stop": STOP,
        "nice": settings.training_nice(embedded=bool(os.environ.get("COLLAGE_PARENT_PID"))),
    }


def _name() -> str:
    return REGISTRATION.name if REGISTRATION is not None else "worker"


def _queue(task: Task, writer: StoreWriter, run_id: str) -> str:
    """The queue the message came from (its routing key), else the queue the named run's config gives."""
    routed = (task.request.delivery_info or {}).get("routing_key")
    if routed and (REGISTRATION is None or routed in REGISTRATION.queues):
        return str(routed)
    with Session(writer.engine) as session:
        run = session.get(Run, run_id)
    return queue_of(run.config) if run is not None else "default"
