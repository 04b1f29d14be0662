"""Workers as real processes around an in-process API: :class:`Cluster` starts ``collage worker`` processes on a
store and a broker (PostgreSQL and our own Redis, or the embedded SQLite files) and drives them through the app with
the real Celery dispatcher; the run config those tests submit; and small helpers about processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.store.tables import Event, Metric

from . import API, ROOT
from .waiting import scaled, wait_for

# a run whose heartbeat is this old is failed by the reaper: stretched with the time scale, so that a loaded
# machine never makes a live process look frozen (production: 60 s). HEARTBEAT is the deadline tests add to theirs
# (wait_for scales it), HEARTBEAT_TIMEOUT what the processes are told.
HEARTBEAT = 12.0
HEARTBEAT_TIMEOUT = scaled(HEARTBEAT)
CANCEL_GRACE = scaled(30)


class Cluster:
    """Workers as separate processes plus an in-process API using the real Celery dispatcher."""

    def __init__(self, database_url: str, broker_url: str, home: Path, artifacts: Path):
        from fastapi.testclient import TestClient

        from collage.app.core.settings import Settings
        from collage.app.main import create_app
        from collage.app.store.engine import engine_for
        from collage.app.store.tokens import create_token
        from collage.worker.dispatcher import CeleryDispatcher

        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "COLLAGE_HOME": str(home),
            "COLLAGE_DATABASE_URL": database_url,
            "COLLAGE_BROKER_URL": broker_url,
            "COLLAGE_ARTIFACTS": str(artifacts),
            "COLLAGE_HEARTBEAT_INTERVAL": "1",
            "COLLAGE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
            "COLLAGE_CANCEL_GRACE": str(CANCEL_GRACE),
            "COLLAGE_REWARD_MODULES": "tests.support.rewards",
            "OMP_NUM_THREADS": "1",
        }
        self.settings = Settings(home=home, database_url=database_url, broker_url=broker_url, artifacts=artifacts,
                                 heartbeat_interval=1, heartbeat_timeout=HEARTBEAT_TIMEOUT, cancel_grace=CANCEL_GRACE,
                                 reward_modules=("tests.support.rewards",))  # fmt: skip
        self.engine = engine_for(database_url)
        self.app = create_app(self.settings, CeleryDispatcher(self.settings, self.engine))
        token = create_token(self.engine, "workers-test", role="admin")
        self.client = TestClient(self.app, headers={"Authorization": f"Bearer {token}"})
        self.workers: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start_worker(self, name: str, *args: str, wait: bool = True) -> subprocess.Popen:
        """``collage worker --name NAME ARGS...``; with ``wait``, until it is registered."""
        log = Path(self.settings.home) / f"{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "collage.app.cli", "worker", "--name", name, "--loglevel", "INFO", *args],
            env=self.env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.workers[name], self.logs[name] = proc, log
        if wait:
            self.wait(lambda: any(w["name"] == name for w in self.health()["workers"]), f"worker {name} to register")
        return proc

    def stop_all(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=scaled(45))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def health(self) -> dict:
        return self.client.get(API + "/health").json()

    def submit(self, **changes) -> str:
        response = self.client.post(API + "/runs", json=run_config(**changes))
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def run(self, run_id: str) -> dict:
        return self.client.get(f"{API}/runs/{run_id}").json()

    def wait(self, condition, what: str, timeout: float = 240):
        """``condition()``'s first true value, the workers' logs in the failure."""
        return wait_for(condition, what, timeout=timeout, interval=0.2, logs=list(self.logs.values()))

    def wait_status(self, run_id: str, statuses: tuple[str, ...], timeout: float = 240) -> dict:
        return wait_for(lambda: self.run(run_id), f"run {run_id} to be {' or '.join(statuses)}",
                        until=lambda r: r["status"] in statuses, timeout=timeout, interval=0.2,
                        logs=list(self.logs.values()))  # fmt: skip

    def wait_step(self, run_id: str, step: int, timeout: float = 240) -> dict:
        return wait_for(lambda: self.run(run_id), f"run {run_id} to reach step {step}",
                        until=lambda r: r["progress"]["step"] >= step, timeout=timeout, interval=0.2,
                        logs=list(self.logs.values()))  # fmt: skip

    def count(self, model, *where) -> int:
        with Session(self.engine) as session:
            return session.execute(select(func.count()).select_from(model).where(*where)).scalar_one()

    def events(self, run_id: str) -> list[str]:
        with Session(self.engine) as session:
            return list(session.scalars(select(Event.message).where(Event.run_id == run_id).order_by(Event.id)))

    def metric_steps(self, run_id: str, key: str = "reward") -> list[int]:
        """The steps of ``run_id`` that logged ``key``, in order (each step once when nothing was lost or doubled)."""
        with Session(self.engine) as session:
            return list(session.scalars(
                select(Metric.step).where(Metric.run_id == run_id, Metric.key == key).order_by(Metric.step)
            ))  # fmt: skip


def run_config(max_steps: int = 4, delay: float = 0.0, rewards: list | None = None, **changes) -> dict:
    """A tiny Qwen2-VL run on ``count-red``; ``delay`` slows each reward call down (seconds), for tests that act
    while a run is training."""
    config = {
        "name": "worker-test",
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": "synth:count-red", "rows": 24, "min_images": 0, "max_images": 3},
        "rewards": rewards or [{"name": "numeric"}, {"name": "tests.support.rewards:sleepy", "args": {"delay": delay}}],
        "train": {"max_steps": max_steps, "per_device_train_batch_size": 8, "num_generations": 4,
                  "max_completion_length": 6, "max_prompt_length": 256, "learning_rate": 1e-3, "save_steps": 2},
        "resources": {"gpus": 0},
    }  # fmt: skip
    config.update(changes)
    return config


def embedded_cluster(tmp_path: Path, artifacts: Path | None = None) -> Cluster:
    """A Cluster on the embedded defaults: SQLite store and broker files, artifacts, all in one COLLAGE_HOME."""
    from collage.app.store.engine import upgrade

    home = tmp_path / "home"
    home.mkdir()
    database = f"sqlite:///{home / 'collage.db'}"
    upgrade(database)
    return Cluster(database, f"sqla+sqlite:///{home / 'broker.db'}", home, artifacts or home / "artifacts")


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False
