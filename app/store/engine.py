"""Database engine, sessions and migrations.

SQLite (the default) runs in WAL mode with foreign keys on and a busy timeout, so the web app and a worker can
write at the same time; PostgreSQL is used as is through ``COLLAGE_DATABASE_URL``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, create_engine

from collage.app.store.errors import StoreError


class DatabaseNotMigrated(StoreError, RuntimeError):
    pass


def normalise_url(url: str) -> str:
    # plain postgresql:// URLs mean psycopg 3 (the driver Collage installs), not psycopg2
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


# The web app runs sync routes and streamed downloads on anyio's worker threads (40 by default), each holding at
# most one connection at a time on its hot paths: a pool smaller than that makes requests wait for connections
# (and time out) under load. Idle connections beyond POOL_SIZE are closed, so the headroom costs nothing at rest.
SERVER_THREADS = 40
POOL_SIZE = 10
POOL_OVERFLOW = SERVER_THREADS + 10 - POOL_SIZE  # room for a request's short inner sessions too


def private_file(path: Path) -> None:
    """Create ``path`` (and its folder) readable by its owner alone: a SQLite store or broker holds token
    hashes, sessions and every run. SQLite gives its -wal and -shm files the database file's mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        # never open a database that exists: closing any descriptor of a file drops every POSIX lock this process
        # holds on it, so a second engine made here would strip the first engine's connections of their locks
        # (SQLite's WAL then takes a live database for unused: its -wal/-shm files are removed, "disk I/O error")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
        except FileExistsError:  # another process made it meanwhile
            pass
    os.chmod(path, 0o600)


# how long a statement waits for a lock another connection holds, unless the engine's user says otherwise (the web
# app does: COLLAGE_DB_LOCK_TIMEOUT, so a request answers 503 rather than hang)
DEFAULT_LOCK_TIMEOUT = 30.0
# best-effort housekeeping on a new SQLite connection may wait this long for the write lock, then is skipped
HOUSEKEEPING_LOCK_TIMEOUT_MS = 100


def make_engine(url: str, lock_timeout: float | None = None) -> Engine:
    """An engine for ``url``. ``lock_timeout`` (seconds): how long a statement may wait for a lock before it
    fails with ``OperationalError`` (SQLite's busy timeout, default :data:`DEFAULT_LOCK_TIMEOUT`; PostgreSQL's
    ``lock_timeout``, none by default)."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        on_disk = path not in ("", ":memory:")  # an in-memory database keeps SQLAlchemy's one-connection pool
        pool = {"pool_size": POOL_SIZE, "max_overflow": POOL_OVERFLOW} if on_disk else {}
        if on_disk:
            private_file(Path(path))
        busy_ms = int(1000 * (DEFAULT_LOCK_TIMEOUT if lock_timeout is None else lock_timeout))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": busy_ms / 1000}, **pool)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            # keep the planner's statistics fresh (bounded work): without them SQLite may pick a worse index. It
            # may write (ANALYZE), so it must never wait behind another process's write transaction: a frozen
            # writer would otherwise fail every new connection, reads included
            cursor.execute("PRAGMA analysis_limit=1000")
            cursor.execute(f"PRAGMA busy_timeout={HOUSEKEEPING_LOCK_TIMEOUT_MS}")
            try:
                cursor.execute("PRAGMA optimize=0x10002")
            except sqlite3.OperationalError:  # locked: the next connection tries again
                pass
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
            cursor.close()

        return engine
    if url.startswith("postgresql"):
        from collage.app.core.extras import require

        require("postgres", "a PostgreSQL store (COLLAGE_DATABASE_URL)")
    # psycopg prepares repeated statements; a generic plan would use the trigram index even for very common
    # search terms (measured: 0.9 ms -> 157 ms), so plan every execution for its parameters
    # a process frozen inside a transaction (SIGSTOP, a paused VM) must not hold its locks forever: the server
    # ends such a session after 60 s (Collage's transactions are short bursts, never idle for that long)
    options = "-c plan_cache_mode=force_custom_plan -c idle_in_transaction_session_timeout=60000"
    if lock_timeout is not None:
        options += f" -c lock_timeout={int(1000 * lock_timeout)}"
    return create_engine(
        url,
        pool_pre_ping=True,  # a connection the server dropped while idle in the pool is replaced at checkout
        pool_size=POOL_SIZE,
        max_overflow=POOL_OVERFLOW,
        connect_args={"options": options},
    )


@lru_cache(maxsize=16)
def engine_for(url: str, lock_timeout: float | None = None) -> Engine:
    """One engine per process for each (URL, lock timeout)."""
    return make_engine(url, lock_timeout)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One transaction: committed on success, rolled back on any error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def migrations_dir() -> Path:
    """The migrations shipped as package data of ``collage.migrations`` (alembic.ini beside them)."""
    import collage.migrations

    return Path(collage.migrations.__file__).resolve().parent


def alembic_config(url: str):
    from alembic.config import Config

    config = Config(str(migrations_dir() / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", normalise_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    _migrate(url, revision, down=False)


def downgrade(url: str, revision: str) -> None:
    """Back to ``revision`` (an operator undoing an upgrade; the tests check each migration's way back)."""
    _migrate(url, revision, down=True)


MIGRATION_LOCK = 0x636F6C6C616765  # "collage": the advisory lock that serialises migrations on PostgreSQL


def _migrate(url: str, revision: str, down: bool) -> None:
    from alembic import command

    engine = make_engine(url)  # ours: SQLite's folder is created and its pragmas are on
    try:
        with engine.connect() as connection:
            sqlite = connection.dialect.name == "sqlite"
            if sqlite:
                # SQLite alters a table by copying it into a new one and dropping the old one: with foreign keys
                # on, that drop would cascade-delete every row that references it (a run's metrics, samples...).
                # The pragma only takes effect outside a transaction, so it goes first.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            with connection.begin():
                if connection.dialect.name == "postgresql":
                    # web replicas (and workers) may start at once: one migrates, the others wait here, then find
                    # the store at the newest revision (the lock ends with this transaction)
                    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
                config = alembic_config(url)
                config.attributes["connection"] = connection
                (command.downgrade if down else command.upgrade)(config, revision)
                if sqlite:
                    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"migration left rows that break foreign keys: {broken[:5]}")
            if sqlite:
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
    finally:
        engine.dispose()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None, "Collage ships its migrations"
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def check_migrated(engine: Engine) -> None:
    """Refuse to serve a database whose schema is not at the newest migration."""
    have, want = current_revision(engine), head_revision()
    if have != want:
        state = "has no Collage schema" if have is None else f"is at migration {have}, not {want}"
        raise DatabaseNotMigrated(
            f"the database {engine.url.render_as_string(hide_password=True)} {state}: run `collage db upgrade` "
            "(with the same COLLAGE_DATABASE_URL) first"
        )


def migrated_store() -> Engine:
    """The engine of the store the settings name (``COLLAGE_DATABASE_URL``), refused unless migrated: what a command
    line tool works on."""
    from collage.app.core.settings import get_settings

    engine = engine_for(get_settings().database_url)
    check_migrated(engine)
    return engine
