"""The services the tests use: PostgreSQL, Redis and free local ports; and the rule that a missing service skips a
test on a user's machine but fails it under ``CI=true``."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from .waiting import scaled, wait_for

PG_ADMIN_URL = os.environ.get("COLLAGE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# the store's tables, children first: emptied between tests that share a database
TABLES = [
    "uploads", "jobs", "run_nodes", "sample_images", "sample_tool_images", "samples", "images", "metrics", "metric_rollups",
    "events", "checkpoints", "run_tags", "runs", "web_sessions", "login_links", "audit_log", "api_tokens", "workers",
]  # fmt: skip


def require_service(reason: str | None) -> None:
    """Skip on a user's machine that lacks a service; under CI=true a missing service is a failure."""
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test: {reason}")
    pytest.skip(reason)


def postgres_unavailable() -> str | None:
    """Why PostgreSQL cannot be used, or None when it can."""
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL.replace("+psycopg", ""), connect_timeout=round(scaled(3))):
            return None
    except Exception as exc:  # noqa: BLE001
        return f"PostgreSQL at {PG_ADMIN_URL} is not reachable ({type(exc).__name__}: {exc})"


def truncate(url: str) -> None:
    """Every table of the store at ``url`` emptied (a migrated database reused between tests)."""
    from sqlalchemy import text

    from collage.app.store.engine import engine_for

    engine = engine_for(url)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("TRUNCATE " + ", ".join(TABLES) + " RESTART IDENTITY CASCADE"))
        else:
            for table in TABLES:
                conn.execute(text(f"DELETE FROM {table}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class RedisServer:
    """Our own redis-server, so stopping it never touches the machine's shared instance."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.dir = tmp
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proc = self.proc
        wait_for(lambda: proc.poll() is not None or port_open(self.port), f"redis-server on port {self.port}")
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode} on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=scaled(30))
            self.proc = None


def redis_unavailable() -> str | None:
    return None if shutil.which("redis-server") else "redis-server is not installed"
