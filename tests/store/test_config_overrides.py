"""Overrides that pick a list item in the API's clone (``rewards[1].weight``), on SQLite and PostgreSQL through the
in-process app: the clone's config has the new weight, and an index past the list is a 422 naming it."""

from __future__ import annotations

from tests.support.browser import small_config


def test_clone_overrides_pick_list_items_too(api):
    client = api[0]
    run = client.post("/api/v1/runs", json=small_config("o")).json()["id"]
    clone = client.post(f"/api/v1/runs/{run}/clone", json={"overrides": {"rewards[1].weight": 3}})
    assert clone.status_code == 201, clone.text
    config = client.get(clone.json()["url"]).json()["config"]
    assert [r["weight"] for r in config["rewards"]] == [1.0, 3]
    bad = client.post(f"/api/v1/runs/{run}/clone", json={"overrides": {"rewards[5].weight": 3}})
    assert bad.status_code == 422
    assert bad.json()["detail"] == [
        {"path": "rewards[5].weight", "message": "rewards has 2 items: there is no item [5]"}
    ]
