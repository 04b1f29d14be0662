"""A failing run's error as a member sees it, with a real training process (`collage.worker.child`) on SQLite and
PostgreSQL: its reward raises, run.error is one line for everyone, and the traceback is in the process's log and
in ``error_detail`` for admins only."""

from __future__ import annotations

import json

from tests.support import API
from tests.support.api import config, member_and_token
from tests.support.waiting import scaled


def test_the_training_child_stores_a_one_line_error_and_the_traceback_for_admins(api, tmp_path):
    """A real training process whose reward raises: run.error is one line for everyone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    admin, _, _, app = api
    member, _ = member_and_token(app)
    body = config(
        rewards=[{"name": "tests.support.rewards:explode_on_two_images"}],
        dataset={"min_images": 2, "max_images": 2, "rows": 4},
        train={"max_steps": 1, "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 4},
    )
    run = admin.post(API + "/runs", json=body).json()["id"]
    assert app.state.writer.transition(run, ["queued"], "running")
    settings = app.state.settings
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "COLLAGE_DATABASE_URL": settings.database_url,
        "COLLAGE_ARTIFACTS": str(settings.artifacts),
        "COLLAGE_REWARD_MODULES": "tests.support.rewards",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "collage.worker.child", run, "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" in done.stderr and "support/rewards.py" in done.stderr  # the worker's log keeps it
    mine = member.get(f"{API}/runs/{run}").json()
    assert mine["status"] == "failed" and "\n" not in mine["error"], mine["error"]
    assert "raised on" in mine["error"] and "RuntimeError: this reward cannot handle two images" in mine["error"]
    assert "support/rewards.py" not in json.dumps(member.get(f"{API}/runs/{run}/events").json())
    detail = admin.get(f"{API}/runs/{run}").json()["error_detail"]
    assert "Traceback" in detail and "support/rewards.py" in detail
