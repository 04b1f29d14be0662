"""The migration tests' own PostgreSQL database (one per module) and an empty database URL for each test."""

from __future__ import annotations

import uuid

import pytest

from tests.support.services import PG_ADMIN_URL, postgres_unavailable, require_service


@pytest.fixture(scope="module")
def migrations_database():
    """One PostgreSQL database for the module, dropped at its end: dropping a database makes PostgreSQL wait for a
    checkpoint (every dirty page of the server to disk), which took up to 19 s on a busy CI machine per test."""
    require_service(postgres_unavailable())
    import psycopg

    from collage.app.store.engine import engine_for

    name = f"collage_mig_{uuid.uuid4().hex[:10]}"
    admin = PG_ADMIN_URL.replace("+psycopg", "")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    engine_for.cache_clear()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path):
    """A database no migration has touched yet: a new SQLite file, or the module's PostgreSQL database emptied
    (its extensions and its public schema dropped and the schema made again)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    import psycopg

    url = request.getfixturevalue("migrations_database")
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE datname = current_database() AND pid <> pg_backend_pid()")  # fmt: skip
        conn.execute("DROP EXTENSION IF EXISTS btree_gin, pg_trgm CASCADE")
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    yield url
