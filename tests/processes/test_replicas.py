"""Stateless web replicas (issue 21): `collage serve --workers 0` processes, each with a COLLAGE_HOME of its own (no
shared folder), on one PostgreSQL store, one Redis broker and one S3 prefix of artifacts, agree on everything a
client sees: a login link or a browser session made on one works on another and a logout on one ends it everywhere
(an open stream included), API cursors of one page on another, an image uploaded through one is served by another
(from the bucket, or by a redirect to it), a run's event stream is the same on each, and an export's per-token
limit holds across them.

Replicas A and B are configured alike; C is B with ``COLLAGE_S3_PRESIGN=60`` (images answered by a redirect to the
bucket). The test process plays the training worker: it writes the run's progress, metrics and rows to the store
as a worker would. Nothing is mocked.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import browser_login
from tests.support.s3 import s3_environment, shared_endpoint
from tests.support.services import free_port, require_service
from tests.support.waiting import scaled, wait_for

ROOT = Path(__file__).resolve().parents[2]
API = "/api/v1"
REDIS_URL = "redis://127.0.0.1:6379/7"  # a database of the suite's Redis that no other test uses
STARTUP = 120.0  # seconds three replicas may take to answer, started together on a busy 2-core machine


def _redis_missing() -> str | None:
    with socket.socket() as s:
        s.settimeout(1)
        if s.connect_ex(("127.0.0.1", 6379)) == 0:
            return None
    return "no Redis at 127.0.0.1:6379 (scripts/services.sh starts one)"


@dataclass
class Replica:
    name: str
    base: str
    home: Path
    env: dict[str, str]
    proc: subprocess.Popen

    def api(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.base + API, headers={"Authorization": f"Bearer {token}"}, timeout=scaled(30))

    def log(self) -> str:
        return (self.home / "serve.log").read_text()[-3000:]


def _environment(postgres_url: str, s3: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAGE_")}
    env.update(s3)
    env.update({
        "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLLAGE_DATABASE_URL": postgres_url,
        "COLLAGE_BROKER_URL": REDIS_URL,
        "COLLAGE_HEARTBEAT_TIMEOUT": "600",  # the test writes the run's progress itself, without heartbeats
    })  # fmt: skip
    return env


def _cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "collage.app.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=scaled(120))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _start(name: str, env: dict[str, str], home: Path) -> Replica:
    port = free_port()
    env = {**env, "COLLAGE_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "collage.app.cli", "serve", "--workers", "0", "--port", str(port)],
        env=env, cwd=ROOT, stdout=(home / "serve.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return Replica(name, f"http://127.0.0.1:{port}", home, env, proc)


def _wait_up(replica: Replica) -> None:
    wait_for(lambda: httpx.get(replica.base + "/login", timeout=scaled(5)).status_code, f"replica {replica.name}",
             until=lambda status: status == 200, timeout=STARTUP, interval=0.2, ignore=(httpx.HTTPError,),
             gone=lambda: None if replica.proc.poll() is None else f"it exited: {replica.log()}")  # fmt: skip


def _stop(replicas: list[Replica]) -> None:
    """Ctrl-C to every replica at once, then wait for each (killed if it outlives 30 s)."""
    for replica in replicas:
        if replica.proc.poll() is None:
            os.killpg(replica.proc.pid, signal.SIGINT)
    for replica in replicas:
        try:
            replica.proc.wait(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            os.killpg(replica.proc.pid, signal.SIGKILL)
            replica.proc.wait(timeout=scaled(10))


@pytest.fixture(scope="module")
def cluster(postgres_url, tmp_path_factory) -> Iterator[dict]:
    """Replicas A, B and C (C: B with presigned image redirects), started together on one migrated store, one
    broker and one S3 prefix; each with a COLLAGE_HOME of its own. Yields them with an admin token."""
    require_service(_redis_missing())
    s3 = s3_environment(shared_endpoint())
    env = _environment(postgres_url, s3)
    from collage.app.store.engine import engine_for
    from collage.app.store.tokens import create_token

    # no deploy step first: the replicas start at once on an empty store, and migrate it once between them (an
    # advisory lock); each keeps an admin token of its own in its own home, and none replaces another's
    homes = {name: tmp_path_factory.mktemp(f"replica-{name.lower()}-home") for name in "ABC"}
    replicas = {
        "A": _start("A", env, homes["A"]),
        "B": _start("B", env, homes["B"]),
        "C": _start("C", {**env, "COLLAGE_S3_PRESIGN": "60"}, homes["C"]),
    }
    try:
        for replica in replicas.values():
            _wait_up(replica)
        engine = engine_for(postgres_url)
        admin = create_token(engine, "replicas-admin", "admin")
        yield {**replicas, "token": admin, "engine": engine, "env": env, "s3": s3}
    finally:
        _stop(list(replicas.values()))
        _forget_broker_messages()


def _forget_broker_messages() -> None:
    """The runs and exports this module queued wait in Redis for a worker that never comes: drop their queues."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"*{QUEUE}*"):  # the queues and kombu's bindings of them
        client.delete(key)
    client.close()


