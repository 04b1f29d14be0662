"""Publishing a run on the embedded SQLite broker while another process declares the same queue.

Reproduced for real: a second SQLite connection (the worker process of `collage serve`, starting) inserts the
queue's row between the web process's look for it and its own insert, as happened in CI ("UNIQUE constraint
failed: kombu_queue.name" answered 503 and failed the run). The run's message must be published once.
"""

from __future__ import annotations

import sqlite3

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine

from collage.app.core.settings import Settings
from collage.worker.dispatcher import CeleryDispatcher


def _messages(broker: str, queue: str) -> int:
    with sqlite3.connect(broker) as db:
        return db.execute(
            "SELECT count(*) FROM kombu_message m JOIN kombu_queue q ON m.queue_id = q.id WHERE q.name = ?", (queue,)
        ).fetchone()[0]


def test_a_publish_that_races_a_worker_declaring_its_queue_is_sent_once(tmp_path):
    broker = tmp_path / "broker.db"
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'store.db'}",
                        broker_url=f"sqla+sqlite:///{broker}", artifacts=tmp_path / "artifacts")  # fmt: skip
    dispatcher = CeleryDispatcher(settings, create_engine("sqlite://"))
    raced: list[str] = []

    def the_worker_declares_first(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("INSERT INTO kombu_queue") and not raced:
            raced.append(statement)
            with sqlite3.connect(broker) as other:  # another process, committing between look and insert
                other.execute("INSERT INTO kombu_queue (name) VALUES (?)", (parameters[0],))

    event.listen(Engine, "before_cursor_execute", the_worker_declares_first)
    try:
        dispatcher.submit("run-1", "racy")
    finally:
        event.remove(Engine, "before_cursor_execute", the_worker_declares_first)
    assert raced, "the race did not happen: the test no longer exercises it"
    assert _messages(str(broker), "racy") == 1
    dispatcher.submit("run-2", "racy")  # and the dispatcher keeps working
    assert _messages(str(broker), "racy") == 2


def test_a_worker_declaring_its_queues_while_the_web_process_makes_one_starts_anyway(tmp_path):
    from collage.worker.celery_app import declare_embedded_queues, make_celery

    broker = tmp_path / "broker.db"
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'store.db'}",
                        broker_url=f"sqla+sqlite:///{broker}", artifacts=tmp_path / "artifacts")  # fmt: skip
    raced: list[str] = []

    def the_web_process_declares_first(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("INSERT INTO kombu_queue") and not raced:
            raced.append(statement)
            with sqlite3.connect(broker) as other:
                other.execute("INSERT INTO kombu_queue (name) VALUES (?)", (parameters[0],))

    event.listen(Engine, "before_cursor_execute", the_web_process_declares_first)
    try:
        declare_embedded_queues(make_celery(settings), settings.broker_url, ["default", "default.jobs"])
    finally:
        event.remove(Engine, "before_cursor_execute", the_web_process_declares_first)
    assert raced
    with sqlite3.connect(broker) as db:
        names = sorted(row[0] for row in db.execute("SELECT name FROM kombu_queue"))
    assert names == ["default", "default.jobs"]
