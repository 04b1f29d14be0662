"""The API when the store misbehaves, with real processes: a second process frozen inside a SQLite write transaction
leaves reads working and writes answered 503, another engine on an open SQLite store leaves the process's locks
alone, and a real training step (the worker's child process) on data with NUL bytes succeeds on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlmodel import Session

from collage.app.store.tables import ApiToken, utcnow
from collage.app.store.tokens import create_token
from tests.support import API
from tests.support.api import config, filled_run, make_app
from tests.support.services import truncate
from tests.support.waiting import scaled


def _stale(app, name: str) -> None:
    """Make the token's last use older than a minute: its next use notes the time again."""
    with Session(app.state.engine) as session:
        session.execute(
            update(ApiToken).where(ApiToken.name == name).values(last_used_at=utcnow() - timedelta(minutes=5))
        )
        session.commit()


READS = ("/runs", "/runs/{run}", "/runs/{run}/metrics", "/runs/{run}/samples", "/runs/{run}/events", "/health")


HOLDER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")  # the write lock, held until this process dies
connection.execute("UPDATE runs SET notes = 'held' WHERE id = ?", (sys.argv[2],))
print("locked", flush=True)
time.sleep(600)
"""


def test_a_process_frozen_inside_a_sqlite_write_leaves_reads_working_and_writes_503(migrated_sqlite_url, tmp_path):
    truncate(migrated_sqlite_url)
    app = make_app(migrated_sqlite_url, tmp_path, db_lock_timeout=1.0)
    admin_secret = create_token(app.state.engine, "admin", role="admin")
    member_secret = create_token(app.state.engine, "member")
    admin = TestClient(app, headers={"Authorization": f"Bearer {admin_secret}"}, raise_server_exceptions=False)
    member = TestClient(app, headers={"Authorization": f"Bearer {member_secret}"}, raise_server_exceptions=False)
    run = filled_run(admin, app)
    for name in ("admin", "member"):  # both last used long ago: the old token check wrote last_used_at now
        _stale(app, name)
    path = migrated_sqlite_url.split("///", 1)[1]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path, run], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGSTOP)  # frozen (a paused VM, a debugger), its transaction open
        app.state.engine.dispose()  # and every request opens fresh connections while the lock is held
        for client in (admin, member):
            for route in READS:
                response = client.get(API + route.format(run=run))
                assert response.status_code == 200, (route, response.status_code, response.text)
        assert member.get(f"{API}/runs/{run}").json()["notes"] is None  # the frozen write is not visible
        for method, route, body in (
            ("POST", "/runs", config()),
            ("PATCH", f"/runs/{run}", {"notes": "new"}),
            ("POST", f"/runs/{run}/cancel", None),
        ):
            started = time.monotonic()
            response = admin.request(method, API + route, json=body)
            assert response.status_code == 503, (method, route, response.status_code, response.text)
            assert response.headers["retry-after"] == "5" and "try again" in response.json()["detail"]
            assert time.monotonic() - started < scaled(25), "bounded by the lock timeout (1 s here), never a 30 s hang"
    finally:
        holder.kill()
        holder.wait(scaled(30))
    # the lock is gone: writes work again
    assert admin.patch(f"{API}/runs/{run}", json={"notes": "new"}).status_code == 200


def test_another_engine_on_an_open_sqlite_store_leaves_its_locks_alone(tmp_path):
    """A web process holds several engines of one store (requests', last-use notes'). Making one must not open and
    close the database file: that drops every POSIX lock the process holds on it, so another process that closes
    its connection takes the store for unused and removes its -wal and -shm files under the live connections
    (then: "disk I/O error", and writes to a removed WAL)."""
    from collage.app.store.engine import make_engine

    path = tmp_path / "store.db"
    first = make_engine(f"sqlite:///{path}")
    with first.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    live = first.connect()
    assert live.exec_driver_sql("SELECT count(*) FROM t").scalar() == 1
    second = make_engine(f"sqlite:///{path}")
    writer = (
        f"import sqlite3; c = sqlite3.connect({str(path)!r}); c.execute('INSERT INTO t VALUES (2)'); c.commit(); "
        "c.close()"
    )
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=scaled(60))  # a worker writes, then exits
    assert (tmp_path / "store.db-wal").exists() and (tmp_path / "store.db-shm").exists()
    live.exec_driver_sql("INSERT INTO t VALUES (3)")
    live.commit()
    with second.begin() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (4)")
    assert live.exec_driver_sql("SELECT count(*) FROM t").scalar() == 4
    live.close()
    first.dispose()
    second.dispose()
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_training_run_with_nul_bytes_in_its_data_succeeds_on_both_databases(api, tmp_path):
    """A real training step (the worker's child process) on a dataset whose prompts and answers hold NUL bytes:
    PostgreSQL used to fail the run on the samples insert; now both stores keep U+FFFD and say how many."""
    from PIL import Image

    client, _, _, app = api
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32), (255, 0, 0)).save(data / "red.png")
    rows = [{"prompt": f"How many red\x00 images? ({i})", "images": ["red.png"], "answer": "1\x00"} for i in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = config(
        dataset={"source": str(data / "train.jsonl")},
        rewards=[{"name": "accuracy"}],
        train={"max_steps": 1, "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 4},
    )
    body["dataset"].pop("rows")
    settings = app.state.settings
    env = {
        **os.environ,
        "COLLAGE_DATABASE_URL": settings.database_url,
        "COLLAGE_ARTIFACTS": str(settings.artifacts),
        "COLLAGE_DATA_ROOTS": str(tmp_path),
    }
    created = client.post(API + "/runs", json=body)
    assert created.status_code == 201, created.text
    run = created.json()["id"]
    assert app.state.writer.transition(run, ["queued"], "running")
    done = subprocess.run(
        [sys.executable, "-m", "collage.worker.child", run, "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    out = client.get(f"{API}/runs/{run}").json()
    assert done.returncode == 0 and out["status"] == "succeeded", (out["error"], done.stderr[-3000:])
    items = client.get(f"{API}/runs/{run}/samples").json()["items"]
    assert len(items) == 2
    for item in items:
        assert item["columns"]["answer"] == "1\ufffd"
        assert "red\ufffd images" in json.dumps(item["prompt"], ensure_ascii=False)
    warnings = client.get(f"{API}/runs/{run}/events", params={"level": "warning"}).json()["items"]
    assert any("NUL characters in rollout text stored as U+FFFD" in w["message"] for w in warnings), warnings
