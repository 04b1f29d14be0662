"""The Celery app, configured from ``COLLAGE_BROKER_URL`` (Redis in production, SQLite embedded).

Long GPU tasks, done the way Celery's docs advise: one task at a time per worker (prefetch 1, one process per
GPU slot), late acknowledgement so a lost worker's message is redelivered, and a run-level claim in the
database (``worker.tasks``) so a redelivered message never starts the same run twice.
"""

from __future__ import annotations

from pathlib import Path

from celery import Celery

from collage.app.core.settings import Settings, get_settings

from .broker import celery_broker_url

TASK_NAME = "collage.run"
FOLLOW_TASK_NAME = "collage.follow_run"  # a host's part of a run on several hosts (worker/tasks.py)
JOB_TASK_NAME = "collage.job"  # an export or a playground generation (worker/jobs.py)


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    if settings.broker_url.startswith(("redis://", "rediss://")):
        from collage.app.core.extras import require

        require("redis", "a Redis broker (COLLAGE_BROKER_URL)")
    if settings.broker_url.startswith("sqla+sqlite:///"):
        from collage.app.store.engine import private_file

        private_file(Path(settings.broker_url.removeprefix("sqla+sqlite:///")))
    app = Celery(
        "collage",
        broker=celery_broker_url(settings.broker_url),
        include=["collage.worker.tasks", "collage.worker.jobs"],
    )
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_default_queue="default",
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # keep reconnecting through a broker outage
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    if settings.broker_url.startswith(("redis://", "rediss://")):
        # a message not acknowledged within this time is handed out again; the run claim makes that harmless.
        # (Only for Redis: kombu's SQLAlchemy transport would pass any option on to create_engine.)
        app.conf.broker_transport_options = {"visibility_timeout": 6 * 3600}
    return app


celery_app = make_celery()


def declare_embedded_queues(app: Celery, url: str, names: list[str], attempts: int = 5) -> None:
    """On the embedded SQLite broker (``sqla+``), make each queue's row before Celery's consumer starts, trying
    again through the race with another process making the same row (kombu's look-then-insert is not safe across
    processes: ``UNIQUE constraint failed: kombu_queue.name`` stopped a worker of `collage serve` whose web
    process published its first run at the same moment). Each try has a fresh connection. Other brokers are left
    to Celery (declaring a queue here with other options than Celery's would conflict on RabbitMQ)."""
    if not url.startswith("sqla+"):
        return
    import time

    from sqlalchemy.exc import IntegrityError, OperationalError

    for name in names:
        for attempt in range(attempts):
            try:
                with app.connection_for_write() as connection:
                    connection.default_channel.queue_declare(queue=name)
                break
            except (IntegrityError, OperationalError):
                if attempt == attempts - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
