"""Beyond one machine, end to end: a web node (`collage serve --workers 0`) and two worker hosts (`collage
worker`), each a process tree with its own COLLAGE_HOME and artifacts cache and no folder in common, that reach each
other only through PostgreSQL, a Redis broker and an S3 server (SeaweedFS, our own instance: one test stops it).

- A worker host's whole process tree is killed with SIGKILL mid-run; the run, resumed, continues on the other host
  from its checkpoint in the bucket and ends with every step once; Chromium shows every rollout image, served from
  the bucket (the web node never had a file of it).
- One run on two hosts (``resources.nodes: 2``, torchrun's c10d rendezvous between them): one host killed, the
  attempt fails on both, no training process is left on either, and the resume takes two live hosts.
- The S3 server stopped mid-run until the training host has retried it five times: the run goes on once it is back,
  and no rollout row, image or checkpoint is lost.

(Separate network namespaces would need root and a veth pair per host to reach the services; separate homes and
caches, and nothing shared but the three services, are what the hosts of a real deployment have too.)
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.store.tables import Checkpoint, Event, Image, Metric, Sample
from tests.support import API, ROOT
from tests.support.cluster import HEARTBEAT, HEARTBEAT_TIMEOUT, run_config
from tests.support.s3 import BUCKET, CREDENTIALS, WeedServer
from tests.support.services import RedisServer, free_port, require_service
from tests.support.waiting import scaled, wait_for


class Deployment:
    """The three services and the hosts: ``web`` and any number of workers, each a process group of its own."""

    def __init__(self, root: Path, database_url: str, broker_url: str, s3: WeedServer):
        self.root, self.s3 = root, s3
        self.prefix = f"multihost-{os.getpid()}"
        self.shared = {
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLLAGE_DATABASE_URL": database_url,
            "COLLAGE_BROKER_URL": broker_url, "COLLAGE_ARTIFACTS": f"s3://{BUCKET}/{self.prefix}",
            "COLLAGE_S3_ENDPOINT_URL": s3.endpoint, "COLLAGE_HEARTBEAT_INTERVAL": "1",
            "COLLAGE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT), "COLLAGE_REWARD_MODULES": "tests.support.rewards",
            "COLLAGE_NODE_ADDRESS": "127.0.0.1", **CREDENTIALS,
        }  # fmt: skip
        self.procs: dict[str, subprocess.Popen] = {}
        self.base = ""
        self.client: httpx.Client | None = None

    def home(self, host: str) -> Path:
        return self.root / host

    def env(self, host: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAGE_")}
        return {**env, **self.shared, "COLLAGE_HOME": str(self.home(host))}

    def _start(self, host: str, *args: str) -> subprocess.Popen:
        self.home(host).mkdir(parents=True, exist_ok=True)
        log = self.home(host) / "host.log"
        proc = subprocess.Popen([sys.executable, "-m", "collage.app.cli", *args], env=self.env(host), cwd=ROOT,
                                stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs[host] = proc
        return proc

    def start_web(self) -> None:
        port = free_port()
        self._start("web", "serve", "--workers", "0", "--port", str(port))
        self.base = f"http://127.0.0.1:{port}"
        token_file = self.home("web") / "token"
        wait_for(
            lambda: token_file.is_file() and self._healthy(token_file), "the web node", timeout=90, logs=self.logs()
        )
        token = token_file.read_text().strip()
        self.token = token
        self.client = httpx.Client(
            base_url=self.base + API, headers={"Authorization": f"Bearer {token}"}, timeout=scaled(30)
        )

    def _healthy(self, token_file: Path) -> bool:
        try:
            headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
            return httpx.get(self.base + API + "/health", headers=headers, timeout=scaled(2)).status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    def start_workers(self, *hosts: str, queues: str = "default") -> None:
        """Start the worker hosts side by side, then wait until each has registered."""
        for host in hosts:
            self._start(host, "worker", "--name", host, "--queues", queues, "--loglevel", "INFO")
        for host in hosts:
            wait_for(lambda: [w["name"] for w in self.api("/health")["workers"]], f"worker {host} to register",
                     until=lambda names, host=host: host in names, timeout=90, logs=self.logs())  # fmt: skip

    def kill_host(self, host: str) -> None:
        """SIGKILL to the host's whole process tree at once (the worker, its training child, anything below)."""
        proc = self.procs.pop(host)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(scaled(30))

    def stop(self) -> None:
        """Every host's process tree at once (nothing is left to save: the tests have read what they check)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(scaled(30))

    def logs(self) -> list[Path]:
        return [self.home(h) / "host.log" for h in self.procs] + [self.s3.data / "weed.log"]

    def api(self, path: str, method: str = "GET", **kwargs) -> dict:
        assert self.client is not None
        response = self.client.request(method, path, **kwargs)
        assert response.status_code < 300, response.text
        return response.json()

    def wait_run(self, run_id: str, done, timeout: float, what: str) -> dict:
        return wait_for(lambda: self.api(f"/runs/{run_id}"), what, until=done, timeout=timeout, logs=self.logs())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, migrated_postgres_url):
    require_service(None if subprocess.run(["which", "redis-server"], capture_output=True).returncode == 0
                    else "redis-server is not installed")  # fmt: skip
    from tests.support.services import truncate

    truncate(migrated_postgres_url)
    root = tmp_path_factory.mktemp("hosts")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    s3 = WeedServer(tmp_path_factory.mktemp("s3"))
    s3.start()
    deployment = Deployment(root, migrated_postgres_url, redis.url, s3)
    try:
        with pytest.MonkeyPatch.context() as patch:  # the test's own reads of the bucket sign like the hosts do
            for name, value in CREDENTIALS.items():
                patch.setenv(name, value)
            deployment.start_web()
            yield deployment
    finally:
        deployment.stop()
        s3.kill()
        redis.stop()


def _engine(deployment: Deployment):
    from collage.app.store.engine import engine_for

    return engine_for(deployment.shared["COLLAGE_DATABASE_URL"])


def _steps(deployment: Deployment, run_id: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The run's ``reward`` metric steps in order, and (step, rollout rows) per step."""
    with Session(_engine(deployment)) as session:
        metrics = list(session.scalars(select(Metric.step).where(Metric.run_id == run_id, Metric.key == "reward")
                                       .order_by(Metric.step)))  # fmt: skip
        rows = session.execute(select(Sample.step, func.count()).where(Sample.run_id == run_id)
                               .group_by(Sample.step).order_by(Sample.step)).all()  # fmt: skip
    return metrics, [tuple(r) for r in rows]


