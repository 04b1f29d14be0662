"""The API's dispatcher on Celery: queue a run, forward cancellation, report broker and workers."""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError

from collage.app.core.settings import Settings
from collage.app.store.jobs import broker_queue
from collage.app.store.workers import live_workers

from .celery_app import JOB_TASK_NAME, TASK_NAME, make_celery

PUBLISH_ATTEMPTS = 4


class CeleryDispatcher:
    def __init__(self, settings: Settings, engine: Engine):
        self.settings = settings
        self.engine = engine
        self.celery = make_celery(settings)
        # one broker conversation at a time per web process: kombu's virtual transports (the embedded SQLite
        # broker) keep channel state that threads should not share. A publish once failed in CI with "'NoneType'
        # object has no attribute 'client'" while other request threads (GET /health) used the broker too
        self._broker = threading.Lock()

    def submit(self, run_id: str, queue: str) -> None:
        # retry publishing through a short broker outage; past that the API marks the run failed (503)
        self._publish(TASK_NAME, run_id, queue)

    def submit_job(self, job_id: str, queue: str) -> None:
        # on the queue's jobs queue (app.store.jobs.broker_queue): a worker of `queue` takes both kinds of message
        self._publish(JOB_TASK_NAME, job_id, broker_queue(queue))

    def _publish(self, task: str, arg: str, queue: str) -> None:
        """``send_task`` with Celery's retry through connection errors, and a few more tries through the embedded
        SQLite broker's races with other processes: a worker declaring the same queue at the same moment
        (``UNIQUE constraint failed: kombu_queue.name``: nothing was published; the retry's first look finds the
        queue the other process made) or holding the file's lock (tests/test_dispatch_race.py)."""
        for attempt in range(PUBLISH_ATTEMPTS):
            with self._broker:
                try:
                    self.celery.send_task(
                        task, args=[arg], queue=queue, retry=True,
                        retry_policy={"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5,
                                      "interval_max": 2},
                    )  # fmt: skip
                    return
                except (IntegrityError, OperationalError):
                    if attempt == PUBLISH_ATTEMPTS - 1:
                        raise
            time.sleep(0.2 * (attempt + 1))

    def cancel(self, run_id: str) -> None:
        """Nothing to send: the run's status is now ``cancelling`` in the store, which its training process
        polls every step and its supervisor every half second (killing it after the grace period)."""

    def health(self) -> dict[str, Any]:
        url = self.settings.broker_url
        safe = url.split("@")[-1] if "@" in url else url
        try:
            with self._broker, self.celery.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, timeout=2)
            broker = {"ok": True, "url": safe}
        except Exception as exc:  # noqa: BLE001
            broker = {"ok": False, "url": safe, "error": f"{type(exc).__name__}: {exc}"}
        workers = live_workers(self.engine, within=3 * self.settings.heartbeat_interval + 5)
        return {"broker": broker, "workers": workers}
