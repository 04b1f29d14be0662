"""The Celery task of jobs (``app.store.jobs``): an export or a playground generation, one at a time per worker.

A message is a token of its queue: the task claims the job that has waited longest there (exactly once, by a
conditional transition) and hands it to the handler of its kind (:data:`HANDLERS`, imported lazily so that a
worker pays for torch only when a job needs it). The handler gets a :class:`JobContext`: ``progress`` reports how
far it is (and beats), ``cancelled`` says whether the user cancelled it (checked between pieces of work), and a
heartbeat thread beats meanwhile, so a long piece of work is never reaped. What the handler returns is the job's
result; a :class:`JobFailed` is the user's message, anything else fails the job with its type and message (the
traceback goes to the worker's log).
"""

from __future__ import annotations

import importlib
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Task

from collage.app.core.settings import Settings, get_settings
from collage.app.core.status import JobKind, RunStatus
from collage.app.store import jobs as store
from collage.app.store.engine import engine_for
from collage.app.store.tables import Job

from .celery_app import JOB_TASK_NAME, celery_app
from .errors import WorkerError
from .heartbeat import Heartbeat

log = logging.getLogger("collage.worker")

# kind -> "module:function" taking a JobContext and returning the job's result (a JSON object)
HANDLERS: dict[JobKind, str] = {
    JobKind.EXPORT: "collage.worker.export_job:run_export",
    JobKind.GENERATE: "collage.worker.playground.service:run_generate",
}


class JobFailed(WorkerError):
    """A job that cannot be done, in the user's words (a missing checkpoint, an image that cannot be read)."""


class JobCancelled(WorkerError):
    """Raised by :meth:`JobContext.check` once the job was cancelled: the task ends it ``cancelled``."""


@dataclass
class JobContext:
    job: Job
    settings: Settings
    worker: str

    @property
    def engine(self):
        return engine_for(self.settings.database_url)

    def progress(self, fraction: float, message: str | None = None) -> None:
        """Report progress (0..1); raises :class:`JobCancelled` when the job was cancelled meanwhile."""
        if not store.report_progress(self.engine, self.job.id, fraction, message):
            raise JobCancelled(f"job {self.job.id} was cancelled")

    def cancelled(self) -> bool:
        return store.cancel_requested(self.engine, self.job.id)

    def check(self) -> None:
        if self.cancelled():
            raise JobCancelled(f"job {self.job.id} was cancelled")


def handler_for(kind: str) -> Callable[[JobContext], dict[str, Any]]:
    module, _, name = HANDLERS[JobKind(kind)].partition(":")
    return getattr(importlib.import_module(module), name)


def run_job(job: Job, settings: Settings, worker: str) -> str:
    """Run a claimed job to its end; returns its final status."""
    engine = engine_for(settings.database_url)
    context = JobContext(job, settings, worker)
    heartbeat = Heartbeat(lambda: store.beat(engine, job.id), settings.heartbeat_interval, f"collage-job-{job.id}")
    heartbeat.start()
    try:
        result = handler_for(job.kind)(context)
    except JobCancelled:
        store.finish_job(engine, job.id, RunStatus.CANCELLED, message="cancelled")
        return RunStatus.CANCELLED
    except JobFailed as exc:
        store.finish_job(engine, job.id, RunStatus.FAILED, error=str(exc), message=f"failed: {exc}"[:2000])
        return RunStatus.FAILED
    except Exception as exc:  # noqa: BLE001 - every failure ends the job with a message
        log.error("job %s (%s) failed:\n%s", job.id, job.kind, traceback.format_exc())
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:1000]
        store.finish_job(engine, job.id, RunStatus.FAILED, error=error, message=f"failed: {error}")
        return RunStatus.FAILED
    finally:
        heartbeat.stop(wait=False)
    if context.cancelled():  # the handler finished its last piece after a cancel: the cancel wins
        store.finish_job(engine, job.id, RunStatus.CANCELLED, message="cancelled")
        return RunStatus.CANCELLED
    store.finish_job(engine, job.id, RunStatus.SUCCEEDED, result=result, message="done")
    return RunStatus.SUCCEEDED


@celery_app.task(bind=True, name=JOB_TASK_NAME, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job_task(self: Task, job_id: str) -> str | None:
    """One message = one token of its queue: the job started is the one that has waited longest there."""
    from . import tasks

    settings = get_settings()
    engine = engine_for(settings.database_url)
    if tasks.STOP.requested:  # shutting down: take nothing new (reconciliation sends the token again)
        return None
    named = store.get_job(engine, job_id)
    queue = named.queue if named is not None else (self.request.delivery_info or {}).get("routing_key", "default")
    queue = queue.removesuffix(store.JOBS_SUFFIX)
    worker = tasks.REGISTRATION.name if tasks.REGISTRATION is not None else "worker"
    job = store.claim_next_job(engine, queue, worker)
    if job is None:
        log.info("message for job %s: no job is queued in %s (already claimed or cancelled)", job_id, queue)
        return None
    log.info("job %s (%s) of queue %s: starting", job.id, job.kind, queue)
    return run_job(job, settings, worker)
