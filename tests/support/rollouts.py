"""Rollout rows for the rollout-table and page tests of several tiers: a run config, rows with two reward functions
(some unscorable), dataset columns and images written as a trainer writes them, every page of the samples route,
and whole finished runs written into a `collage serve`'s store without training (for pages that only show them)."""

from __future__ import annotations

import random

from collage.app.store.writer import ImageIn, SampleIn
from collage.training.callbacks import COLUMN_TEXT_MAX

from . import API
from .api import png
from .browser import small_config
from .serve import store_writer

LONG = "x" * (COLUMN_TEXT_MAX + 50)


def rollout_config(**changes):
    """A 5-step run of the small dashboard config; ``changes`` replace its keys."""
    base = small_config("rollouts-api")
    base["train"]["max_steps"] = 5
    base.update(changes)
    return base


def fill_rollouts(app, run_id, steps=3, groups=4, gens=4, seed=3):
    """Rows with rewards for `accuracy` and `numeric` (some unscorable), dataset columns and images."""
    rng = random.Random(seed)
    expected = []
    for step in range(1, steps + 1):
        rows = []
        for g in range(groups):
            for i in range(gens):
                acc = None if (g == 1 and i == 0) else rng.choice([0.0, 0.25, 0.5, 1.0])
                num = None if (g == 2 and i == 1) else round(rng.uniform(-1, 1), 3)
                total = None if acc is None and num is None else (acc or 0.0) + 0.5 * (num or 0.0)
                columns = {"answer": str(g), "task": "count-red", "difficulty": g * 0.5, "hard": g > 1}
                if g == 3:
                    columns["note"] = LONG
                rows.append(
                    SampleIn(group=g, index=i, prompt=[{"role": "user", "content": [{"type": "image"},
                             {"type": "text", "text": f"how many? {g}"}]}], completion=f"s{step} g{g} c{i}",
                             images=[ImageIn(png((40 * g, 0, 40 * i), (20, 20)))], rewards={"accuracy": acc, "numeric": num},
                             reward=total, advantage=rng.uniform(-1, 1), completion_length=3 + i, truncated=False,
                             group_mean=0.5, group_std=0.1, dataset_row=10 + g, columns=columns)
                )  # fmt: skip
                expected.append({"step": step, "group": g, "index": i, "accuracy": acc, "numeric": num,
                                 "reward": total, "dataset_row": 10 + g})  # fmt: skip
        app.state.writer.append_samples(run_id, step, rows)
    return expected


def all_pages(client, run, **params):
    """Every row of the samples route for ``params``, following its cursors to the end."""
    items, cursor = [], None
    while True:
        answer = client.get(f"{API}/runs/{run}/samples", params={**params, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        items += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            return items


WORDS = "the first image shows a red square and the second one a blue circle so the count is "


def seed_run(server, name: str, completion: str, config_changes: dict | None = None, images: int = 5,
          rewards=("accuracy", "numeric", "format")) -> str:  # fmt: skip
    """A finished run written into the server's store as a worker writes one, without training: 2 steps of metrics
    and of 2 groups x 3 completions of long text, `images` images per prompt, a long dataset column, one reward
    column per function."""
    from collage.training.config import parse_config

    engine, writer = store_writer(server)
    config = small_config(name)
    config["rewards"] = [{"name": r} for r in rewards]
    config.update(config_changes or {})
    run = writer.create_run(parse_config(config).model_dump(mode="json"))
    writer.transition(run.id, ["queued"], "running")
    for step in (1, 2):
        rows = []
        for g in range(2):
            for i in range(3):
                pictures = [ImageIn(png((50 * k, 200 - 30 * k, 60 * g), (48 + 8 * k, 40))) for k in range(images)]
                content = [{"type": "image"} for _ in pictures] + [
                    {"type": "text", "text": f"Count the images that show a red shape (prompt {g})."}
                ]
                rows.append(SampleIn(group=g, index=i, prompt=[{"role": "user", "content": content}],
                                     completion=f"{completion} {step}.{g}.{i} " + WORDS * (2 + i), images=pictures,
                                     rewards={r: 0.25 * i for r in rewards}, reward=0.5 * i, advantage=-1.25 + i,
                                     completion_length=100 + i, truncated=i == 2, group_mean=0.4, group_std=0.3,
                                     dataset_row=5 + g, columns={"answer": str(3 + g), "task": "count-red",
                                                                 "why": "images 1, 3 and 4 show red shapes " * 4}))  # fmt: skip
        writer.append_samples(run.id, step, rows)
        writer.append_metrics(run.id, step, {"reward": 0.5 * step, "loss": 1.0 / step, "kl": 0.01 * step})
        writer.set_progress(run.id, step)
    writer.transition(run.id, ["running"], "succeeded")
    engine.dispose()
    return run.id