def _bucket(deployment: Deployment):
    from collage.training.infra.objectstore import ObjectMirror

    return ObjectMirror(deployment.shared["COLLAGE_ARTIFACTS"], deployment.s3.endpoint, retry_for=30)


def _every_artifact_is_in_the_bucket(deployment: Deployment, run_id: str) -> None:
    """Every image of the run's rollout rows, and every checkpoint the store records (with its manifest)."""
    from collage.app.store.tables import SampleImage

    bucket = _bucket(deployment)
    with Session(_engine(deployment)) as session:
        images = list(session.scalars(select(Image.path).join(SampleImage, SampleImage.sha256 == Image.sha256)
                                      .join(Sample, Sample.id == SampleImage.sample_id)
                                      .where(Sample.run_id == run_id).distinct()))  # fmt: skip
        checkpoints = list(session.scalars(select(Checkpoint.path).where(Checkpoint.run_id == run_id)))
    assert images and checkpoints
    missing = [p for p in images if not bucket.exists(p)]
    assert not missing, f"{len(missing)} of {len(images)} images are not in the bucket"
    for path in checkpoints:
        assert not Path(path).is_absolute(), path  # recorded relative: any host's cache resolves it
        assert bucket.manifest(path) is not None, f"checkpoint {path} has no manifest in the bucket"


