"""The checkpoint routes, on SQLite and PostgreSQL: they need a token, and a fresh interpreter that imports them (and
the export routes, the tar stream and their stores) loads no torch, transformers or peft."""

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
