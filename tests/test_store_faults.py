"""The API when the store misbehaves, and text the store cannot hold, on SQLite and PostgreSQL with real faults: a
second process frozen inside a SQLite write transaction, PostgreSQL backends terminated under the app, a database
that refuses connections, NUL bytes in what a run writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select, update
from sqlmodel import Session

from collage.app.models import ApiToken, Event, Run, utcnow
from collage.app.store.tokens import create_token, note_use
from collage.app.store.writer import ImageIn, SampleIn

from .conftest import _truncate
from .test_api import API, _png, config


def _app(database_url: str, tmp_path: Path, **settings):
    from collage.app.main import create_app
    from collage.app.settings import Settings

    from .conftest import RecordingDispatcher

    values = {
        "home": tmp_path,
        "database_url": database_url,
        "broker_url": "memory://",
        "artifacts": tmp_path / "artifacts",
        **settings,
    }
    return create_app(Settings(**values), RecordingDispatcher())


def _stale(app, name: str) -> None:
    """Make the token's last use older than a minute: its next use notes the time again."""
    with Session(app.state.engine) as session:
        session.execute(
            update(ApiToken).where(ApiToken.name == name).values(last_used_at=utcnow() - timedelta(minutes=5))
        )
        session.commit()


def _filled_run(client: TestClient, app) -> str:
    run = client.post(API + "/runs", json=config()).json()["id"]
    writer = app.state.writer
    assert writer.transition(run, ["queued"], "running")
    writer.append_metrics(run, 1, {"reward": 0.5})
    writer.append_samples(run, 1, [SampleIn(0, 0, "p", "c", [ImageIn(_png((9, 9, 9)))], {}, 1.0, 0.0, 1, False)])
    writer.add_event(run, "info", "started")
    return run


READS = ("/runs", "/runs/{run}", "/runs/{run}/metrics", "/runs/{run}/samples", "/runs/{run}/events", "/health")


# ------------------------------------------------------------------ SQLite: a process frozen mid-transaction

HOLDER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")  # the write lock, held until this process dies
connection.execute("UPDATE runs SET notes = 'held' WHERE id = ?", (sys.argv[2],))
print("locked", flush=True)
time.sleep(600)
"""


def test_a_process_frozen_inside_a_sqlite_write_leaves_reads_working_and_writes_503(migrated_sqlite_url, tmp_path):
    _truncate(migrated_sqlite_url)
    app = _app(migrated_sqlite_url, tmp_path, db_lock_timeout=1.0)
    admin_secret = create_token(app.state.engine, "admin", role="admin")
    member_secret = create_token(app.state.engine, "member")
    admin = TestClient(app, headers={"Authorization": f"Bearer {admin_secret}"}, raise_server_exceptions=False)
    member = TestClient(app, headers={"Authorization": f"Bearer {member_secret}"}, raise_server_exceptions=False)
    run = _filled_run(admin, app)
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
            assert time.monotonic() - started < 25, "bounded by the lock timeout (1 s here), never a 30 s hang"
    finally:
        holder.kill()
        holder.wait(30)
    # the lock is gone: writes work again
    assert admin.patch(f"{API}/runs/{run}", json={"notes": "new"}).status_code == 200


def test_another_engine_on_an_open_sqlite_store_leaves_its_locks_alone(tmp_path):
    """A web process holds several engines of one store (requests', last-use notes'). Making one must not open and
    close the database file: that drops every POSIX lock the process holds on it, so another process that closes
    its connection takes the store for unused and removes its -wal and -shm files under the live connections
    (then: "disk I/O error", and writes to a removed WAL)."""
    from collage.app.db import make_engine

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
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=60)  # a worker writes, then exits
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


def test_last_used_is_noted_off_the_request_at_most_once_a_minute(database_url, tmp_path):
    app = _app(database_url, tmp_path)
    secret = create_token(app.state.engine, "noted")
    client = TestClient(app, headers={"Authorization": f"Bearer {secret}"})
    writes: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("UPDATE API_TOKENS"):
            writes.append(statement)

    from collage.app.db import engine_for
    from collage.app.store.tokens import USE_LOCK_TIMEOUT

    quick = engine_for(str(app.state.engine.url.render_as_string(hide_password=False)), USE_LOCK_TIMEOUT)
    event.listen(app.state.engine, "before_cursor_execute", count)
    event.listen(quick, "before_cursor_execute", count)
    try:
        with Session(app.state.engine) as session:
            token = session.scalars(select(ApiToken).where(ApiToken.name == "noted")).one()
        assert token.last_used_at is None
        pending = note_use(app.state.engine, token)
        assert pending is not None
        pending.result(timeout=30)
        for _ in range(5):
            assert client.get(API + "/runs").status_code == 200
        with Session(app.state.engine) as session:
            used = session.scalars(select(ApiToken.last_used_at).where(ApiToken.name == "noted")).one()
        assert used is not None and utcnow() - used.replace(tzinfo=utcnow().tzinfo) < timedelta(minutes=1)
        assert len(writes) == 1, writes  # once, though it was used six times
    finally:
        event.remove(app.state.engine, "before_cursor_execute", count)
        event.remove(quick, "before_cursor_execute", count)


# ----------------------------------------------------------------- PostgreSQL: dropped and refused connections


def _admin_connection(url: str) -> psycopg.Connection:
    return psycopg.connect(url.replace("+psycopg", ""), autocommit=True)


def _terminate_all(url: str) -> int:
    """Terminate every backend of the database (a restart, a failover, a connection storm), from a connection to
    the server's maintenance database."""
    base, name = url.rsplit("/", 1)
    with _admin_connection(base + "/postgres") as conn:
        pids = [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (name,))]
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        _wait_gone(conn, pids)
    return len(pids)


