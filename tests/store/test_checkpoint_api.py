"""A run's best checkpoint over the REST API, on SQLite and PostgreSQL through the in-process app: it follows the
run's ``metric_for_best_model`` and ``greater_is_better`` (ties keep the earlier step, steps without a value are
skipped, no metric means no best)."""

from __future__ import annotations

import pytest

from tests.support import API
from tests.support.checkpoints import submit_run


@pytest.mark.parametrize(
    "train,metrics,best",
    [
        ({"metric_for_best_model": "reward"}, {1: 0.5, 2: 0.5, 3: 0.25}, 1),  # ties keep the earlier step (TRL)
        ({"metric_for_best_model": "reward"}, {1: None, 2: 0.1, 3: 0.3}, 3),  # a step without a value is skipped
        ({"metric_for_best_model": "loss"}, {1: 0.9, 2: 0.2, 3: 0.4}, 2),  # "...loss": smaller is better
        ({"metric_for_best_model": "reward", "greater_is_better": False}, {1: 0.9, 2: 0.2, 3: 0.4}, 2),
        ({"metric_for_best_model": "loss", "greater_is_better": True}, {1: 0.9, 2: 0.2, 3: 0.4}, 1),
        ({}, {1: 0.9, 2: 0.2, 3: 0.4}, None),  # no metric_for_best_model: no best checkpoint
        ({"metric_for_best_model": "reward"}, {1: None, 2: None, 3: None}, None),
    ],
)
def test_the_best_checkpoint_follows_the_runs_metric_and_greater_is_better(api, train, metrics, best):
    client, _, _, app = api
    run = submit_run(client, **train, max_steps=3)
    for step, value in metrics.items():
        app.state.writer.add_checkpoint(run, step, f"/nowhere/step-{step}", kind="full", size=1, metric=value)
    items = client.get(f"{API}/runs/{run}/checkpoints").json()["items"]
    assert [i["step"] for i in items if i["best"]] == ([best] if best else [])
