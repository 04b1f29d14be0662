"""Claim a run, run its training child, watch it: heartbeats, cancellation with a grace period, exit status."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.db import session_scope
from collage.app.models import Event, Run, utcnow
from collage.app.status import RunStatus
from collage.app.store.sql import changed_rows
from collage.app.store.writer import StoreWriter
from collage.training.errors import CollageError

log = logging.getLogger("collage.worker")


@dataclass
class Slot:
    gpus: list[int]  # the GPUs of this worker's slot; empty = CPU


def claim(engine: Engine, run_id: str, worker: str) -> Run | None:
    """Atomically move a queued run to running for this worker. ``None`` if someone else has it (a
    redelivered message), or it was cancelled while queued: the task is then a no-op."""
    now = utcnow()
    with session_scope(engine) as session:
        result = changed_rows(
            session,
            update(Run)
            .where(col(Run.id) == run_id, col(Run.status) == RunStatus.QUEUED)
            .values(status=RunStatus.RUNNING, worker=worker, started_at=now, heartbeat_at=now, updated_at=now),
        )
        if result != 1:
            return None
        session.add(Event(run_id=run_id, level="info", message=f"status: running on {worker}"))
    with Session(engine, expire_on_commit=False) as session:
        return session.get(Run, run_id)


def _status(engine: Engine, run_id: str) -> str | None:
    with Session(engine) as session:
        return session.execute(select(col(Run.status)).where(col(Run.id) == run_id)).scalar_one_or_none()


def child_command(run: Run, slot: Slot) -> tuple[list[str], dict[str, str], str | None]:
    """The training command for this slot, its environment, and a warning worth recording (or ``None``)."""
    wanted = int(run.config.get("resources", {}).get("gpus", 1))
    env = dict(os.environ)
    single = [sys.executable, "-m", "collage.worker.child", run.id]
    if wanted == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
        return single, env, None
    if not slot.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
        return single, env, f"resources.gpus is {wanted} but this worker has no GPU slot: training on the CPU"
    if wanted > len(slot.gpus):
        raise SlotTooSmall(
            f"resources.gpus: the run needs {wanted} GPUs but this worker's slot has {len(slot.gpus)} "
            f"({','.join(map(str, slot.gpus))}); route it with resources.queue to a worker started with "
            f"--gpus listing {wanted} GPUs"
        )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slot.gpus[:wanted]))
    if wanted == 1:
        return single, env, None
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(wanted),
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    return [*launch, "-m", "collage.worker.child", run.id], env, None


class SlotTooSmall(CollageError, RuntimeError):
    pass


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def supervise(engine: Engine, writer: StoreWriter, run_id: str, worker: str, slot: Slot,
              cancel_grace: float = 60.0, poll: float = 0.5) -> str | None:  # fmt: skip
    """Run one claimed run to its end; returns its final status (``None`` if the run was not claimed)."""
    run = claim(engine, run_id, worker)
    if run is None:
        log.info("run %s is not queued (already claimed, cancelled or deleted): nothing to do", run_id)
        return None
    try:
        cmd, env, warning = child_command(run, slot)
    except SlotTooSmall as exc:
        writer.set_status(run_id, RunStatus.FAILED, error=str(exc), message=f"failed: {exc}")
        return RunStatus.FAILED
    if warning:
        writer.add_event(run_id, "warning", warning)
    log.info("run %s: starting %s", run_id, " ".join(cmd))
    # its own session, so the whole process group (accelerate's ranks too) can be killed at once
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    cancel_seen: float | None = None
    while True:
        code = proc.poll()
        if code is not None:
            break
        status = _status(engine, run_id)
        if status in (RunStatus.CANCELLING, RunStatus.CANCELLED, None):
            cancel_seen = cancel_seen or time.monotonic()
            if time.monotonic() - cancel_seen > cancel_grace:
                _kill(proc)
                proc.wait()
                writer.set_status(
                    run_id,
                    RunStatus.CANCELLED,
                    message=f"cancelled: the training did not stop within {cancel_grace:.0f}s and was killed",
                )
                return RunStatus.CANCELLED
        time.sleep(poll)
    final = _status(engine, run_id)
    if final in (RunStatus.RUNNING, RunStatus.CANCELLING):
        # the child died without saying how it ended
        reason = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        ended = RunStatus.CANCELLED if final == RunStatus.CANCELLING else RunStatus.FAILED
        writer.set_status(run_id, ended, error=None if ended == RunStatus.CANCELLED else f"the training process {reason}",
                          message=f"{ended}: the training process {reason}")  # fmt: skip
        final = ended
    log.info("run %s ended %s", run_id, final)
    return final
