"""``collage worker``: one Celery worker = one GPU slot (a set of GPUs, or the CPU), one run at a time."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from celery import signals

from collage.app.db import check_migrated, engine_for
from collage.app.settings import get_settings
from collage.app.status import RunStatus
from collage.app.store.writer import StoreWriter
from collage.training.data.synth import clean_stale_temp_folders

log = logging.getLogger("collage.worker")


def watch_parent() -> None:
    """An embedded worker (started by `collage serve`, which sets COLLAGE_PARENT_PID) stops when serve is gone,
    even after kill -9 of serve where the kernel's parent-death signal is not available."""
    parent = os.environ.get("COLLAGE_PARENT_PID")
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1)
        log.warning("collage serve (pid %s) is gone: stopping this embedded worker", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="collage-parent-watch", daemon=True).start()


def run_worker(
    queues: list[str], gpus: list[int], name: str | None = None, loglevel: str = "INFO", quiet: bool = False
) -> None:
    settings = get_settings()
    engine = engine_for(settings.database_url)
    check_migrated(engine)
    from . import tasks
    from .celery_app import celery_app
    from .reaper import Reaper
    from .registry import Registration
    from .supervisor import Slot

    removed = clean_stale_temp_folders()  # what a crash (of any worker sharing this COLLAGE_HOME) left half-written
    if removed:
        log.warning("removed %d unfinished synthetic dataset folder(s) left by an earlier crash", removed)
    name = name or f"collage-{socket.gethostname()}-{os.getpid()}"
    tasks.SLOT = Slot(gpus=gpus)
    registration = Registration(engine, name, queues, gpus, every=settings.heartbeat_interval)
    registration.beat()
    registration.start()
    tasks.REGISTRATION = registration
    reaper = Reaper(engine, settings.heartbeat_timeout)
    reaper.start()

    writer = StoreWriter(engine, settings.artifacts)

    @signals.worker_shutting_down.connect(weak=False)
    def _on_shutdown(**_kwargs):
        # a stopping worker asks its run to checkpoint and stop; `resume` continues it later
        run_id = registration.current_run
        if run_id is not None:
            writer.transition(
                run_id,
                [RunStatus.RUNNING],
                RunStatus.CANCELLING,
                message=f"worker {name} is shutting down: checkpoint, then stop",
            )

    watch_parent()
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
