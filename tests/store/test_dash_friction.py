"""The rollouts' count route (issue 17, items 18-21), on SQLite and PostgreSQL through the in-process app: it matches
every filter of the rollouts table, stops at its cap, and names a bad filter (422) or an unknown run (404)."""

from __future__ import annotations

from collage.app.store import queries
from tests.support import API
from tests.support.rollouts import all_pages, fill_rollouts, rollout_config


def test_the_count_matches_every_filter_and_stops_at_its_cap(api):
    client, _, _, app = api
    run = client.post(f"{API}/runs", json=rollout_config()).json()["id"]
    fill_rollouts(app, run)  # 3 steps x 4 groups x 4 completions
    for params in ({}, {"step": 2}, {"advantage": "pos"}, {"reward_name": "accuracy", "min_reward": 0.5},
                   {"q": "g2"}, {"dataset_row": 11, "max_step": 2}, {"min_reward": 5}):  # fmt: skip
        answer = client.get(f"{API}/runs/{run}/samples/count", params=params)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"count": len(all_pages(client, run, **params)), "capped": False,
                                 "cap": queries.COUNT_CAP}, params  # fmt: skip
    from sqlmodel import Session

    with Session(app.state.engine) as session:
        assert queries.count_samples(session, run, queries.SampleFilters(), cap=10) == (10, True)
        assert queries.count_samples(session, run, queries.SampleFilters(), cap=48) == (48, False)
    bad = client.get(f"{API}/runs/{run}/samples/count", params={"reward_name": "nope"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["path"] == "query.reward_name"
    assert client.get(f"{API}/runs/nosuch/samples/count").status_code == 404
