"""Enqueue-to-start latency on the embedded broker (SQLite store + SQLite-backed Celery transport).

Starts one `collage worker` on a fresh COLLAGE_HOME, submits N runs one after the other through the API and
measures the time from the run's creation to its claim by the worker (`started_at - created_at`), i.e. how long
a run waits in the queue of an idle worker. Goal: well under a second.

    .venv/bin/python bench/enqueue.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="collage-enqueue-"))
    os.environ.update(COLLAGE_HOME=str(home))
    for key in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS"):
        os.environ.pop(key, None)
    sys.path.insert(0, str(ROOT))
    from fastapi.testclient import TestClient
    from sqlmodel import Session

    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for, upgrade
    from collage.app.store.tables import Run
    from collage.app.store.tokens import create_token
    from collage.worker.dispatcher import CeleryDispatcher

    settings = Settings.from_env()
    upgrade(settings.database_url)
    engine = engine_for(settings.database_url)
    client = TestClient(create_app(settings, CeleryDispatcher(settings, engine)),
                        headers={"Authorization": f"Bearer {create_token(engine, 'bench')}"})  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen([sys.executable, "-m", "collage.app.cli", "worker", "--name", "bench"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    config = {
        "model": {"path": "tiny:qwen2-vl"}, "dataset": {"source": "synth:count-red", "rows": 8},
        "rewards": [{"name": "numeric"}], "resources": {"gpus": 0},
        "train": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4},
    }  # fmt: skip
    waits = []
    try:
        while not client.get("/api/v1/health").json()["workers"]:
            time.sleep(0.2)
        time.sleep(1)
        for _ in range(args.runs):
            run_id = client.post("/api/v1/runs", json=config).json()["id"]
            while True:
                with Session(engine) as session:
                    run = session.get(Run, run_id)
                if run.started_at is not None:
                    waits.append((run.started_at - run.created_at).total_seconds() * 1000)
                    break
                time.sleep(0.01)
            while client.get(f"/api/v1/runs/{run_id}").json()["status"] not in ("succeeded", "failed"):
                time.sleep(0.2)
            # the worker is free once its training process has exited (not when the run's status changes)
            while client.get("/api/v1/health").json()["workers"][0]["current_run"] is not None:
                time.sleep(0.05)
            time.sleep(0.2)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    q = statistics.quantiles(waits, n=20)
    print(f"enqueue -> claim on the embedded broker, {len(waits)} runs: "
          f"p50 {statistics.median(waits):.0f} ms, p95 {q[18]:.0f} ms, max {max(waits):.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
