"""Workers end to end: a real Redis broker (our own instance, on a free port), PostgreSQL, real Celery worker
processes training tiny models, and the API with the real Celery dispatcher. Also the embedded defaults
(SQLite store and broker) started the way `collage serve` starts them."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.store.tables import Checkpoint, Event, Sample
from tests.support import API, ROOT
from tests.support.cluster import HEARTBEAT, Cluster, alive, children_of, run_config
from tests.support.serve import Serve
from tests.support.services import RedisServer
from tests.support.waiting import scaled, wait_for


def test_a_run_submitted_over_rest_trains_to_the_end_with_everything_stored(cluster):
    cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=4)
    run = cluster.wait_status(run_id, ("succeeded", "failed"))
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert run["progress"] == {"step": 4, "max_steps": 4}
    assert cluster.metric_steps(run_id) == [1, 2, 3, 4]  # every step once
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
        assert cluster.metric_steps(run_id) == [1, 2]
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
    run = cluster.wait_status(run_id, ("failed",), timeout=HEARTBEAT + 15)
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
    assert cluster.metric_steps(run_id) == list(range(1, 9))  # history intact, no step twice
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
    # the outage lasts while the run trains two more steps: the worker's broker connection is gone meanwhile
    cluster.wait_step(run_id, 4)
    redis_server.start()
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=240)
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert cluster.metric_steps(run_id) == list(range(1, 9))
    assert cluster.count(Sample, Sample.run_id == run_id) == 8 * 8
    # the worker is still connected and takes the next run
    after = cluster.submit(max_steps=1)
    assert cluster.wait_status(after, ("succeeded", "failed"), timeout=240)["status"] == "succeeded"


def test_a_failing_reward_fails_the_run_and_the_worker_takes_the_next(cluster):
    cluster.start_worker("w1")
    bad = cluster.submit(max_steps=3, rewards=[{"name": "tests.support.rewards:always_fails"}])
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
    home = tmp_path / "home"
    serve = Serve(home).start()
    try:
        body = serve.wait_up(workers=1)
        printed = serve.log.read_text()
        assert serve.base in printed and "/login/link/" in printed and "admin API token in" in printed
        assert serve.token not in printed, "the API token itself is never printed"
        for name in ("collage.db", "broker.db", "token"):  # owner-only: tokens, sessions, every run
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
        assert body["store"]["dialect"] == "sqlite" and body["broker"]["url"].startswith("sqla+sqlite:///")
        cfg = tmp_path / "run.yaml"
        import yaml

        cfg.write_text(yaml.safe_dump(run_config(max_steps=3)))
        done = subprocess.run(
            [sys.executable, "-m", "collage.app.cli", "submit", str(cfg), "--server", serve.base, "--follow"],
            env=serve.env, cwd=ROOT, capture_output=True, text=True, timeout=scaled(300),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr + serve.tail()
        assert "succeeded" in done.stdout.splitlines()[-1]
        failing = cfg.with_name("bad.yaml")
        failing.write_text(
            yaml.safe_dump(run_config(max_steps=2, rewards=[{"name": "tests.support.rewards:always_fails"}]))
        )
        bad = subprocess.run(
            [sys.executable, "-m", "collage.app.cli", "submit", str(failing), "--server", serve.base, "--follow"],
            env=serve.env, cwd=ROOT, capture_output=True, text=True, timeout=scaled(300),
        )  # fmt: skip
        assert bad.returncode == 1 and "failed" in bad.stdout
        # the dataset helper writes preview images into the artifacts too
        with serve.client(timeout=120) as client:
            preview = client.get("/datasets/preview", params={"source": "synth:count-red", "dataset_rows": 8,
                                                              "min_images": 1})  # fmt: skip
        assert preview.status_code == 200 and preview.json()["rows"][0]["images"], preview.text
    finally:
        returncode = serve.interrupt(timeout=60)
    leftovers = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True).stdout
    assert returncode == 0 and not leftovers.strip(), serve.tail(2000)
    # everything serve, its worker, the training child and the dataset helper wrote under COLLAGE_HOME (store,
    # broker, run folders, checkpoints, rollout and preview images, caches) is its owner's alone
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
    cluster.start_worker("w-special", "--queues", "special", wait=False)
    run = cluster.wait_status(run_id, ("succeeded", "failed"))
    assert run["status"] == "succeeded" and run["worker"] == "w-special"
    health = {w["name"]: w for w in cluster.health()["workers"]}
    assert health["w-special"]["queues"] == ["special"] and health["w-default"]["queues"] == ["default"]


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
        run = cluster.wait_status(run_id, ("failed",), timeout=HEARTBEAT + 30)
        assert "no heartbeat" in run["error"]
        assert cluster.client.post(f"{API}/runs/{run_id}/resume").json()["attempt"] == 2
        wait_for(lambda: cluster.run(run_id), "attempt 2 to start on w-live", timeout=120,
                 until=lambda run: run["worker"] == "w-live" and run["status"] == "running")  # fmt: skip
    finally:
        os.kill(child, signal.SIGCONT)
        os.kill(frozen.pid, signal.SIGCONT)
    # the old child learns it is stale at its next heartbeat and exits at once
    cluster.wait(lambda: not alive(child), "the stale training child to exit", timeout=30)
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=300)
    assert run["status"] == "succeeded" and run["attempt"] == 2, (run["error"], cluster.events(run_id))
    assert cluster.metric_steps(run_id) == list(range(1, 11))  # each step once
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
    serve = Serve(tmp_path / "home", "--workers", "2").start()
    try:
        serve.wait_up(workers=2)
        workers = children_of(serve.pid)
        assert len(workers) == 2
        with serve.client() as client:
            # a busy store answers 503 with Retry-After (two workers start on a loaded machine): a client waits
            submitted = wait_for(
                lambda: client.post("/runs", json=run_config(max_steps=30, delay=0.3)),
                "the store to take the run",
                until=lambda r: r.status_code != 503,
                interval=1,
            )
            assert submitted.status_code == 201, submitted.text
            run_id = submitted.json()["id"]
            wait_for(lambda: client.get(f"/runs/{run_id}").json(), f"run {run_id} to train",
                     until=lambda run: run["progress"]["step"] >= 1, timeout=240, logs=[serve.log])  # fmt: skip
        training = [p for w in workers for p in children_of(w)]
        assert training, "a training child runs under one of the workers"
    finally:
        serve.kill()
    everyone = workers + training
    wait_for(lambda: [p for p in everyone if alive(p)], "no orphan to keep training after serve is killed",
             until=lambda left: not left, timeout=90)  # fmt: skip


def test_a_run_survives_twenty_dropped_database_connections(cluster):
    """PostgreSQL terminates every Collage connection 20 times while a run trains, each time as soon as Collage
    has connected again: the writer retries (its writes are idempotent), the run succeeds with every step stored
    once."""
    import threading

    import psycopg

    cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=14, delay=0.3)
    cluster.wait_step(run_id, 1)
    url = cluster.settings.database_url.replace("postgresql+psycopg://", "postgresql://")
    kills: list[int] = []

    others = "datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"

    def terminate():
        with psycopg.connect(url, autocommit=True) as conn:
            for n in range(20):
                # each kill waits for Collage to have connected again, and counts once it ended a connection
                kills.append(wait_for(
                    lambda: conn.execute(
                        f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE {others}"
                    ).fetchone()[0],
                    f"kill {n + 1} to end a connection of Collage's", timeout=60, interval=0.05,
                ))  # fmt: skip

    killer = threading.Thread(target=terminate)
    killer.start()
    killer.join(timeout=scaled(20 * 60))
    assert not killer.is_alive() and len(kills) == 20 and min(kills) >= 1, kills
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=300)
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert cluster.metric_steps(run_id) == list(range(1, 15))
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
        assert cluster.metric_steps(run_id) == [1]
    # the older run kept its place: it started first, although the broker held only the later one's message
    assert cluster.run(lost)["started_at"] < cluster.run(later)["started_at"]
    resent = [m for r in (lost, later) for m in cluster.events(r) if "sent again" in m]
    assert resent, "the reconciliation re-sent the missing message"


def test_a_run_whose_redis_message_was_lost_is_sent_again_and_runs_once_in_order(cluster, redis_server):
    _lost_message_is_sent_again(cluster, lambda: _lose_messages(cluster, redis_server))


def test_a_run_whose_sqlite_broker_message_was_lost_is_sent_again_and_runs_once_in_order(embedded):
    _lost_message_is_sent_again(embedded, lambda: _lose_messages(embedded))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_two_process_cpu_run_trains_on_the_worker_and_cancels_with_a_checkpoint(cluster, strategy):
    """``resources.processes: 2`` with ``gpus: 0``: the worker launches two gloo ranks as it launches a multi-GPU
    run; both ranks' rollouts reach the store, the main rank writes the rest, and a cancel stops both ranks with
    a checkpoint of the step they reached (with FSDP2 a sharded one: each rank's shards and the manifest)."""
    cluster.start_worker("w1")
    resources = {"gpus": 0, "processes": 2, "strategy": strategy}
    done = cluster.submit(max_steps=2, resources=resources)
    run = cluster.wait_status(done, ("succeeded", "failed"), timeout=300)
    assert run["status"] == "succeeded", (run["error"], cluster.events(done))
    assert cluster.metric_steps(done) == [1, 2]
    samples = cluster.client.get(f"{API}/runs/{done}/samples", params={"limit": 500}).json()["items"]
    assert len(samples) == 2 * 2 * 8  # steps x ranks x rollouts per rank
    assert not [m for m in cluster.events(done) if "training processes" in m]  # no launch warning: both ran
    slow = cluster.submit(max_steps=40, delay=0.4, resources=resources)
    cluster.wait_step(slow, 1, timeout=300)
    assert cluster.client.post(f"{API}/runs/{slow}/cancel").status_code == 200
    run = cluster.wait_status(slow, ("cancelled", "failed", "succeeded"), timeout=180)
    assert run["status"] == "cancelled", cluster.events(slow)
    assert cluster.count(Checkpoint, Checkpoint.run_id == slow) >= 1
    with Session(cluster.engine) as session:
        path = session.scalars(select(Checkpoint.path).where(Checkpoint.run_id == slow)).first()
    folder = Path(path) if Path(path).is_absolute() else cluster.settings.artifacts / path
    assert (folder / "shards.json").is_file() == (strategy == "fsdp"), sorted(p.name for p in folder.iterdir())


def _ranks(run_id: str) -> dict[int, int]:
    """The training ranks of a run on this machine, ``{rank: pid}`` (from each process's environment)."""
    found = {}
    for pid in subprocess.run(["pgrep", "-f", f"collage.worker.child {run_id}"], capture_output=True,
                              text=True).stdout.split():  # fmt: skip
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0])] = int(pid)
    return found


