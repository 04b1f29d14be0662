"""What a training process reads from the store at its start (worker/child.py ``begin``: the run's config, its
checkpoints), on SQLite and PostgreSQL: a connection that is refused or dropped is retried like a store write, and
a store that stays unreachable past the retry window fails the run naming why, never as "exited with code 1"."""

from __future__ import annotations

import pytest
from sqlalchemy import event
from sqlmodel import Session, select

from collage.app.store.tables import Event, Run
from tests.support.api import config


def _claimed(url, tmp_path, monkeypatch):
    """A run claimed as running (attempt 1) and the training process's view of it, on an engine of its own whose
    connections the test may refuse."""
    from collage.app.core.settings import get_settings
    from collage.app.store.engine import engine_for, make_engine
    from collage.app.store.writer import StoreWriter
    from collage.worker.child import Attempt
    from tests.support.services import truncate

    truncate(url)
    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLLAGE_DATABASE_URL", url)
    monkeypatch.delenv("COLLAGE_ARTIFACTS", raising=False)
    get_settings.cache_clear()
    writer = StoreWriter(engine_for(url), tmp_path / "home" / "artifacts")
    run = writer.create_run(config(name="child-start"))
    assert writer.transition(run.id, ["queued"], "running", worker="test-worker")
    found = Attempt(run.id, 1)
    found.engine = make_engine(url)  # the process's own engine: a new pool, so every read connects
    found.store = StoreWriter(found.engine, found.settings.artifacts)
    found.writer = found.store.for_attempt(run.id, 1)
    yield found
    found.engine.dispose()
    get_settings.cache_clear()


@pytest.fixture
def attempt(database_url, tmp_path, monkeypatch):
    yield from _claimed(database_url, tmp_path, monkeypatch)


@pytest.fixture
def postgres_attempt(migrated_postgres_url, tmp_path, monkeypatch):
    yield from _claimed(migrated_postgres_url, tmp_path, monkeypatch)


class Refusals:
    """Makes the engine's new connections fail as the database driver fails a refused one, while ``down`` (or for
    the first ``left`` tries); counts the refusals."""

    def __init__(self, engine, left: int = 0, down: bool = False):
        self.engine, self.left, self.down, self.count = engine, left, down, 0
        self.error = engine.dialect.dbapi.OperationalError
        event.listen(engine, "do_connect", self)

    def __call__(self, _dialect, _record, _cargs, _cparams):
        if self.down or self.left > 0:
            self.left -= 1
            self.count += 1
            raise self.error('connection to server at "127.0.0.1" failed: Connection refused')
        return None  # connect as usual


def _stored(attempt) -> tuple[Run, list[str]]:
    from collage.app.store.engine import engine_for

    with Session(engine_for(attempt.settings.database_url)) as session:
        run = session.get(Run, attempt.run_id)
        events = list(session.exec(select(Event.message).where(Event.run_id == attempt.run_id).order_by(Event.id)))
        return run, events


def test_a_refused_connection_while_the_config_is_read_is_retried_and_the_config_read(attempt):
    refusals = Refusals(attempt.engine, left=3)
    config_data = attempt.config_data()
    assert refusals.count == 3 and refusals.left == 0
    assert config_data is not None and config_data["name"] == "child-start"


def test_the_whole_start_survives_refused_connections(attempt):
    from collage.worker.child import begin

    refusals = Refusals(attempt.engine, left=4)
    begun = begin(attempt)
    assert refusals.count == 4
    assert isinstance(begun, tuple), begun
    config_data, newest = begun
    assert config_data["name"] == "child-start" and newest is None  # a fresh start: no checkpoint recorded


def test_a_dropped_postgresql_connection_while_the_config_is_read_is_retried(migrated_postgres_url, postgres_attempt):
    """The server ends the connection after the pool handed it out (and pinged it), before the read's query."""
    import psycopg

    attempt = postgres_attempt

    killed = []

    def kill_on_checkout(dbapi_connection, _record, _proxy):
        if not killed:
            pid = dbapi_connection.info.backend_pid
            killed.append(pid)
            admin = migrated_postgres_url.rsplit("/", 1)[0].replace("+psycopg", "") + "/postgres"
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                from tests.support.waiting import wait_for

                wait_for(lambda: conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                              (pid,)).fetchone()[0],
                         "the terminated backend to exit", until=lambda left: left == 0, interval=0.05)  # fmt: skip

    event.listen(attempt.engine.pool, "checkout", kill_on_checkout)
    assert attempt.config_data()["name"] == "child-start"
    assert len(killed) == 1


def test_a_store_unreachable_past_the_retry_window_fails_the_run_naming_the_cause(attempt, monkeypatch):
    """The store refuses every connection for longer than the window while the config is read, and is back when the
    failure is written: the run's error says what could not be read, from which store, and why."""
    from collage.worker.child import EXIT_FAILED, begin

    attempt.store.retry_for = 0.5
    refusals = Refusals(attempt.engine, down=True)
    transition = attempt.store.transition

    def back_again(*args, **kwargs):
        refusals.down = False  # the database is back by the time the failure is recorded
        return transition(*args, **kwargs)

    monkeypatch.setattr(attempt.store, "transition", back_again)
    assert begin(attempt) == EXIT_FAILED
    assert refusals.count > 1  # it was retried before giving up
    run, events = _stored(attempt)
    assert run.status == "failed", run.status
    assert "could not read the run's config from the store" in run.error and "for 0.5 s" in run.error
    assert "Connection refused" in run.error and attempt.engine.url.database in run.error
    assert "exited with code" not in run.error
    assert any(m.startswith("failed: the training process could not read the run's config") for m in events), events


def test_a_store_that_never_comes_back_exits_saying_why_with_its_own_code(attempt, capsys):
    """Nothing can be written, the failure included: the worker's log names the cause and the exit code says the
    store was unreachable (not a crash)."""
    from collage.worker.child import EXIT_STORE_UNREACHABLE, begin

    attempt.store.retry_for = 0.3
    Refusals(attempt.engine, down=True)
    assert begin(attempt) == EXIT_STORE_UNREACHABLE
    err = capsys.readouterr().err
    assert "could not read the run's config from the store" in err and "Connection refused" in err
    assert "could not record it" in err
    run, _ = _stored(attempt)
    assert run.status == "running"  # the supervisor (or the reaper) records the end


def test_the_supervisor_records_a_child_that_could_not_reach_the_store_as_such(attempt):
    """The child's exit code for "failed, and the store could not be reached to record it" becomes a failed run
    that says so once the supervisor reaches the store, never "exited with code 6"."""
    from collage.app.store.writer import StoreWriter
    from collage.worker.child import EXIT_STORE_UNREACHABLE
    from collage.worker.supervisor import Watch, _record_exit

    writer = StoreWriter(attempt.engine, attempt.settings.artifacts)
    assert _record_exit(writer, EXIT_STORE_UNREACHABLE, attempt.run_id, 1, None, False, Watch()) == "failed"
    run, _ = _stored(attempt)
    assert run.status == "failed" and "could not reach the run store" in run.error and "code 6" not in run.error
