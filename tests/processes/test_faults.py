"""Faults with real parts: full disks (a real, small tmpfs file system) under real workers and training
processes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import API
from tests.support.cluster import embedded_cluster
from tests.support.services import require_service
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes and mounts")


# ------------------------------------------------------------------------------------------------ a full disk
@pytest.fixture
def small_fs(tmp_path):
    """A real file system of 16 MiB (tmpfs), mounted for the test: ``mount(size)`` gives the mount point."""
    mounted: list[Path] = []

    def mount(size: str = "16m") -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(point)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            require_service(f"cannot mount a tmpfs to fill up (needs root): {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill ``folder``'s file system until ``leave`` bytes are left (0: until a write fails with ENOSPC)."""
    filler = folder / f"filler-{time.monotonic_ns()}"
    with open(filler, "wb", buffering=0) as fh:
        while True:
            free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
            chunk = min(1 << 16, free - leave) if leave else 1 << 16
            if chunk <= 0:
                break
            try:
                fh.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    return filler


def test_health_reports_a_disk_low_on_space_before_it_fills(small_fs, tmp_path):
    from fastapi.testclient import TestClient

    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for, upgrade
    from collage.app.store.tokens import create_token
    from tests.support.api import RecordingDispatcher

    home = small_fs("16m")
    database = f"sqlite:///{home / 'collage.db'}"
    upgrade(database)
    settings = Settings(home=home, database_url=database, broker_url="memory://", artifacts=tmp_path / "artifacts",
                        min_free_disk_mb=4)  # fmt: skip
    app = create_app(settings, RecordingDispatcher())
    client = TestClient(
        app, headers={"Authorization": f"Bearer {create_token(engine_for(database), 'h', role='admin')}"}
    )

    def home_fs() -> dict:
        disk = client.get(API + "/health").json()["disk"]
        return next(f for f in disk["filesystems"] if "home" in f["paths"]) | {"disk_ok": disk["ok"]}

    before = home_fs()
    assert before["paths"] == {"home": str(home), "store": str(home)} and not before["low"] and before["disk_ok"]
    assert before["total_bytes"] == 16 << 20
    filler = fill(home, leave=2 << 20)  # 2 MiB left: below the 4 MiB threshold, nothing has failed yet
    low = home_fs()
    assert low["low"] and not low["disk_ok"] and low["free_bytes"] < 4 << 20
    response = client.get(API + "/health")
    assert response.status_code == 200 and response.json()["ok"], "the service itself is fine"
    assert TestClient(app).get(API + "/health").json() == {"ok": True}, "no details without a token"
    filler.unlink()
    assert not home_fs()["low"]


def test_artifacts_on_a_full_disk_fail_the_run_clearly_and_leave_no_partial_checkpoint(small_fs, tmp_path):
    """The first checkpoint (about 3 MiB) does not fit: the run fails naming the checkpoint and the space left,
    and the half-written step folder is gone."""
    artifacts = small_fs("2m")
    cluster = embedded_cluster(tmp_path, artifacts=artifacts)
    try:
        cluster.start_worker("w1")
        run_id = cluster.submit(max_steps=6)
        run = cluster.wait_status(run_id, ("failed", "succeeded"), timeout=240)
    finally:
        cluster.stop_all()
    assert run["status"] == "failed", cluster.events(run_id)
    assert "no space left on device: writing the checkpoint" in run["error"], run["error"]
    assert (
        f"{artifacts}/runs/{run_id}/attempt-1/checkpoints/step-2" in run["error"] and " free of 2.0 MiB" in run["error"]
    )
    failed = [m for m in cluster.events(run_id) if m.startswith("failed:")]
    assert len(failed) == 1 and "no space left on device" in failed[0], cluster.events(run_id)
    assert not list(artifacts.rglob("*.tmp")), "no partial checkpoint folder is left"