def test_a_killed_rank_of_a_sharded_run_fails_the_attempt_and_it_resumes_from_its_shards(cluster):
    """kill -9 of one FSDP2 rank: the attempt fails within the heartbeat bound, every rank ends, and the resumed
    attempt continues from the newest sharded checkpoint to the end."""
    cluster.start_worker("w1")
    run_id = cluster.submit(max_steps=6, delay=0.4, resources={"gpus": 0, "processes": 2, "strategy": "fsdp"})
    cluster.wait_step(run_id, 3, timeout=300)  # past the checkpoint of step 2 (save_steps: 2)
    ranks = wait_for(lambda: (r := _ranks(run_id)) and len(r) == 2 and r, "both ranks to run", timeout=60)
    os.kill(ranks[1], signal.SIGKILL)
    run = cluster.wait_status(run_id, ("failed",), timeout=HEARTBEAT + 30)
    assert run["error"]
    wait_for(lambda: not _ranks(run_id), "every rank of the failed attempt to end", timeout=HEARTBEAT)
    response = cluster.client.post(f"{API}/runs/{run_id}/resume")
    assert response.status_code == 200 and response.json()["attempt"] == 2
    run = cluster.wait_status(run_id, ("succeeded", "failed"), timeout=300)
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))
    assert cluster.metric_steps(run_id) == list(range(1, 7))
    assert any("resumed from checkpoint at step" in m for m in cluster.events(run_id))
