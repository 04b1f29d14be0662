"""Workers end to end: a real Redis broker (our own instance, on a free port), PostgreSQL, real Celery worker
processes training tiny models, and the API with the real Celery dispatcher. Also the embedded defaults
(SQLite store and broker) started the way `collage serve` starts them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.models import Checkpoint, Event, Metric, Sample

from .conftest import require_service

ROOT = Path(__file__).resolve().parents[1]
API = "/api/v1"
HEARTBEAT_TIMEOUT = 12  # seconds; a loaded CI machine must not look frozen (production: 60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Our own redis-server, so stopping it never touches the machine's shared instance."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.dir = tmp
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    require_service(None if shutil.which("redis-server") else "redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory):
    """One COLLAGE_HOME for the module: tiny models and synthetic data are built once, by the first run."""
    return tmp_path_factory.mktemp("collage-home")


def wait_for(predicate, timeout: float, what: str, logs: Sequence[Path] = ()):
    """``predicate()``'s first truthy value within ``timeout`` seconds; else fail, with the logs' tails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


class Cluster:
    """Workers as separate processes plus an in-process API using the real Celery dispatcher."""

    def __init__(self, database_url: str, broker_url: str, home: Path, artifacts: Path):
        from fastapi.testclient import TestClient

        from collage.app.db import engine_for
        from collage.app.main import create_app
        from collage.app.settings import Settings
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
            "COLLAGE_CANCEL_GRACE": "30",
            "COLLAGE_REWARD_MODULES": "tests.rewards_for_tests",
            "OMP_NUM_THREADS": "1",
        }
        self.settings = Settings(home=home, database_url=database_url, broker_url=broker_url, artifacts=artifacts,
                                 heartbeat_interval=1, heartbeat_timeout=HEARTBEAT_TIMEOUT, cancel_grace=30,
                                 reward_modules=("tests.rewards_for_tests",))  # fmt: skip
        self.engine = engine_for(database_url)
        self.app = create_app(self.settings, CeleryDispatcher(self.settings, self.engine))
        token = create_token(self.engine, "workers-test", role="admin")
        self.client = TestClient(self.app, headers={"Authorization": f"Bearer {token}"})
        self.workers: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start_worker(self, name: str) -> subprocess.Popen:
        log = Path(self.settings.home) / f"{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "collage.app.cli", "worker", "--name", name, "--loglevel", "INFO"],
            env=self.env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.workers[name], self.logs[name] = proc, log
        self.wait(lambda: any(w["name"] == name for w in self.health()["workers"]), 60, f"worker {name} to register")
        return proc

    def stop_all(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                proc.kill()

    def health(self) -> dict:
        return self.client.get(API + "/health").json()

    def submit(self, **changes) -> str:
        response = self.client.post(API + "/runs", json=run_config(**changes))
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def run(self, run_id: str) -> dict:
        return self.client.get(f"{API}/runs/{run_id}").json()

    def wait(self, predicate, timeout: float, what: str):
        return wait_for(predicate, timeout, what, list(self.logs.values()))

    def wait_status(self, run_id: str, statuses: tuple[str, ...], timeout: float = 240) -> dict:
        return self.wait(
            lambda: (r := self.run(run_id))["status"] in statuses and r, timeout, f"run {run_id} -> {statuses}"
        )

    def wait_step(self, run_id: str, step: int, timeout: float = 240) -> dict:
        return self.wait(
            lambda: (r := self.run(run_id))["progress"]["step"] >= step and r, timeout, f"run {run_id} step {step}"
        )

    def count(self, model, *where) -> int:
        with Session(self.engine) as session:
            return session.execute(select(func.count()).select_from(model).where(*where)).scalar_one()

    def events(self, run_id: str) -> list[str]:
        with Session(self.engine) as session:
            return list(session.scalars(select(Event.message).where(Event.run_id == run_id).order_by(Event.id)))


def run_config(max_steps: int = 4, delay: float = 0.0, rewards: list | None = None, **changes) -> dict:
    config = {
        "name": "worker-test",
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": "synth:count-red", "rows": 24, "min_images": 0, "max_images": 3},
        "rewards": rewards or [{"name": "numeric"}, {"name": "tests.rewards_for_tests:sleepy", "args": {"delay": delay}}],
        "train": {"max_steps": max_steps, "per_device_train_batch_size": 8, "num_generations": 4,
                  "max_completion_length": 6, "max_prompt_length": 256, "learning_rate": 1e-3, "save_steps": 2},
        "resources": {"gpus": 0},
    }  # fmt: skip
    config.update(changes)
    return config


def embedded_cluster(tmp_path: Path, artifacts: Path | None = None) -> Cluster:
    """A Cluster on the embedded defaults: SQLite store and broker files, artifacts, all in one COLLAGE_HOME."""
    from collage.app.db import upgrade

    home = tmp_path / "home"
    home.mkdir()
    database = f"sqlite:///{home / 'collage.db'}"
    upgrade(database)
    return Cluster(database, f"sqla+sqlite:///{home / 'broker.db'}", home, artifacts or home / "artifacts")


@pytest.fixture
def embedded(tmp_path):
    c = embedded_cluster(tmp_path)
    yield c
    c.stop_all()


@pytest.fixture
def cluster(migrated_postgres_url, redis_server, shared_home, tmp_path):
    from .conftest import _truncate

    _truncate(migrated_postgres_url)
    c = Cluster(migrated_postgres_url, redis_server.url, shared_home, tmp_path / "artifacts")
    yield c
    c.stop_all()


def serve_env(tmp_path: Path) -> dict[str, str]:
    """`collage serve`'s embedded defaults on a fresh COLLAGE_HOME (SQLite store and broker inside it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLLAGE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1",
           "COLLAGE_REWARD_MODULES": "tests.rewards_for_tests"}  # fmt: skip
    for key in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS"):
        env.pop(key, None)
    return env


def _metric_steps(cluster: Cluster, run_id: str) -> list[int]:
    with Session(cluster.engine) as session:
        return list(session.scalars(
            select(Metric.step).where(Metric.run_id == run_id, Metric.key == "reward").order_by(Metric.step)
        ))  # fmt: skip


def test_a_run_submitted_over_rest_trains_to_the_end_with_everything_stored(cluster):
    cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=4)
    run = cluster.wait_status(run_id, ("succeeded", "failed"))
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert run["progress"] == {"step": 4, "max_steps": 4}
    assert _metric_steps(cluster, run_id) == [1, 2, 3, 4]  # every step once
    metrics = cluster.client.get(f"{API}/runs/{run_id}/metrics", params={"keys": "reward,loss"}).json()
    assert [p[0] for p in metrics["loss"]] == [1, 2, 3, 4]
    samples = cluster.client.get(f"{API}/runs/{run_id}/samples", params={"limit": 500}).json()["items"]
    assert len(samples) == 4 * 8 and {s["num_images"] for s in samples} >= {0}
    with_images = [s for s in samples if s["images"]]
    assert with_images, "mixed 0..3-image data reaches the rollout table"
    image = cluster.client.get(with_images[0]["images"][0]["url"])
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert cluster.count(Checkpoint, Checkpoint.run_id == run_id) >= 2
    messages = cluster.events(run_id)
    assert messages[0] == "queued" and any(m.startswith("status: running on w1") for m in messages)
    assert messages[-1] == "succeeded at step 4"
    health = cluster.health()
    assert health["ok"] and [w["name"] for w in health["workers"]] == ["w1"]


def test_two_workers_five_runs_each_runs_exactly_once(cluster):
    cluster.start_worker("wa")
    cluster.start_worker("wb")
    ids = [cluster.submit(max_steps=2, name=f"r{i}") for i in range(5)]
    # a duplicate delivery of a queued message must be a no-op: send every run's message twice
    for run_id in ids:
        cluster.app.state.dispatcher.submit(run_id, "default")
    for run_id in ids:
        assert cluster.wait_status(run_id, ("succeeded", "failed"), timeout=300)["status"] == "succeeded"
    for run_id in ids:
        starts = [m for m in cluster.events(run_id) if m.startswith("status: running on")]
        assert len(starts) == 1, (run_id, starts)
        assert _metric_steps(cluster, run_id) == [1, 2]
    # both workers took runs (five runs of several seconds each, two idle workers with prefetch 1), and the
    # run's worker column names the worker that logged the start
    used = {}
    for r in ids:
        worker = cluster.run(r)["worker"]
        assert f"status: running on {worker}" in cluster.events(r), (r, worker, cluster.events(r))
        used[r] = worker
    assert set(used.values()) == {"wa", "wb"}, used


def test_cancel_a_running_run_ends_cancelled_with_a_checkpoint(cluster):
    cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=40, delay=0.4)
    cluster.wait_step(run_id, 1)
    response = cluster.client.post(f"{API}/runs/{run_id}/cancel")
    assert response.status_code == 200 and response.json()["status"] == "cancelling"
    run = cluster.wait_status(run_id, ("cancelled", "failed", "succeeded"), timeout=120)
    assert run["status"] == "cancelled", cluster.events(run_id)
    assert run["progress"]["step"] < 40
    assert cluster.count(Checkpoint, Checkpoint.run_id == run_id) >= 1
    with Session(cluster.engine) as session:
        last = session.scalars(
            select(Checkpoint.step).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step.desc())
        ).first()
    assert last == run["progress"]["step"]  # the checkpoint is of the step it stopped at


@pytest.mark.parametrize("victim", ["worker", "training child"])
def test_a_killed_worker_or_child_fails_the_run_and_resume_completes_it(cluster, victim):
    worker = cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=8, delay=0.4)
    cluster.wait_step(run_id, 3)
    if victim == "worker":
        worker.send_signal(signal.SIGKILL)
        cluster.start_worker("w2")  # its reaper (and the next runs) take over
    else:
        child = subprocess.run(
            ["pgrep", "-f", f"collage.worker.child {run_id}"], capture_output=True, text=True
        ).stdout.split()
        assert child, "the training child runs in its own process"
        os.kill(int(child[0]), signal.SIGKILL)
    # the reaper (worker killed) or the supervisor (child killed) must mark it within the heartbeat timeout
    run = cluster.wait_status(run_id, ("failed",), timeout=HEARTBEAT_TIMEOUT + 15)
    assert run["error"]
    if victim == "worker":
        assert "no heartbeat" in run["error"]
        assert not subprocess.run(["pgrep", "-f", f"collage.worker.child {run_id}"], capture_output=True).stdout, (
            "no orphan"
        )
    else:
        assert "killed by signal SIGKILL" in run["error"]
    reached = run["progress"]["step"]
    response = cluster.client.post(f"{API}/runs/{run_id}/resume")
    assert response.status_code == 200 and response.json()["attempt"] == 2
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=240)
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert _metric_steps(cluster, run_id) == list(range(1, 9))  # history intact, no step twice
    assert any("resumed from checkpoint at step" in m for m in cluster.events(run_id)), reached
    with Session(cluster.engine) as session:
        per_step = session.execute(
            select(Sample.step, func.count()).where(Sample.run_id == run_id).group_by(Sample.step)
        ).all()
    assert sorted(per_step) == [(s, 8) for s in range(1, 9)]


def test_redis_down_for_a_few_seconds_mid_run_loses_nothing(cluster, redis_server):
    cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=8, delay=0.3)
    cluster.wait_step(run_id, 2)
    redis_server.stop()
    time.sleep(4)
    redis_server.start()
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=240)
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert _metric_steps(cluster, run_id) == list(range(1, 9))
    assert cluster.count(Sample, Sample.run_id == run_id) == 8 * 8
    # the worker is still connected and takes the next run
    after = cluster.submit(max_steps=1)
    assert cluster.wait_status(after, ("succeeded", "failed"), timeout=240)["status"] == "succeeded"


def test_a_failing_reward_fails_the_run_and_the_worker_takes_the_next(cluster):
    cluster.start_worker("w1")
    bad = cluster.submit(max_steps=3, rewards=[{"name": "tests.rewards_for_tests:always_fails"}])
    good = cluster.submit(max_steps=1)
    run = cluster.wait_status(bad, ("failed", "succeeded"))
    assert run["status"] == "failed" and "always_fails" in run["error"]
    with Session(cluster.engine) as session:
        errors = list(session.scalars(select(Event.message).where(Event.run_id == bad, Event.level == "error")))
        details = list(session.scalars(select(Event.message).where(Event.run_id == bad, Event.level == "traceback")))
    # everyone reads what was raised; the traceback is an event only admins read (docs/security.md)
    assert any("ValueError: this reward always fails" in m for m in errors)
    assert not any("Traceback" in m for m in errors)
    assert any("Traceback" in m and "ValueError: this reward always fails" in m for m in details)
    assert cluster.wait_status(good, ("succeeded", "failed"))["status"] == "succeeded"


def test_embedded_defaults_as_collage_serve_starts_them(tmp_path):
    """`collage serve` on a fresh COLLAGE_HOME: SQLite store, SQLite broker, one embedded worker; a run
    submitted with `collage submit --follow` trains to the end; Ctrl-C stops everything."""
    port, env = free_port(), serve_env(tmp_path)
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "collage.app.cli", "serve", "--port", str(port)], env=env, cwd=ROOT,
                             stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        import httpx

        deadline = time.monotonic() + 90
        token_file = tmp_path / "home" / "token"
        while time.monotonic() < deadline:
            try:
                headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"} if token_file.exists() else {}
                body = httpx.get(f"http://127.0.0.1:{port}{API}/health", timeout=2, headers=headers).json()
                if body["ok"] and body.get("workers"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"collage serve did not come up:\n{log.read_text()[-3000:]}")
        printed = log.read_text()
        assert f"http://127.0.0.1:{port}" in printed and "/login/link/" in printed and "admin API token in" in printed
        assert token_file.read_text().strip() not in printed, "the API token itself is never printed"
        for name in ("collage.db", "broker.db", "token"):  # owner-only: tokens, sessions, every run
            assert stat.S_IMODE((tmp_path / "home" / name).stat().st_mode) == 0o600, name
        assert body["store"]["dialect"] == "sqlite" and body["broker"]["url"].startswith("sqla+sqlite:///")
        cfg = tmp_path / "run.yaml"
        import yaml

        cfg.write_text(yaml.safe_dump(run_config(max_steps=3)))
        done = subprocess.run(
            [sys.executable, "-m", "collage.app.cli", "submit", str(cfg), "--server", f"http://127.0.0.1:{port}", "--follow"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr + log.read_text()[-3000:]
        assert "succeeded" in done.stdout.splitlines()[-1]
        failing = cfg.with_name("bad.yaml")
        failing.write_text(
            yaml.safe_dump(run_config(max_steps=2, rewards=[{"name": "tests.rewards_for_tests:always_fails"}]))
        )
        bad = subprocess.run(
            [sys.executable, "-m", "collage.app.cli", "submit", str(failing), "--server", f"http://127.0.0.1:{port}", "--follow"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert bad.returncode == 1 and "failed" in bad.stdout
        # the dataset helper writes preview images into the artifacts too
        preview = httpx.get(f"http://127.0.0.1:{port}{API}/datasets/preview", headers=headers, timeout=120,
                            params={"source": "synth:count-red", "dataset_rows": 8, "min_images": 1})  # fmt: skip
        assert preview.status_code == 200 and preview.json()["rows"][0]["images"], preview.text
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            raise
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "home")], capture_output=True, text=True).stdout
    assert serve.returncode == 0 and not leftovers.strip(), log.read_text()[-2000:]
    # everything serve, its worker, the training child and the dataset helper wrote under COLLAGE_HOME (store,
    # broker, run folders, checkpoints, rollout and preview images, caches) is its owner's alone
    home = tmp_path / "home"
    assert list(home.rglob("trainer_state.pt")) and list(home.rglob("*.png"))
    assert not _not_private(home), _not_private(home)


def _not_private(root: Path) -> dict[str, str]:
    """Paths under ``root`` whose group or others have any permission (symbolic links aside)."""
    found = {}
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if not stat.S_ISLNK(mode) and stat.S_IMODE(mode) & 0o077:
            found[str(path.relative_to(root))] = oct(stat.S_IMODE(mode))
    return found


def test_runs_go_to_the_queue_their_config_names(cluster):
    cluster.start_worker("w-default")
    run_id = cluster.submit(max_steps=1, resources={"gpus": 0, "queue": "special"})
    # a run submitted later on the default queue is taken and finished first: w-default never saw the
    # special queue (had it listened there, it would have taken the older run first)
    later = cluster.submit(max_steps=1, resources={"gpus": 0, "queue": "default"})
    assert cluster.wait_status(later, ("succeeded", "failed"))["status"] == "succeeded"
    assert cluster.run(run_id)["status"] == "queued"
    proc = subprocess.Popen(
        [sys.executable, "-m", "collage.app.cli", "worker", "--name", "w-special", "--queues", "special"],
        env=cluster.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    cluster.workers["w-special"] = proc
    run = cluster.wait_status(run_id, ("succeeded", "failed"))
    assert run["status"] == "succeeded" and run["worker"] == "w-special"
    health = {w["name"]: w for w in cluster.health()["workers"]}
    assert health["w-special"]["queues"] == ["special"] and health["w-default"]["queues"] == ["default"]


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def test_split_brain_a_frozen_host_comes_back_and_one_attempt_owns_the_run(cluster):
    """SIGSTOP a worker and its training child (a frozen host) until the reaper, on another worker, marks the
    run failed; resume it (attempt 2 trains on that other worker); SIGCONT the frozen pair. The old child's
    writes are refused, it stops within a heartbeat and its supervisor kills it: the store holds one trajectory,
    and attempt 2's checkpoints are in its own folder."""
    frozen = cluster.start_worker("w-frozen")
    run_id = cluster.submit(max_steps=10, delay=0.4)
    cluster.wait_step(run_id, 2)
    child = int(subprocess.run(["pgrep", "-f", f"collage.worker.child {run_id} 1"], capture_output=True,
                               text=True).stdout.split()[0])  # fmt: skip
    os.kill(frozen.pid, signal.SIGSTOP)
    os.kill(child, signal.SIGSTOP)
    try:
        cluster.start_worker("w-live")  # its reaper notices the silence
        run = cluster.wait_status(run_id, ("failed",), timeout=HEARTBEAT_TIMEOUT + 30)
        assert "no heartbeat" in run["error"]
        assert cluster.client.post(f"{API}/runs/{run_id}/resume").json()["attempt"] == 2
        cluster.wait(lambda: cluster.run(run_id)["worker"] == "w-live" and cluster.run(run_id)["status"] == "running",
                     120, "attempt 2 to start on w-live")  # fmt: skip
    finally:
        os.kill(child, signal.SIGCONT)
        os.kill(frozen.pid, signal.SIGCONT)
    # the old child learns it is stale at its next heartbeat and exits at once
    cluster.wait(lambda: not _alive(child), 30, "the stale training child to exit")
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=300)
    assert run["status"] == "succeeded" and run["attempt"] == 2, (run["error"], cluster.events(run_id))
    assert _metric_steps(cluster, run_id) == list(range(1, 11))  # each step once
    with Session(cluster.engine) as session:
        per_step = session.execute(
            select(Sample.step, func.count()).where(Sample.run_id == run_id).group_by(Sample.step)
        ).all()
        checkpoints = session.execute(
            select(Checkpoint.step, Checkpoint.path).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)
        ).all()
    assert sorted(per_step) == [(s, 8) for s in range(1, 11)]
    resumed_from = int(next(m for m in cluster.events(run_id) if "resumed from checkpoint" in m).split()[-1])
    for step, path in checkpoints:
        assert f"/attempt-{1 if step <= resumed_from else 2}/" in path, (step, path)
    assert checkpoints[-1][0] == 10 and "/attempt-2/" in checkpoints[-1][1]
    # nothing the old attempt tried after it was superseded reached the store
    assert not [m for m in cluster.events(run_id) if "attempt 1" in m and "resume" not in m]


