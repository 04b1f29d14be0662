"""Fixtures of the process tests: our own Redis server, workers around an in-process API (tests/support/cluster.py)
on PostgreSQL and Redis or on the embedded SQLite store and broker."""

from __future__ import annotations

import pytest

from tests.support.cluster import Cluster, embedded_cluster
from tests.support.services import RedisServer, redis_unavailable, require_service, truncate


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    require_service(redis_unavailable())
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory):
    """One COLLAGE_HOME for the module: tiny models and synthetic data are built once, by the first run."""
    return tmp_path_factory.mktemp("collage-home")


@pytest.fixture
def embedded(tmp_path):
    """Workers on the embedded defaults (SQLite store and broker files in one COLLAGE_HOME)."""
    c = embedded_cluster(tmp_path)
    yield c
    c.stop_all()


@pytest.fixture
def cluster(migrated_postgres_url, redis_server, shared_home, tmp_path):
    """Workers on PostgreSQL (emptied first) and our own Redis."""
    truncate(migrated_postgres_url)
    c = Cluster(migrated_postgres_url, redis_server.url, shared_home, tmp_path / "artifacts")
    yield c
    c.stop_all()