def _wait_gone(conn: psycopg.Connection, pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone()[0]:
        assert time.monotonic() < deadline, "terminated backends did not exit"
        time.sleep(0.05)


def test_reads_survive_terminated_postgresql_connections(migrated_postgres_url, tmp_path):
    _truncate(migrated_postgres_url)
    app = _app(migrated_postgres_url, tmp_path)
    secret = create_token(app.state.engine, "reader", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {secret}"}, raise_server_exceptions=False)
    run = _filled_run(client, app)
    for route in READS:  # the pool holds live connections
        assert client.get(API + route.format(run=run)).status_code == 200
    # between requests: every pooled connection is dead
    assert _terminate_all(migrated_postgres_url) > 0
    for route in READS:
        response = client.get(API + route.format(run=run))
        assert response.status_code == 200, (route, response.status_code, response.text)

    # during a request: the connection dies after the pool checked it out (and pinged it), before its first query
    armed = {"left": 0}

    def kill_on_checkout(dbapi_connection, _record, _proxy):
        if armed["left"] > 0:
            armed["left"] -= 1
            pid = dbapi_connection.info.backend_pid
            with _admin_connection(migrated_postgres_url) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                _wait_gone(conn, [pid])

    event.listen(app.state.engine.pool, "checkout", kill_on_checkout)
    try:
        for route in READS:
            armed["left"] = 1
            response = client.get(API + route.format(run=run))
            assert armed["left"] == 0 and response.status_code == 200, (route, response.status_code, response.text)
        # a write is not repeated by the API (the writer retries its own transaction): it succeeds or says 503
        armed["left"] = 1
        assert client.patch(f"{API}/runs/{run}", json={"notes": "after a drop"}).status_code in (200, 503)
    finally:
        event.remove(app.state.engine.pool, "checkout", kill_on_checkout)


def test_a_database_that_refuses_connections_answers_503_with_retry_after(migrated_postgres_url, tmp_path):
    _truncate(migrated_postgres_url)
    app = _app(migrated_postgres_url, tmp_path, db_lock_timeout=2.0)
    secret = create_token(app.state.engine, "waiting", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {secret}"}, raise_server_exceptions=False)
    run = _filled_run(client, app)
    from .test_roles import _browser_login

    browser = _browser_login(app, token=secret)
    name = migrated_postgres_url.rsplit("/", 1)[1]
    with _admin_connection(migrated_postgres_url.rsplit("/", 1)[0] + "/postgres") as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            _terminate_all(migrated_postgres_url)
            for method, route, body in (
                ("GET", f"/runs/{run}", None),
                ("GET", "/runs", None),
                ("POST", "/runs", config()),
                ("PATCH", f"/runs/{run}", {"notes": "x"}),
            ):
                response = client.request(method, API + route, json=body)
                assert response.status_code == 503, (method, route, response.status_code, response.text)
                assert response.headers["retry-after"] == "5"
            assert browser.get("/runs").status_code == 503  # a logged-in page: the same answer
        finally:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    assert client.get(f"{API}/runs/{run}").status_code == 200


# ----------------------------------------------------------------------------------------------- NUL bytes


def test_nul_bytes_are_stored_the_same_way_on_both_databases_and_counted(api):
    client, _, _, app = api
    writer = app.state.writer
    run = client.post(API + "/runs", json=config()).json()["id"]
    assert writer.transition(run, ["queued"], "running")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count\x00 the red"}]}]
    rows = [
        SampleIn(0, 0, prompt, "2\x00\x00 red", [ImageIn(_png((255, 0, 0)))], {"acc\x00": 1.0}, 1.0, 0.5, 3, False,
                 columns={"answer": "2\x00", "ta\x00sk": "count"}),
        SampleIn(0, 1, "plain\x00prompt", "clean", [], {"acc\x00": 0.0}, 0.0, -0.5, 1, False),
    ]  # fmt: skip
    assert writer.append_samples(run, 1, rows) == 2
    writer.append_metrics(run, 1, {"rewards/acc\x00/mean": 0.5, "reward": 0.5})
    writer.add_event(run, "info", "a message with\x00 a NUL")
    assert writer.transition(run, ["running"], "failed", error="boom\x00", message="failed: boom\x00")

    items = client.get(f"{API}/runs/{run}/samples", params={"sort": "id"}).json()["items"]
    assert [i["completion"] for i in items] == ["2\ufffd\ufffd red", "clean"]
    assert items[0]["prompt"][0]["content"][1]["text"] == "count\ufffd the red"
    assert items[1]["prompt"] == "plain\ufffdprompt"
    assert items[0]["columns"] == {"answer": "2\ufffd", "ta\ufffdsk": "count"}
    assert items[0]["rewards"] == {"acc\ufffd": 1.0}
    # search works on the stored text (PostgreSQL refused the whole step before)
    assert [i["completion"] for i in client.get(f"{API}/runs/{run}/samples", params={"q": "red"}).json()["items"]] == [
        "2\ufffd\ufffd red"
    ]
    assert set(client.get(f"{API}/runs/{run}/metrics").json()) == {"rewards/acc\ufffd/mean", "reward"}
    out = client.get(f"{API}/runs/{run}").json()
    assert out["error"] == "boom\ufffd"
    messages = [e["message"] for e in client.get(f"{API}/runs/{run}/events").json()["items"]]
    # counted: 2 in the completion, 1 in the prompt's text, 1 in the plain prompt, 2 in the columns, 2 reward keys
    assert "step 1: 8 NUL characters in rollout text stored as U+FFFD" in " ".join(messages), messages
    assert any(m.startswith("step 1: 1 NUL character in metric names") for m in messages), messages
    assert "a message with\ufffd a NUL [1 NUL character in this message stored as U+FFFD" in " ".join(messages)
    assert "failed: boom\ufffd" in messages
    assert out["warning_count"] == 2
    with Session(app.state.engine) as session:
        stored = session.scalars(select(Event.message).where(Event.run_id == run)).all()
        assert not any("\x00" in m for m in stored)
        assert "\x00" not in (session.get(Run, run).error or "")


@pytest.mark.slow
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
        [sys.executable, "-m", "collage.worker.child", run, "1"], env=env, capture_output=True, text=True, timeout=600
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