def test_collage_serve_killed_with_sigkill_leaves_no_worker_process(tmp_path):
    port, env = free_port(), serve_env(tmp_path)
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "collage.app.cli", "serve", "--port", str(port), "--workers", "2"],
                             env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        token = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and token is None:
            token_file = tmp_path / "home" / "token"
            token = token_file.read_text().strip() if token_file.exists() else None
            time.sleep(0.3)
        import httpx

        headers = {"Authorization": f"Bearer {token}"}
        while time.monotonic() < deadline:
            try:
                if (
                    len(httpx.get(f"http://127.0.0.1:{port}{API}/health", headers=headers, timeout=2).json()["workers"])
                    == 2
                ):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(log.read_text()[-3000:])
        workers = _children_of(serve.pid)
        assert len(workers) == 2
        cfg = run_config(max_steps=30, delay=0.3)
        for _ in range(10):  # a busy store answers 503 + Retry-After (two workers start on a loaded machine)
            submitted = httpx.post(f"http://127.0.0.1:{port}{API}/runs", json=cfg, headers=headers)
            if submitted.status_code != 503:
                break
            time.sleep(float(submitted.headers.get("Retry-After", "1")))
        assert submitted.status_code == 201, submitted.text
        run_id = submitted.json()["id"]
        while httpx.get(f"http://127.0.0.1:{port}{API}/runs/{run_id}", headers=headers).json()["progress"]["step"] < 1:
            time.sleep(0.5)
        training = [p for w in workers for p in _children_of(w)]
        assert training, "a training child runs under one of the workers"
    finally:
        serve.send_signal(signal.SIGKILL)
        serve.wait()
    everyone = workers + training
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(_alive(p) for p in everyone):
        time.sleep(0.5)
    assert not [p for p in everyone if _alive(p)], "no orphan keeps training after serve is killed"


