"""A run's checkpoints over the REST API, on SQLite and PostgreSQL, with real checkpoints of Collage's trainer placed
where a worker writes them: the list and its best checkpoint, the streamed tar of a model folder (round trip byte for
byte, memory bounded), and everything an attacker with a member token might try (unknown steps, a run without
checkpoints, a link out of the checkpoint, a store row naming another folder, too many downloads at once)."""

from __future__ import annotations

from tests.support import API
from tests.support.checkpoints import submit_run
from tests.support.waiting import scaled


def test_the_checkpoint_routes_need_a_token_and_load_no_torch(api):
    client, _, _, _ = api
    run = submit_run(client)
    for path in (f"/runs/{run}/checkpoints", f"/runs/{run}/checkpoints/1/download"):
        assert client.get(API + path, headers={"Authorization": ""}).status_code == 401
    import subprocess
    import sys

    code = (
        "import sys, collage.app.routers.checkpoints, collage.app.routers.exports, collage.app.tarstream, "
        "collage.app.store.checkpoints, collage.app.store.exports;"
        "print([m for m in ('torch', 'transformers', 'peft', 'collage.training.export') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