def _events(deployment: Deployment, run_id: str) -> list[str]:
    with Session(_engine(deployment)) as session:
        return list(session.scalars(select(Event.message).where(Event.run_id == run_id).order_by(Event.id)))


def test_a_killed_worker_host_s_run_resumes_on_the_other_host_from_the_bucket(deployment):
    deployment.start_workers("host-a", "host-b")
    config = run_config(max_steps=8, delay=0.4)
    config["train"]["save_total_limit"] = 2  # the other host must remove this one's checkpoints from the bucket too
    run_id = deployment.api("/runs", "POST", json=config)["id"]
    run = deployment.wait_run(run_id, lambda r: r["progress"]["step"] >= 3, 240, "step 3")
    deployment.wait_run(run_id, lambda r: bool(deployment.api(f"/runs/{run_id}/checkpoints")["items"]), 120,
                        "a checkpoint recorded")  # fmt: skip
    victim = run["worker"]
    survivor = next(h for h in ("host-a", "host-b") if h != victim)
    deployment.kill_host(victim)
    killed_at = deployment.api(f"/runs/{run_id}")["progress"]["step"]  # the last step the victim wrote
    # the training child dies with its worker (PDEATHSIG): its heartbeats stop, and the other host's reaper acts
    run = deployment.wait_run(run_id, lambda r: r["status"] != "running", HEARTBEAT + 30, "the reaper")
    assert run["status"] == "failed" and "no heartbeat" in run["error"], run
    assert deployment.api(f"/runs/{run_id}/resume", "POST")["attempt"] == 2
    run = deployment.wait_run(run_id, lambda r: r["status"] in ("succeeded", "failed"), 300, "the resumed run")
    assert run["status"] == "succeeded", (run["error"], _events(deployment, run_id))
    assert run["worker"] == survivor
    resumed = [int(m.rsplit(" ", 1)[1]) for m in _events(deployment, run_id) if "resumed from checkpoint at step" in m]
    # the survivor had none of the victim's files: the checkpoint it resumed from came from the bucket
    assert len(resumed) == 1 and 2 <= resumed[0] <= killed_at, (resumed, killed_at)
    metrics, rows = _steps(deployment, run_id)
    assert metrics == list(range(1, 9))  # no step missing or doubled
    assert rows == [(s, 8) for s in range(1, 9)]
    assert not list(deployment.home("web").rglob("images/*/*/*.png"))  # nothing served yet: no image on the web node
    _every_artifact_is_in_the_bucket(deployment, run_id)
    _only_the_kept_checkpoints_are_in_the_bucket(deployment, run_id)
    _chromium_sees_every_image(deployment, run_id)


def _only_the_kept_checkpoints_are_in_the_bucket(deployment: Deployment, run_id: str) -> None:
    with Session(_engine(deployment)) as session:
        kept = sorted(session.scalars(select(Checkpoint.path).where(Checkpoint.run_id == run_id)))
    assert len(kept) == 2 and kept[-1].endswith("step-8"), kept
    manifests = sorted(f"runs/{run_id}/{key.removesuffix('/MANIFEST.json')}"
                       for key in _bucket(deployment).keys_under(f"runs/{run_id}") if key.endswith("MANIFEST.json"))  # fmt: skip
    assert manifests == kept  # attempt 1's older checkpoints went from the bucket with save_total_limit


