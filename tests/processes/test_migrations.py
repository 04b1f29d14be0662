"""Migrations run by several processes at once (web replicas starting) on one empty PostgreSQL store: the advisory lock
lets one migrate while the others find the newest revision, and every process starts."""

from __future__ import annotations

import pytest

from tests.support.waiting import scaled


@pytest.mark.parametrize("empty_url", ["postgresql"], indirect=True)  # SQLite's writers queue on its own lock
def test_replicas_starting_at_once_migrate_once_and_both_start(empty_url):
    """Two processes (web replicas) upgrading an empty PostgreSQL store at the same moment: without the advisory
    lock one of them fails on a duplicate table; with it, one migrates and the other finds the newest revision."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from collage.app.store.engine import current_revision, head_revision, make_engine

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "COLLAGE_DATABASE_URL": empty_url, "PYTHONPATH": str(root)}
    cmd = [
        sys.executable,
        "-c",
        "import sys; from collage.app.store.engine import upgrade; upgrade(sys.argv[1])",
        empty_url,
    ]
    procs = [subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errors = [p.communicate(timeout=scaled(120))[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    engine = make_engine(empty_url)
    assert current_revision(engine) == head_revision()
    engine.dispose()
