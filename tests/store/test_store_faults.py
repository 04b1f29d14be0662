"""The API when the store misbehaves, and text the store cannot hold, on SQLite and PostgreSQL through the in-process
app with real faults: PostgreSQL backends terminated under the app, a database that refuses connections (503 with
Retry-After), NUL bytes in what a run writes, and a token's last use noted off the request at most once a minute."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from fastapi.testclient import TestClient
from sqlalchemy import event, select
from sqlmodel import Session

from collage.app.store.tables import ApiToken, Event, Run, utcnow
from collage.app.store.tokens import create_token, note_use
from collage.app.store.writer import ImageIn, SampleIn
from tests.support import API
from tests.support.api import config, filled_run, make_app, png
from tests.support.services import truncate
from tests.support.waiting import scaled, wait_for

READS = ("/runs", "/runs/{run}", "/runs/{run}/metrics", "/runs/{run}/samples", "/runs/{run}/events", "/health")


def test_last_used_is_noted_off_the_request_at_most_once_a_minute(database_url, tmp_path):
    app = make_app(database_url, tmp_path)
    secret = create_token(app.state.engine, "noted")
    client = TestClient(app, headers={"Authorization": f"Bearer {secret}"})
    writes: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("UPDATE API_TOKENS"):
            writes.append(statement)

    from collage.app.store.engine import engine_for
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
        pending.result(timeout=scaled(30))
        for _ in range(5):
            assert client.get(API + "/runs").status_code == 200
        with Session(app.state.engine) as session:
            used = session.scalars(select(ApiToken.last_used_at).where(ApiToken.name == "noted")).one()
        assert used is not None and utcnow() - used.replace(tzinfo=utcnow().tzinfo) < timedelta(minutes=1)
        assert len(writes) == 1, writes  # once, though it was used six times
    finally:
        event.remove(app.state.engine, "before_cursor_execute", count)
        event.remove(quick, "before_cursor_execute", count)


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
    wait_for(lambda: conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone()[0],
             "the terminated backends to exit", until=lambda left: left == 0, interval=0.05)  # fmt: skip


def test_reads_survive_terminated_postgresql_connections(migrated_postgres_url, tmp_path):
    truncate(migrated_postgres_url)
    app = make_app(migrated_postgres_url, tmp_path)
    secret = create_token(app.state.engine, "reader", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {secret}"}, raise_server_exceptions=False)
    run = filled_run(client, app)
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
    truncate(migrated_postgres_url)
    app = make_app(migrated_postgres_url, tmp_path, db_lock_timeout=2.0)
    secret = create_token(app.state.engine, "waiting", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {secret}"}, raise_server_exceptions=False)
    run = filled_run(client, app)
    from tests.support.api import session_client

    browser = session_client(app, token=secret)
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


def test_nul_bytes_are_stored_the_same_way_on_both_databases_and_counted(api):
    client, _, _, app = api
    writer = app.state.writer
    run = client.post(API + "/runs", json=config()).json()["id"]
    assert writer.transition(run, ["queued"], "running")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count\x00 the red"}]}]
    rows = [
        SampleIn(0, 0, prompt, "2\x00\x00 red", [ImageIn(png((255, 0, 0)))], {"acc\x00": 1.0}, 1.0, 0.5, 3, False,
                 columns={"answer": "2\x00", "ta\x00sk": "count"}),
        SampleIn(0, 1, "plain\x00prompt", "clean", [], {"acc\x00": 0.0}, 0.0, -0.5, 1, False),
    ]  # fmt: skip
    assert writer.append_samples(run, 1, rows) == 2
    assert writer.append_samples(run, 2, rows[1:]) == 1  # NULs again: counted in the metric, no second warning
    writer.append_metrics(run, 1, {"rewards/acc\x00/mean": 0.5, "reward": 0.5})
    writer.add_event(run, "info", "a message with\x00 a NUL")
    assert writer.transition(run, ["running"], "failed", error="boom\x00", message="failed: boom\x00")

    items = client.get(f"{API}/runs/{run}/samples", params={"sort": "id", "step": 1}).json()["items"]
    assert [i["completion"] for i in items] == ["2\ufffd\ufffd red", "clean"]
    assert items[0]["prompt"][0]["content"][1]["text"] == "count\ufffd the red"
    assert items[1]["prompt"] == "plain\ufffdprompt"
    assert items[0]["columns"] == {"answer": "2\ufffd", "ta\ufffdsk": "count"}
    assert items[0]["rewards"] == {"acc\ufffd": 1.0}
    # search works on the stored text (PostgreSQL refused the whole step before)
    assert [i["completion"] for i in client.get(f"{API}/runs/{run}/samples", params={"q": "red"}).json()["items"]] == [
        "2\ufffd\ufffd red"
    ]
    metrics = client.get(f"{API}/runs/{run}/metrics").json()
    assert set(metrics) == {"rewards/acc\ufffd/mean", "reward", "store/nul_replaced"}
    assert metrics["store/nul_replaced"] == [[1, 8.0], [2, 2.0]]  # each step's count, a metric like the others
    out = client.get(f"{API}/runs/{run}").json()
    assert out["error"] == "boom\ufffd"
    messages = [e["message"] for e in client.get(f"{API}/runs/{run}/events").json()["items"]]
    # counted: 2 in the completion, 1 in the prompt's text, 1 in the plain prompt, 2 in the columns, 2 reward keys
    assert "step 1: 8 NUL characters in rollout text stored as U+FFFD" in " ".join(messages), messages
    assert not any(m.startswith("step 2:") for m in messages), messages  # warned once per run
    assert any(m.startswith("step 1: 1 NUL character in metric names") for m in messages), messages
    assert "a message with\ufffd a NUL [1 NUL character in this message stored as U+FFFD" in " ".join(messages)
    assert "failed: boom\ufffd" in messages
    assert out["warning_count"] == 2
    with Session(app.state.engine) as session:
        stored = session.scalars(select(Event.message).where(Event.run_id == run)).all()
        assert not any("\x00" in m for m in stored)
        assert "\x00" not in (session.get(Run, run).error or "")