QUEUE = f"replicas-{uuid.uuid4().hex[:8]}"  # this module's runs' queue: its broker messages are its own


def _run_config(name: str) -> dict:
    return {
        "name": name,
        "algorithm": "grpo",
        "model": {"path": "tiny:qwen2-vl"},
        "dataset": {"source": "synth:count-red", "rows": 16},
        "rewards": [{"name": "accuracy"}],
        "train": {"max_steps": 5},
        "resources": {"gpus": 0, "queue": QUEUE},
    }


def _writer(cluster):
    """The test process as a training worker: it writes to the same store."""
    from collage.app.store.writer import StoreWriter

    return StoreWriter(cluster["engine"], Path(cluster["A"].home) / "unused-artifacts")


def _link_code(output: str) -> str:
    match = re.search(r"/login/link/(\S+)", output)
    assert match, output
    return match.group(1)


def _form_csrf(client: httpx.Client, path: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', client.get(path).text)
    assert match, path
    return match.group(1)


def _logged_in(base: str, cookie: str) -> bool:
    """Whether ``base`` takes this session cookie: its runs page and the API both answer as to a logged-in user."""
    with httpx.Client(base_url=base, cookies={"collage_session": cookie}, timeout=scaled(30)) as client:
        page = client.get("/runs", follow_redirects=False)
        api = client.get(API + "/runs")
    assert (page.status_code == 200) == (api.status_code == 200), (page.status_code, api.status_code)
    return page.status_code == 200 and api.status_code == 200


# ----------------------------------------------------------------------------------------------------- sessions
def test_a_login_link_made_on_one_replica_logs_a_browser_in_on_another(cluster):
    a, b = cluster["A"], cluster["B"]
    from collage.app.store.tokens import create_token

    create_token(cluster["engine"], "replicas-member", "member")
    # the operator's command, with replica A's environment and home: the link names A
    code = _link_code(_cli(a.env, "token", "link", "replicas-member", "--server", a.base))
    with httpx.Client(base_url=b.base, timeout=scaled(30)) as browser:  # the browser goes to B with it
        csrf = _form_csrf(browser, f"/login/link/{code}")
        done = browser.post(f"/login/link/{code}", data={"csrf_token": csrf}, headers={"Origin": b.base})
        assert done.status_code == 303 and done.headers["location"] == "/runs", done.text
        cookie = browser.cookies["collage_session"]
        assert browser.get("/runs", follow_redirects=False).status_code == 200
    assert _logged_in(a.base, cookie) and _logged_in(b.base, cookie)
    # a link is single-use on every replica: A refuses the one B spent
    with httpx.Client(base_url=a.base, timeout=scaled(30)) as other:
        csrf = _form_csrf(other, f"/login/link/{code}")
        again = other.post(f"/login/link/{code}", data={"csrf_token": csrf}, headers={"Origin": a.base})
        assert again.status_code == 401 and "collage_session" not in other.cookies


# ------------------------------------------------------------------------------------------------------ cursors
def test_a_cursor_from_one_replica_pages_on_another(cluster):
    from collage.app.store.writer import SampleIn

    a, b, token = cluster["A"], cluster["B"], cluster["token"]
    with a.api(token) as on_a, b.api(token) as on_b:
        made = [on_a.post("/runs", json=_run_config(f"page-{i}")) for i in range(3)]
        assert all(r.status_code == 201 for r in made), [r.text for r in made]
        first = on_a.get("/runs", params={"limit": 2, "q": "page-"}).json()
        second_on_a = on_a.get("/runs", params={"limit": 2, "q": "page-", "cursor": first["next_cursor"]})
        second_on_b = on_b.get("/runs", params={"limit": 2, "q": "page-", "cursor": first["next_cursor"]})
        assert second_on_b.status_code == 200, second_on_b.text
        assert [r["id"] for r in second_on_b.json()["items"]] == [r["id"] for r in second_on_a.json()["items"]]
        run = made[0].json()["id"]
        rows = [SampleIn(group=0, index=i, prompt=[{"role": "user", "content": [{"type": "text", "text": "p"}]}],
                         completion=f"c{i}", images=[], rewards={"accuracy": i / 4}, reward=i / 4, advantage=0.0,
                         completion_length=1, truncated=False) for i in range(4)]  # fmt: skip
        _writer(cluster).append_samples(run, 1, rows)
        page = on_b.get(f"/runs/{run}/samples", params={"sort": "-reward", "limit": 2}).json()
        rest_on_a = on_a.get(f"/runs/{run}/samples", params={"sort": "-reward", "limit": 2,
                                                             "cursor": page["next_cursor"]})  # fmt: skip
        assert rest_on_a.status_code == 200, rest_on_a.text
        assert [s["completion"] for s in page["items"] + rest_on_a.json()["items"]] == ["c3", "c2", "c1", "c0"]
        # still signed: a changed cursor is refused by every replica
        forged = first["next_cursor"][:-2] + ("AA" if not first["next_cursor"].endswith("AA") else "BB")
        assert on_b.get("/runs", params={"cursor": forged}).status_code == 400


# ------------------------------------------------------------------------------------------------------- images
def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_uploaded_through_one_replica_is_served_by_the_others(cluster):
    a, b, c, token = cluster["A"], cluster["B"], cluster["C"], cluster["token"]
    with a.api(token) as on_a, b.api(token) as on_b, c.api(token) as on_c:
        upload = on_a.post("/images", files={"file": ("red.png", _png(), "image/png")})
        assert upload.status_code == 201, upload.text
        sha = upload.json()["sha256"]
        from_b = on_b.get(f"/images/{sha}")  # B never saw it: its own cache is empty, the bucket has it
        from_a = on_a.get(f"/images/{sha}")
        assert from_b.status_code == from_a.status_code == 200, from_b.text
        assert from_b.content == from_a.content and hashlib.sha256(from_b.content).hexdigest() == sha
        for header in ("cache-control", "etag", "content-type"):
            assert from_b.headers[header] == from_a.headers[header], header
        assert on_b.get(f"/images/{sha}", headers={"If-None-Match": from_a.headers["etag"]}).status_code == 304
        # the thumbnail one replica made (and stored in the bucket) is the one the other serves
        thumb_b = on_b.get(f"/images/{sha}", params={"size": "thumb"})
        thumb_a = on_a.get(f"/images/{sha}", params={"size": "thumb"})
        assert thumb_b.status_code == thumb_a.status_code == 200 and thumb_b.content == thumb_a.content
        # C presigns: a redirect to the bucket, whose URL serves the same bytes
        for size, expected in (("full", from_a.content), ("thumb", thumb_a.content)):
            moved = on_c.get(f"/images/{sha}", params={"size": size}, follow_redirects=False)
            assert moved.status_code == 307, moved.text
            assert moved.headers["location"].startswith(cluster["s3"]["COLLAGE_S3_ENDPOINT_URL"])
            assert moved.headers["cache-control"] == "private, max-age=30"
            assert httpx.get(moved.headers["location"], timeout=scaled(30)).content == expected


# ------------------------------------------------------------------------------------------------------ streams
class Stream(threading.Thread):
    """A run's server-sent events, read to their end in a thread: ``events`` as ``(name, data)``."""

    def __init__(self, base: str, run: str, **client_args):
        super().__init__(daemon=True)
        self.url = f"{base}{API}/runs/{run}/stream"
        self.client_args = client_args
        self.events: list[tuple[str, dict]] = []
        self.headers: dict[str, str] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(timeout=scaled(60), **self.client_args) as client,
                client.stream("GET", self.url, params={"poll": 0.2}) as response,
            ):
                self.headers = dict(response.headers)
                name = None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        name = line.removeprefix("event: ")
                    elif line.startswith("data: ") and name is not None:
                        self.events.append((name, json.loads(line.removeprefix("data: "))))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def saw(self, name: str, **match) -> bool:
        return any(n == name and all(d.get(k) == v for k, v in match.items()) for n, d in list(self.events))

    def by_kind(self) -> dict[str, list[dict]]:
        kinds: dict[str, list[dict]] = {}
        for name, data in self.events:
            kinds.setdefault(name, []).append(data)
        return kinds