def test_a_store_on_a_full_disk_fails_the_run_naming_it(small_fs, tmp_path):
    """The SQLite store's disk (COLLAGE_HOME's, in the default set-up) fills up mid-run. The writer does not
    retry "database or disk is full" as if a connection had dropped: the training stops at once. The store
    cannot record that until some space is freed; then the run is failed, in the words of the moment it
    filled: the store's path and the space left, never "no heartbeat" or a silent `running`."""
    from sqlmodel import Session

    from collage.app.store.engine import upgrade
    from collage.app.store.tables import Run
    from tests.support.cluster import Cluster

    store = small_fs("24m")
    database = f"sqlite:///{store / 'collage.db'}"
    upgrade(database)
    home = tmp_path / "home"  # caches and worker logs elsewhere: a log on the full disk would say nothing
    home.mkdir()
    cluster = Cluster(database, f"sqla+sqlite:///{store / 'broker.db'}", home, tmp_path / "artifacts")

    def stored() -> Run:  # from the store itself: reads need no space (the API's token check writes)
        with Session(cluster.engine) as session:
            run = session.get(Run, run_id)
            assert run is not None
            return run

    def training() -> bool:
        return bool(subprocess.run(["pgrep", "-f", f"collage.worker.child {run_id}"], capture_output=True).stdout)

    try:
        cluster.start_worker("w1")
        run_id = cluster.submit(max_steps=60, delay=0.3)
        cluster.wait_step(run_id, 2)
        filler = fill(store)
        cluster.wait(lambda: not training(), "the training to stop on the full store", timeout=120)
        assert stored().status == "running", "nothing could be recorded yet"
        filler.unlink()  # someone frees space
        run = wait_for(
            stored,
            "the run's end to be recorded",
            until=lambda r: r.status != "running",
            timeout=60,
            logs=list(cluster.logs.values()),
        )
    finally:
        cluster.stop_all()
    assert run.status == "failed", (run.status, run.error, cluster.events(run_id))
    assert run.error.startswith("no space left on device: writing to the store " + str(store / "collage.db"))
    assert " free of 24.0 MiB" in run.error and "retrying" not in cluster.logs["w1"].read_text()
    assert run.step < 60


def test_a_fixed_copy_on_a_full_disk_is_one_line_and_leaves_nothing(small_fs, tmp_path, capsys):
    """`collage data check --fix OUT` on a disk that fills up: exit 2, one line naming what could not be written,
    no traceback, and no half-written copy left behind."""
    from collage.app.cli.main import main
    from collage.training.data.synth import write_synth

    source = write_synth("count-red", tmp_path / "data", rows=60, min_images=2, max_images=3, seed=0, size=112)
    point = small_fs("16m")
    fill(point, leave=64 << 10)  # room for a few images, not for 60 rows of them
    out = point / "fixed"
    assert main(["data", "check", str(source), "--fix", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"collage: error: --fix {out}: could not write "), err
    assert "No space left on device" in err[0] and "Traceback" not in err[0]
    assert not out.exists()


def test_a_sharded_checkpoint_on_a_full_disk_fails_the_run_clearly_and_leaves_no_partial_folder(small_fs, tmp_path):
    """FSDP2 on two processes: each writes its shards of the first checkpoint (torch.distributed.checkpoint) into
    a staging folder on a disk too small for them; the run fails naming the checkpoint and the space left, once,
    and no staging folder is left."""
    artifacts = small_fs("2m")
    cluster = embedded_cluster(tmp_path, artifacts=artifacts)
    try:
        cluster.start_worker("w1")
        run_id = cluster.submit(max_steps=6, resources={"gpus": 0, "processes": 2, "strategy": "fsdp"})
        run = cluster.wait_status(run_id, ("failed", "succeeded"), timeout=300)
    finally:
        cluster.stop_all()
    assert run["status"] == "failed", cluster.events(run_id)
    assert "no space left on device: writing the checkpoint" in run["error"], run["error"]
    assert f"{artifacts}/runs/{run_id}/attempt-1/checkpoints/step-2" in run["error"], run["error"]
    assert " free of 2.0 MiB" in run["error"], run["error"]
    failed = [m for m in cluster.events(run_id) if m.startswith("failed:")]
    assert len(failed) == 1 and "no space left on device" in failed[0], cluster.events(run_id)
    assert not list(artifacts.rglob("*.tmp")), "no partial checkpoint folder is left"
