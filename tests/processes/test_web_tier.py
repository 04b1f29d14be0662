"""The shape of the web tier at start-up: `collage serve`, in a process of its own, freezes its start-up heap out of
the cyclic collector's reach before it answers (its full collections were the SQLite metrics route's p95,
docs/benchmarks.md)."""

from __future__ import annotations

from tests.support.waiting import scaled


def test_collage_serve_freezes_its_start_up_heap_before_it_answers(tmp_path):
    """The objects start-up made are out of the cyclic collector's reach when the server starts answering: its full
    collections were the SQLite metrics route's p95 (docs/benchmarks.md). In a process of its own: a frozen heap
    in the test process would stay frozen for every later test."""
    import json
    import os
    import subprocess
    import sys

    script = (
        "import gc, json, sys, uvicorn\n"
        "from collage.app.cli.serve import serve\n"
        "def run(self):\n"
        "    print(json.dumps({'frozen': gc.get_freeze_count(), 'app': any(type(o).__name__ == 'FastAPI' for o in "
        "gc.get_objects())}))\n"
        "uvicorn.Server.run = run\n"
        "sys.exit(serve('127.0.0.1', 0, 0))\n"
    )
    env = {**os.environ, "COLLAGE_HOME": str(tmp_path / "home"), "COLLAGE_ARTIFACTS": str(tmp_path / "artifacts")}
    for name in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    # the app itself is among the frozen objects (gc.get_objects() lists only the tracked, unfrozen ones)
    assert seen["frozen"] > 10_000 and not seen["app"], seen