def _chromium_sees_every_image(deployment: Deployment, run_id: str) -> None:
    from playwright.sync_api import sync_playwright

    from tests.support.browser import launch_chromium, new_page, wait_js, wait_rows

    with sync_playwright() as p:
        browser = launch_chromium(p)
        _, page = new_page(browser)
        answers: dict[str, int] = {}
        page.on("response", lambda r: answers.__setitem__(r.url, r.status) if "/images/" in r.url else None)
        page.goto(deployment.base + "/login")
        page.fill('input[name="token"]', deployment.token)
        page.click('button[type="submit"]')
        page.wait_for_url("**/runs")
        page.goto(f"{deployment.base}/runs/{run_id}/rollouts?step=8")
        wait_rows(page, 8)
        wait_js(page, "[...document.images].filter(i => i.src.includes('/images/')).length > 0 && "
                      "[...document.images].every(i => i.complete)")  # fmt: skip
        shown = page.evaluate("[...document.images].filter(i => i.src.includes('/images/'))"
                              ".map(i => [i.src, i.naturalWidth])")  # fmt: skip
        browser.close()
    assert shown and all(width > 0 for _, width in shown), shown
    assert answers and all(status == 200 for status in answers.values()), answers
    # the web node had none of them: each came from the bucket into its cache
    cached = {p.stem for p in (deployment.home("web") / "cache" / "s3").rglob("*.png")}
    assert {src.split("/images/")[1].split("?")[0] for src, _ in shown} <= cached


def test_the_s3_server_down_mid_run_loses_nothing(deployment):
    if not any(h.startswith("host-") for h in deployment.procs):
        deployment.start_workers("host-c")
    run_id = deployment.api("/runs", "POST", json=run_config(max_steps=10, delay=0.5))["id"]
    training_host = deployment.wait_run(run_id, lambda r: r["progress"]["step"] >= 2, 240, "step 2")["worker"]
    deployment.s3.stop()
    assert deployment.api(f"/runs/{run_id}")["status"] == "running", "the outage must fall mid-run"
    # the outage lasts until the training host has been refused through five backoff rounds (about 8 s of
    # retrying, and at most COLLAGE_S3_RETRY_FOR in all): its log names each try as it happens
    host_log = deployment.home(training_host) / "host.log"
    wait_for(host_log.read_text, "the training host to retry the bucket five times",
             until=lambda text: "failed (attempt 5," in text, timeout=120, logs=deployment.logs())  # fmt: skip
    deployment.s3.start()
    run = deployment.wait_run(run_id, lambda r: r["status"] in ("succeeded", "failed"), 300, "the run's end")
    assert run["status"] == "succeeded", (run["error"], _events(deployment, run_id))
    metrics, rows = _steps(deployment, run_id)
    assert metrics == list(range(1, 11)) and rows == [(s, 8) for s in range(1, 11)]
    _every_artifact_is_in_the_bucket(deployment, run_id)
    # the images are whole: each object's bytes hash to its name
    bucket = _bucket(deployment)
    with Session(_engine(deployment)) as session:
        shas = list(session.scalars(select(Image.sha256).limit(20)))
    for sha in shas:
        data = bucket.get_bytes(f"images/{sha[:2]}/{sha[2:4]}/{sha}.png")
        assert data is not None and hashlib.sha256(data).hexdigest() == sha


def _hosts(deployment: Deployment, run_id: str, attempt: int) -> list[str]:
    from collage.app.store.tables import RunNode

    with Session(_engine(deployment)) as session:
        return list(session.scalars(select(RunNode.worker).where(RunNode.run_id == run_id, RunNode.attempt == attempt)
                                    .order_by(RunNode.rank)))  # fmt: skip


