"""Held-out evaluation end to end: a run with evaluation submitted to `collage serve` (its real worker, store and
training process) shows its eval metrics, its eval rollouts in the rollouts table's Evaluation split, the latest and
best eval reward in the runs list, and checkpoints that carry the metric, with the best one marked."""

from __future__ import annotations

import math

from tests.support.browser import login, shoot, small_config, wait_done, wait_rows


def test_a_run_with_evaluation_end_to_end(browser, server):
    client = server["client"]
    config = small_config("eval-e2e", max_steps=4, eval_strategy="steps", eval_steps=2, eval_on_start=True,
                          eval_max_rows=6, save_steps=2, save_total_limit=1, metric_for_best_model="eval/reward")  # fmt: skip
    config["dataset"]["eval_split"] = "test"
    created = client.post("/runs", json=config)
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    run = wait_done(client, run_id, timeout=600)
    assert run["status"] == "succeeded", run

    metrics = client.get(f"/runs/{run_id}/metrics", params={"keys": "eval/reward,eval/rows,reward"}).json()
    assert [step for step, _ in metrics["eval/reward"]] == [0, 2, 4]  # on start, every 2 steps, at the end
    assert all(value == 6 for _, value in metrics["eval/rows"])
    assert [step for step, _ in metrics["reward"]] == [1, 2, 3, 4]

    eval_rows = client.get(f"/runs/{run_id}/samples", params={"split": "eval", "limit": 500}).json()["items"]
    assert {r["split"] for r in eval_rows} == {"eval"} and {r["step"] for r in eval_rows} == {0, 2, 4}
    assert len(eval_rows) == 3 * 6  # one greedy completion per held-out prompt, per evaluation
    for step, value in metrics["eval/reward"]:  # the metric is the mean of its stored rollouts
        rewards = [r["reward"] for r in eval_rows if r["step"] == step and r["reward"] is not None]
        assert math.isclose(value, sum(rewards) / len(rewards), abs_tol=1e-6)
    train_rows = client.get(f"/runs/{run_id}/samples", params={"limit": 500}).json()["items"]
    assert train_rows and {r["split"] for r in train_rows} == {"train"}

    listed = next(r for r in client.get("/runs").json()["items"] if r["id"] == run_id)
    assert listed["eval_reward"] == metrics["eval/reward"][-1][1]
    assert listed["best_eval_reward"] == max(v for _, v in metrics["eval/reward"])

    checkpoints = client.get(f"/runs/{run_id}/checkpoints").json()["items"]
    steps = [c["step"] for c in checkpoints]
    assert 4 in steps and len(steps) <= 2  # the newest, and an older best if it is not the newest
    by_step = dict(metrics["eval/reward"])
    assert all(c["metric"] == by_step[c["step"]] for c in checkpoints)
    assert sum(c["best"] for c in checkpoints) == 1

    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/runs/{run_id}/rollouts?split=eval")
        wait_rows(page, len(eval_rows))
        splits = page.evaluate("[...document.querySelectorAll('tr.sample')].map(r => r.dataset.split)")
        assert splits and set(splits) == {"eval"}
        assert page.inner_text("tr.sample .evaluated-at >> nth=0").startswith("evaluated at step")
        shoot(page, "eval-e2e-rollouts", full_page=False)
        assert not page.errors, page.errors
    finally:
        context.close()