def test_the_run_stream_is_the_same_on_each_replica_and_a_logout_on_one_ends_a_session_on_all(cluster):
    from collage.app.core.status import RunStatus

    a, b, token = cluster["A"], cluster["B"], cluster["token"]
    with a.api(token) as on_a:
        run = on_a.post("/runs", json=_run_config("streamed")).json()["id"]
    writer = _writer(cluster)
    assert writer.transition(run, [RunStatus.QUEUED], RunStatus.RUNNING, worker="test-worker")
    writer.append_metrics(run, 1, {"loss": 0.5, "reward": 0.25})
    writer.set_progress(run, 1)
    browser = browser_login(a.base, token)  # a browser session started on A ...
    cookie = browser.cookies["collage_session"]
    browser.close()
    assert _logged_in(b.base, cookie)  # ... is live on B
    bearer = {"headers": {"Authorization": f"Bearer {token}"}}
    streams = {"A": Stream(a.base, run, **bearer), "B": Stream(b.base, run, **bearer),
               "A-session": Stream(a.base, run, cookies={"collage_session": cookie})}  # fmt: skip
    for stream in streams.values():
        stream.start()
    wait_for(lambda: all(s.saw("metrics", step=1) for s in streams.values()), "the first metrics on every stream")
    # logging out on B ends the session on A: the page, the API, and the stream A is sending
    with httpx.Client(base_url=b.base, cookies={"collage_session": cookie}, timeout=scaled(30)) as on_b:
        out = on_b.post("/logout", data={"csrf_token": _form_csrf(on_b, "/runs")}, headers={"Origin": b.base})
        assert out.status_code == 303 and out.headers["location"] == "/login"
    assert not _logged_in(a.base, cookie) and not _logged_in(b.base, cookie)
    streams["A-session"].join(15)
    assert not streams["A-session"].is_alive() and streams["A-session"].events[-1][0] == "unauthorized"
    writer.append_metrics(run, 2, {"loss": 0.25, "reward": 0.75})
    writer.set_progress(run, 2)
    assert writer.transition(run, [RunStatus.RUNNING], RunStatus.SUCCEEDED)
    for name in ("A", "B"):
        streams[name].join(30)
        assert not streams[name].is_alive() and streams[name].error is None, (name, streams[name].error)
    on_a_events, on_b_events = streams["A"].by_kind(), streams["B"].by_kind()
    assert on_a_events == on_b_events
    assert [s["status"] for s in on_a_events["status"]] == ["running", "succeeded"]
    assert [(m["step"], m["loss"]) for m in on_a_events["metrics"]] == [(1, 0.5), (2, 0.25)]
    assert on_a_events["progress"][-1] == {"step": 2, "max_steps": 5}
    assert streams["A"].headers["cache-control"] == streams["B"].headers["cache-control"] == "no-store"