def _training_processes(run_id: str) -> list[str]:
    """Every process of the run's training on any host: the torchrun launchers and their ranks."""
    found = subprocess.run(["pgrep", "-af", f"collage.worker.child {run_id}"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def test_a_run_on_two_hosts_fails_on_both_when_one_is_lost_and_resumes_on_two_live_hosts(deployment):
    deployment.start_workers("node-a", "node-b", "node-c", queues="gang")
    config = run_config(max_steps=6, delay=0.4, resources={"gpus": 0, "nodes": 2, "queue": "gang"})
    run_id = deployment.api("/runs", "POST", json=config)["id"]
    deployment.wait_run(run_id, lambda r: bool(deployment.api(f"/runs/{run_id}/checkpoints")["items"]), 300,
                        "a checkpoint recorded")  # fmt: skip
    first = _hosts(deployment, run_id, 1)
    assert len(first) == len(set(first)) == 2, first
    ranks = [line for line in _training_processes(run_id) if "collage.worker.launch" not in line]
    assert len(ranks) == 2, f"one training process on each host (and its torchrun): {ranks}"
    _, rows = _steps(deployment, run_id)
    assert rows[0] == (1, 16), "each host's process generates its own 8 rows of a step"
    victim = first[1]
    deployment.kill_host(victim)
    run = deployment.wait_run(run_id, lambda r: r["status"] != "running", HEARTBEAT + 40, "the attempt's failure")
    assert run["status"] == "failed" and run["error"], run
    # the surviving host ended its part: its worker killed whatever the lost host's end did not already stop
    wait_for(lambda: _training_processes(run_id), "no training process of the run left", until=lambda left: not left,
             timeout=HEARTBEAT + 20, logs=deployment.logs())  # fmt: skip
    assert deployment.api(f"/runs/{run_id}/resume", "POST")["attempt"] == 2
    run = deployment.wait_run(run_id, lambda r: r["status"] in ("succeeded", "failed"), 400, "the resumed run")
    assert run["status"] == "succeeded", (run["error"], _events(deployment, run_id))
    second = _hosts(deployment, run_id, 2)
    assert len(set(second)) == 2 and victim not in second, second  # any two live hosts
    metrics, rows = _steps(deployment, run_id)
    assert metrics == list(range(1, 7))  # no step missing or doubled
    assert rows == [(s, 16) for s in range(1, 7)]
    assert any("resumed from checkpoint at step" in m for m in _events(deployment, run_id))
    assert any(m.startswith("status: running on") and "(node 1)" in m for m in _events(deployment, run_id))


def test_a_sharded_run_killed_on_one_host_resumes_on_another_from_its_shards_in_the_bucket(deployment):
    """FSDP2 on two processes: each writes its shards of a checkpoint, the checkpoint (shards and their manifest)
    goes to the bucket whole, and after its host is killed the run resumes on a host that never had a file of it."""
    deployment.start_workers("shard-a", "shard-b", queues="shard")
    config = run_config(max_steps=6, delay=0.4, resources={"gpus": 0, "processes": 2, "strategy": "fsdp",
                                                          "queue": "shard"})  # fmt: skip
    run_id = deployment.api("/runs", "POST", json=config)["id"]
    deployment.wait_run(run_id, lambda r: bool(deployment.api(f"/runs/{run_id}/checkpoints")["items"]), 300,
                        "a sharded checkpoint recorded")  # fmt: skip
    victim = deployment.api(f"/runs/{run_id}")["worker"]
    deployment.kill_host(victim)
    run = deployment.wait_run(run_id, lambda r: r["status"] != "running", HEARTBEAT + 30, "the reaper")
    assert run["status"] == "failed", run
    assert deployment.api(f"/runs/{run_id}/resume", "POST")["attempt"] == 2
    run = deployment.wait_run(run_id, lambda r: r["status"] in ("succeeded", "failed"), 400, "the resumed run")
    assert run["status"] == "succeeded", (run["error"], _events(deployment, run_id))
    assert run["worker"] != victim
    assert any("resumed from checkpoint at step" in m for m in _events(deployment, run_id))
    metrics, rows = _steps(deployment, run_id)
    assert metrics == list(range(1, 7)) and rows == [(s, 16) for s in range(1, 7)]
    _every_artifact_is_in_the_bucket(deployment, run_id)
    bucket = _bucket(deployment)
    with Session(_engine(deployment)) as session:
        newest = max(session.scalars(select(Checkpoint.path).where(Checkpoint.run_id == run_id)))
    keys = bucket.keys_under(newest)
    assert any(k.endswith("shards.json") for k in keys), keys  # the shards' manifest went with them
    assert sum(k.endswith(".distcp") for k in keys) == 2, keys  # one file of shards per process
