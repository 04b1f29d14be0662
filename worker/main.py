"""``collage worker``: one Celery worker = one GPU slot (a set of GPUs, or the CPU), one run at a time."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from celery import signals

from collage.app.core.settings import get_settings
from collage.app.store.engine import check_migrated, engine_for
from collage.app.store.jobs import broker_queue
from collage.app.store.nodes import node_queue
from collage.training.data.synth import clean_stale_temp_folders

from .shutdown import SHUTDOWN_BOUND, StopFlag, bounded, die_with_parent

log = logging.getLogger("collage.worker")


WORKER_CACHE_UNITS = ("images", "thumbs", "checks", "exports")


def watch_parent(stop: StopFlag) -> None:
    """An embedded worker (started by `collage serve`, which sets COLLAGE_PARENT_PID) stops when serve is gone:
    the kernel's parent-death signal (asked for at start) and, where that is not available, this watch. Both may
    fire; the shutdown runs once."""
    parent = os.environ.get("COLLAGE_PARENT_PID")
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1)
        if stop.requested:
            return  # the parent-death signal came first
        log.warning("collage serve (pid %s) is gone: stopping this embedded worker", parent)
        stop.request(f"collage serve (pid {parent}) is gone")
        os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown: finish the current task, then exit

    threading.Thread(target=watch, name="collage-parent-watch", daemon=True).start()


def run_worker(
    queues: list[str], gpus: list[int], name: str | None = None, loglevel: str = "INFO", quiet: bool = False
) -> None:
    parent = os.environ.get("COLLAGE_PARENT_PID")
    if parent:  # an embedded worker of `collage serve`: SIGTERM (a shutdown, with checkpoint) when serve dies
        die_with_parent(int(parent), signal.SIGTERM)
    settings = get_settings()
    engine = engine_for(settings.database_url)
    if (mirror := settings.mirror()) is not None:  # the bucket exists before the first run writes to it
        mirror.ensure_bucket()
    check_migrated(engine)
    from . import tasks
    from .celery_app import celery_app, declare_embedded_queues
    from .queueing import Reconciler
    from .reaper import Reaper
    from .registry import Registration
    from .supervisor import Slot

    removed = clean_stale_temp_folders()  # what a crash (of any worker sharing this COLLAGE_HOME) left half-written
    if removed:
        log.warning("removed %d unfinished synthetic dataset folder(s) left by an earlier crash", removed)
    name = name or f"collage-{socket.gethostname()}-{os.getpid()}"
    tasks.SLOT = Slot(gpus=gpus)
    disks = {"home": settings.home, "artifacts": settings.artifacts}  # with a bucket, the artifacts are its cache
    registration = Registration(engine, name, queues, gpus, every=settings.heartbeat_interval, disks=disks)
    registration.beat()
    registration.start()
    tasks.REGISTRATION = registration
    reaper = Reaper(engine, settings.heartbeat_timeout)
    reaper.start()
    reconciler = Reconciler(settings, engine, queues)  # runs whose broker message was lost are sent again
    reconciler.start()
    # the cache of the bucket stays bounded; the runs' folders are the training's own (its checkpoints)
    pruner = settings.cache_pruner(kinds=WORKER_CACHE_UNITS)
    if pruner is not None:
        pruner.start()

    stop = tasks.STOP

    @signals.worker_shutting_down.connect(weak=False)
    def _on_shutdown(sig: str = "a signal", **_kwargs):
        # runs inside Celery's signal handler: raise the flag, nothing else. The supervisor (watching the run)
        # asks the run to checkpoint and stop, once, outside the handler; `resume` continues it later
        stop.request(f"worker {name} is shutting down ({sig})")

    watch_parent(stop)
    # each queue's runs, and its jobs (exports, playground generations) on a queue of their own (app.store.jobs)
    # and its own queue, where the worker that claims a run on several hosts sends this one its part
    consumed = [*queues, *(broker_queue(q) for q in queues), node_queue(name)]
    log.info("worker %s: queues %s, GPU slot %s", name, ",".join(queues), gpus or "CPU")
    try:
        declare_embedded_queues(celery_app, settings.broker_url, consumed)
        celery_app.worker_main(
            (["--quiet"] if quiet else [])  # a global option of Celery's command line: before "worker"
            + ["worker", "--pool", "solo", "--concurrency", "1", "--queues", ",".join(consumed), "--hostname", name,
               "--loglevel", loglevel, "--without-gossip", "--without-mingle", "--without-heartbeat"]
        )  # fmt: skip
    finally:
        reaper.stop()
        reconciler.stop()
        if pruner is not None:
            pruner.stop()
        bounded(registration.stop, SHUTDOWN_BOUND, "leaving the worker registry")