# ------------------------------------------------------------------------------------------------------ exports
def test_the_per_token_export_limit_holds_across_replicas(cluster):
    a, b, token = cluster["A"], cluster["B"], cluster["token"]
    with a.api(token) as on_a, b.api(token) as on_b:
        run = on_a.post("/runs", json=_run_config("exported")).json()["id"]
        _writer(cluster).add_checkpoint(run, 1, f"runs/{run}/checkpoints/step-1", kind="full", size=1)
        first = on_a.post(f"/runs/{run}/exports", json={"step": 1})
        assert first.status_code == 202, first.text
        job = first.json()["id"]
        # B sees A's export in flight: one at a time per token, on every replica
        refused = on_b.post(f"/runs/{run}/exports", json={"step": 1})
        assert refused.status_code == 429 and job in refused.json()["detail"], refused.text
        assert refused.headers["retry-after"] == "10"
        assert on_b.get(f"/exports/{job}").json()["status"] == "queued"
        # cancelled through B, the export frees the token's turn on A as well
        assert on_b.post(f"/exports/{job}/cancel").json()["status"] == "cancelled"
        second = on_a.post(f"/runs/{run}/exports", json={"step": 1})
        assert second.status_code == 202, second.text
        again = on_b.post(f"/runs/{run}/exports", json={"step": 1})
        assert again.status_code == 429 and second.json()["id"] in again.json()["detail"]
        assert on_a.post(f"/exports/{second.json()['id']}/cancel").status_code == 200


def test_each_replica_keeps_its_own_admin_token_and_every_token_works_on_every_replica(cluster):
    """Replicas with homes of their own each made an admin token at start (named after its host and home): none
    replaced another's, and each works on every replica."""
    tokens = {name: (Path(cluster[name].home) / "token").read_text().strip() for name in "ABC"}
    assert len(set(tokens.values())) == 3
    for owner, token in tokens.items():
        for name in "ABC":
            response = httpx.get(cluster[name].base + "/api/v1/runs", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 200, (owner, name, response.text)
