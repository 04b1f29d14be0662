"""Which queued run a worker starts, and getting back runs whose broker message was lost.

A broker message is a token, not an order: the worker that receives one from queue Q claims the run that has
waited longest in Q (the order ``GET /runs/{id}`` reports as ``queue_position``: queued at its creation or its
latest resume), whichever run the message names. The claim is a conditional transition (``supervisor.claim``),
so each run starts exactly once however many tokens there are; a token left over when nothing is queued is a
no-op. Runs therefore start in the order they were queued whatever order the broker hands messages out in:
one whose message was lost is never overtaken by a later submit (that submit's token starts it instead).

A lost message (Redis restarted without persistence, a queue flushed, a worker killed between receiving a
message and claiming its run) leaves one token too few. :func:`reconcile`, on every worker at start and then
periodically, counts per queue the runs queued for longer than ``requeue_after`` seconds and the messages
waiting in the broker (Redis: the queue's lists; the embedded SQLite broker: kombu's visible rows), and sends
the difference again, naming the runs that waited longest.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlmodel import Session

from collage.app.core.settings import Settings
from collage.app.store.jobs import broker_queue, queued_jobs
from collage.app.store.queueing import queued_runs
from collage.app.store.tables import Run, utcnow
from collage.app.store.writer import StoreWriter

if TYPE_CHECKING:
    from .supervisor import Gang

log = logging.getLogger("collage.worker")


def claim_next(writer: StoreWriter, queue: str, worker: str, gang: Gang | None = None) -> Run | None:
    """Claim the run of ``queue`` that has waited longest (another worker may win a run: then the next one; a run
    on several hosts whose hosts are not all free waits, and the next one may start); ``None`` when no run is
    queued there (a spare token). ``gang``: how this worker leads a run on several hosts."""
    from .supervisor import claim

    with Session(writer.engine) as session:
        candidates = queued_runs(session, queue)
    for queued in candidates:
        run = claim(writer, queued.run_id, worker, gang)
        if run is not None:
            return run
    return None


# --------------------------------------------------------------------------------------------- reconcile
def waiting_messages(celery_app: Any, queue: str) -> int:
    """Messages waiting in ``queue`` in the broker (not yet handed to a worker)."""
    from kombu.exceptions import ChannelError

    with celery_app.connection_for_read() as connection:
        try:
            return int(connection.default_channel.queue_declare(queue=queue, passive=True).message_count)
        except ChannelError:  # Redis drops an empty queue's key: no such queue is no message
            return 0


def reconcile(
    engine: Engine, celery_app: Any, send: Any, queues: list[str], requeue_after: float, writer: StoreWriter
) -> list[str]:
    """One pass over ``queues``; returns the runs it sent again. ``send(run_id, queue)`` publishes a message."""
    cutoff = utcnow().replace(tzinfo=None) - timedelta(seconds=requeue_after)
    resent: list[str] = []
    for queue in queues:
        with Session(engine) as session:
            waited = [q for q in queued_runs(session, queue) if q.queued_at < cutoff]
        if not waited:
            continue
        missing = len(waited) - waiting_messages(celery_app, queue)
        for queued in waited[: max(0, missing)]:
            send(queued.run_id, queue)
            writer.add_event(
                queued.run_id,
                "warning",
                f"queued for over {requeue_after:.0f}s with no message for it in the broker (lost: the broker "
                f"restarted or its queue {queue!r} was emptied): sent again; it keeps its place in the queue",
            )
            resent.append(queued.run_id)
            log.warning("run %s: no broker message in queue %s: sent again", queued.run_id, queue)
    return resent


def reconcile_jobs(engine: Engine, celery_app: Any, send: Any, queues: list[str], requeue_after: float) -> list[str]:
    """The same for jobs (exports, playground generations), on each queue's jobs queue; ``send(job_id, queue)``."""
    cutoff = utcnow().replace(tzinfo=None) - timedelta(seconds=requeue_after)
    resent: list[str] = []
    for queue in queues:
        with Session(engine) as session:
            waited = [j for j in queued_jobs(session, queue) if j.created_at.replace(tzinfo=None) < cutoff]
        if not waited:
            continue
        missing = len(waited) - waiting_messages(celery_app, broker_queue(queue))
        for job in waited[: max(0, missing)]:
            send(job.id, queue)
            resent.append(job.id)
            log.warning("job %s: no broker message in queue %s: sent again", job.id, broker_queue(queue))
    return resent


class Reconciler(threading.Thread):
    """:func:`reconcile` at start, then every ``requeue_after / 2`` seconds (at least 1), until stopped."""

    def __init__(self, settings: Settings, engine: Engine, queues: list[str]):
        super().__init__(name="collage-reconcile", daemon=True)
        from .dispatcher import CeleryDispatcher

        self.engine, self.queues, self.requeue_after = engine, queues, settings.requeue_after
        self.dispatcher = CeleryDispatcher(settings, engine)
        self.writer = StoreWriter(engine, settings.artifacts)
        self.every = max(1.0, settings.requeue_after / 2)
        self.stopped = threading.Event()

    def pass_once(self) -> list[str]:
        celery = self.dispatcher.celery
        runs = reconcile(self.engine, celery, self.dispatcher.submit, self.queues, self.requeue_after, self.writer)
        return runs + reconcile_jobs(self.engine, celery, self.dispatcher.submit_job, self.queues, self.requeue_after)

    def run(self) -> None:
        while True:
            try:
                self.pass_once()
            except Exception:  # the store or the broker may be briefly away: logged, tried again next time
                log.exception("reconciling the queues with the broker failed")
            if self.stopped.wait(self.every):
                return

    def stop(self) -> None:
        self.stopped.set()