def test_a_run_survives_twenty_dropped_database_connections_in_fifteen_seconds(cluster):
    """PostgreSQL terminates every Collage connection 20 times in 15 s while a run trains: the writer retries
    (its writes are idempotent), the run succeeds with every step stored once."""
    import threading

    import psycopg

    cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=14, delay=0.3)
    cluster.wait_step(run_id, 1)
    url = cluster.settings.database_url.replace("postgresql+psycopg://", "postgresql://")
    kills: list[int] = []

    def terminate():
        with psycopg.connect(url, autocommit=True) as conn:
            for _ in range(20):
                killed = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                ).fetchone()[0]
                kills.append(killed)
                time.sleep(0.75)

    killer = threading.Thread(target=terminate)
    killer.start()
    killer.join(timeout=60)
    assert len(kills) == 20 and sum(kills) >= 20, kills
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=300)
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert _metric_steps(cluster, run_id) == list(range(1, 15))
    assert cluster.count(Sample, Sample.run_id == run_id) == 14 * 8


# ------------------------------------------------------------------------------------ lost broker messages
def _lose_messages(c: Cluster, server: RedisServer | None = None) -> None:
    """Every message waiting in the default queue is gone, as after a Redis restart without persistence."""
    if server is not None:
        import redis

        assert redis.Redis(port=server.port).delete("default") == 1
        return
    broker = c.settings.broker_url.removeprefix("sqla+sqlite:///")
    with sqlite3.connect(broker) as connection:
        assert connection.execute("DELETE FROM kombu_message WHERE visible = 1").rowcount == 1


