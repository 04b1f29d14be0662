"""The JSON config of docs/api.md's quick start is accepted as written, on SQLite and PostgreSQL through the
in-process app: the run is created with its name, steps and rewards, and dispatched once to the default queue."""

from __future__ import annotations

from tests.support import API
from tests.support.docs import quick_start


def test_the_documented_config_is_accepted_as_written(api):
    client, _, dispatcher, _ = api
    config, _ = quick_start()
    created = client.post(f"{API}/runs", json=config)
    assert created.status_code == 201, created.text
    run = client.get(f"{API}/runs/{created.json()['id']}").json()
    assert run["config"]["name"] == "quickstart-count-red" and run["config"]["train"]["max_steps"] == 3
    assert [r["name"] for r in run["config"]["rewards"]] == ["accuracy", "numeric", "format"]
    assert dispatcher.submitted == [(created.json()["id"], "default")]
