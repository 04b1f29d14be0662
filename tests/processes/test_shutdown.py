"""Stopping workers, with real processes on the embedded defaults (SQLite store, SQLite broker): signals only
set a flag, one shutdown path runs outside the handler, the run gets its stop checkpoint and ends cancelled
(resumable), the store is never left locked, and `collage serve` killed with SIGKILL takes every embedded
worker with it, a restarted one included."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlmodel import Session

from collage.app.store.tables import Checkpoint
from tests.support import API
from tests.support.cluster import alive, children_of
from tests.support.serve import Serve
from tests.support.waiting import scaled, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc: Linux")


def _store_takes_a_write_at_once(database: Path) -> None:
    """A write transaction that may wait 2 s (scaled) for SQLite's lock at most: a store left locked fails this."""
    connection = sqlite3.connect(database, timeout=scaled(2))
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("UPDATE workers SET last_seen = last_seen")
        connection.commit()
    finally:
        connection.close()


def test_two_sigterms_in_quick_succession_stop_the_worker_once_with_a_checkpoint(embedded):
    cluster = embedded
    cluster.env["COLLAGE_TRAIN_NICE"] = "7"
    worker = cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=16, delay=0.4)  # long enough to be stopped mid-run; resumed to its end
    cluster.wait_step(run_id, 2)
    # the training runs at the asked CPU priority, its session's autogroup too (Linux weighs nice values only
    # within an autogroup)
    child = int(subprocess.run(["pgrep", "-f", f"collage.worker.child {run_id}"], capture_output=True,
                               text=True).stdout.split()[0])  # fmt: skip
    assert os.getpriority(os.PRIO_PROCESS, child) == 7
    autogroup = Path(f"/proc/{child}/autogroup")
    assert not autogroup.exists() or autogroup.read_text().split()[-1] == "7", autogroup.read_text()
    # two SIGTERMs back to back (a supervisor and `kill` both stopping it, or serve's parent-death signal and its
    # watcher), then a burst once the first one's shutdown is under way
    worker.send_signal(signal.SIGTERM)
    worker.send_signal(signal.SIGTERM)
    cluster.wait(lambda: any("is shutting down" in m for m in cluster.events(run_id)), "the shutdown to begin")
    for _ in range(10):
        worker.send_signal(signal.SIGTERM)
    cluster.wait(lambda: worker.poll() is not None, "the worker to exit", timeout=120)
    log = cluster.logs["w1"].read_text()
    run = cluster.run(run_id)
    assert run["status"] == "cancelled", (run["error"], cluster.events(run_id), log[-3000:])
    assert "database is locked" not in log and not run["error"]
    _store_takes_a_write_at_once(Path(cluster.settings.home) / "collage.db")
    events = cluster.events(run_id)
    assert len([m for m in events if "is shutting down" in m]) == 1, events
    assert any(m.startswith("stopped at step") and "checkpoint saved" in m for m in events), events
    stopped_at = run["progress"]["step"]
    with Session(cluster.engine) as session:
        checkpoints = session.execute(
            select(Checkpoint.step, Checkpoint.path).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)
        ).all()
    assert checkpoints[-1][0] == stopped_at and Path(checkpoints[-1][1]).is_dir(), (checkpoints, stopped_at)
    # resumable: a new worker continues it from that checkpoint to the end
    assert cluster.client.post(f"{API}/runs/{run_id}/resume").status_code == 200
    cluster.start_worker("w2")
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=300)
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert any(f"resumed from checkpoint at step {stopped_at}" in m for m in cluster.events(run_id))


def test_serve_killed_with_sigkill_takes_a_restarted_embedded_worker_with_it(tmp_path):
    """An embedded worker that died is restarted by serve (from serve's pool thread, not its main thread);
    after `kill -9` of serve the restarted one, and the first, are gone within a liveness timeout."""
    serve = Serve(tmp_path / "home", "--workers", "2").start()
    try:
        serve.wait_up(workers=2)
        first = children_of(serve.pid)
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)
        restarted = wait_for(lambda: [p for p in children_of(serve.pid) if p not in first], "a restart",
                             timeout=30, logs=[serve.log])  # fmt: skip
        # the restarted worker is up (its Celery consumer and its parent watch both running) before serve dies
        wait_for(serve.worker_pids, "it to register", until=lambda pids: restarted[0] in pids, timeout=90,
                 ignore=(httpx.HTTPError, ValueError, KeyError), logs=[serve.log])  # fmt: skip
    finally:
        serve.kill()
    everyone = [first[1], *restarted]
    wait_for(lambda: [p for p in everyone if alive(p)], "every embedded worker to exit", until=lambda left: not left,
             timeout=60, logs=[serve.log])  # fmt: skip