def _lost_message_is_sent_again(cluster: Cluster, lose) -> None:
    lost = cluster.submit(max_steps=1, name="lost")
    lose()
    later = cluster.submit(max_steps=1, name="later")  # its message is live: on main it ran, `lost` never did
    cluster.env["COLLAGE_REQUEUE_AFTER"] = "1"
    cluster.start_worker("w1")
    for run_id in (lost, later):
        run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=240)
        assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
        starts = [m for m in cluster.events(run_id) if m.startswith("status: running on")]
        assert len(starts) == 1, (run_id, starts)  # exactly once
        assert _metric_steps(cluster, run_id) == [1]
    # the older run kept its place: it started first, although the broker held only the later one's message
    assert cluster.run(lost)["started_at"] < cluster.run(later)["started_at"]
    resent = [m for r in (lost, later) for m in cluster.events(r) if "sent again" in m]
    assert resent, "the reconciliation re-sent the missing message"


def test_a_run_whose_redis_message_was_lost_is_sent_again_and_runs_once_in_order(cluster, redis_server):
    _lost_message_is_sent_again(cluster, lambda: _lose_messages(cluster, redis_server))


def test_a_run_whose_sqlite_broker_message_was_lost_is_sent_again_and_runs_once_in_order(embedded):
    _lost_message_is_sent_again(embedded, lambda: _lose_messages(embedded))
