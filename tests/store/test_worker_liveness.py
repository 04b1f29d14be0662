"""What keeps a live connection or a live worker seen as live, on SQLite and PostgreSQL: a run's event stream sends a
keep-alive comment while it has nothing to say (a proxy drops a quiet response), and a worker restarted under the
same name is registered with its new start time."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
from sqlalchemy import update
from sqlmodel import Session

from collage.app.store.tables import Worker
from collage.app.store.workers import live_workers
from tests.support import API
from tests.support.api import config
from tests.support.live_server import serving
from tests.support.waiting import scaled


def test_a_quiet_run_stream_sends_keep_alive_comments(api, monkeypatch):
    """A queued run's stream sends its status once, then nothing until the run moves: it must still send
    something at a bounded interval, a comment line that EventSource ignores."""
    from collage.app.routers import runs

    monkeypatch.setattr(runs, "KEEPALIVE_EVERY", 0.5)
    admin, token, _, app = api
    run = admin.post(API + "/runs", json=config()).json()["id"]
    headers = {"Authorization": f"Bearer {token}"}
    # the read timeout bounds the wait: a stream that sends nothing fails the test with ReadTimeout
    lines: list[str] = []
    with (
        serving(app) as base,
        httpx.Client(base_url=base, headers=headers, timeout=scaled(20)) as client,
        client.stream("GET", f"{API}/runs/{run}/stream", params={"poll": 0.2}) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            if lines.count(": keep-alive") == 2:
                break
    events = [line for line in lines if line.startswith("event: ")]
    assert events[:2] == ["event: status", "event: progress"], lines  # what it said before stays as it was
    assert lines.count(": keep-alive") == 2


def test_a_worker_restarted_under_its_name_is_registered_with_its_new_start(api):
    from collage.worker.registry import Registration

    _, _, _, app = api
    engine = app.state.engine
    first = Registration(engine, "w-restarted", ["default"], [])
    first.beat()
    long_ago = datetime(2020, 1, 1, tzinfo=timezone.utc)
    with Session(engine) as session:  # the first process started long ago (and died without its goodbye)
        session.execute(update(Worker).where(Worker.name == "w-restarted").values(started_at=long_ago))
        session.commit()
    again = Registration(engine, "w-restarted", ["default"], [])
    again.beat()
    (row,) = [w for w in live_workers(engine, within=60) if w["name"] == "w-restarted"]
    started = datetime.fromisoformat(row["started_at"])
    assert started.replace(tzinfo=started.tzinfo or timezone.utc) > long_ago, row
    assert started.replace(tzinfo=None) == again.started_at.replace(tzinfo=None)
    again.beat()  # a later beat of the same process keeps its start
    (row,) = [w for w in live_workers(engine, within=60) if w["name"] == "w-restarted"]
    assert datetime.fromisoformat(row["started_at"]).replace(tzinfo=None) == again.started_at.replace(tzinfo=None)


class _RegistryDispatcher:
    """The dispatcher's health as the real one reads it: the broker up, the workers the registry lists."""

    def __init__(self, engine):
        self.engine = engine

    def health(self):
        return {"broker": {"ok": True, "url": "test-double"}, "workers": live_workers(self.engine, within=60)}


def test_health_reports_each_workers_disks_flagged_low_below_the_minimum(database_url, tmp_path):
    from fastapi.testclient import TestClient

    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for
    from collage.app.store.tokens import create_token
    from collage.training.infra.diskspace import space
    from collage.worker.registry import Registration

    engine = engine_for(database_url)
    home, artifacts = tmp_path / "worker-home", tmp_path / "worker-home" / "artifacts"
    artifacts.mkdir(parents=True)
    free = space(home).free
    Registration(engine, "w-disk", ["default"], [], disks={"home": home, "artifacts": artifacts}).beat()
    Registration(engine, "w-old", ["default"], []).beat()  # one that reports no disk (started before 0011)
    token = create_token(engine, "health", role="admin")
    for min_free_mb, low in ((0, False), ((free >> 20) + 1024, True)):
        settings = Settings(home=tmp_path, database_url=database_url, broker_url="memory://",
                            artifacts=tmp_path / "artifacts", min_free_disk_mb=min_free_mb)  # fmt: skip
        client = TestClient(create_app(settings, _RegistryDispatcher(engine)))
        body = client.get(f"{API}/health", headers={"Authorization": f"Bearer {token}"}).json()
        workers = {w["name"]: w for w in body["workers"]}
        disk = workers["w-disk"]["disk"]
        assert disk["ok"] is (not low), disk
        (fs,) = disk["filesystems"]  # home and artifacts on one file system
        assert fs["paths"] == {"home": str(home), "artifacts": str(artifacts)}
        assert fs["low"] is low and 0 < fs["free_bytes"] <= fs["total_bytes"]
        assert workers["w-old"]["disk"] is None
        assert body["ok"] is True  # a low disk is a warning, like the node's own: the service stays in
        # without a token: only ok, never a worker's paths
        assert client.get(f"{API}/health").json() == {"ok": True}
