"""The dashboard's look: dark scheme and its toggle, 390 px screens, visible keyboard focus, the API docs offline,
the documented curl quick-start run as written, and `collage submit` printing the run's dashboard page.

One run for the whole module: the JSON config of docs/api.md's quick start, submitted by its curl commands.
"""

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
