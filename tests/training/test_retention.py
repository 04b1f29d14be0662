"""Checkpoint retention (``train.save_total_limit``) and the best checkpoint (``metric_for_best_model``) in the
trainer with a tiny model: across two worker attempts (links to the first's checkpoints), the folders and the store
(real SQLite and PostgreSQL, through the worker's StoreCallback) end with exactly the kept checkpoints, and the best
by an evaluation metric outlives newer ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select
from sqlmodel import Session

from collage.app.store.tables import Checkpoint, Run
from collage.app.store.writer import StoreWriter
from collage.training.checkpoint import (
    STATE_FILE,
    checkpoints_up_to,
    list_checkpoints,
    read_info,
)
from collage.training.output import OutputFolder
from collage.training.retention import best_checkpoint
from collage.training.trainer import Trainer
from collage.worker.child import link_checkpoint
from collage.worker.store_callback import StoreCallback
from tests.support.training import Recorder, make_config

RETAIN = {
    "max_steps": 5, "save_steps": 1, "save_total_limit": 2, "seed": 6,
    # the learning rate decays (linear schedule): step 1 logged the highest, so the best is the oldest checkpoint
    "metric_for_best_model": "learning_rate",
}  # fmt: skip


def _store_steps(engine, run_id: str) -> list[tuple[int, int, float | None]]:
    with Session(engine) as session:
        rows = session.execute(
            select(Checkpoint.step, Checkpoint.attempt, Checkpoint.metric, Checkpoint.path)
            .where(Checkpoint.run_id == run_id)
            .order_by(Checkpoint.step)
        ).all()
    for _, _, _, path in rows:
        assert (Path(path) / STATE_FILE).is_file(), path
    return [(step, attempt, metric) for step, attempt, metric, _ in rows]


def test_retention_across_worker_attempts_in_the_folders_and_the_store(database_url, tmp_path):
    """Attempt 1 saves every step and stops after step 3; attempt 2 resumes (linking attempt 1's checkpoints, as the
    worker does) and ends at step 5. save_total_limit 2 keeps the newest two and the best (step 1, older than
    both): on disk, the other folders of both attempts are gone; in the store (through StoreCallback, as a worker
    writes it) exactly the kept checkpoints remain, each with its metric."""
    from collage.app.store.engine import engine_for

    engine = engine_for(database_url)
    artifacts = tmp_path / "artifacts"
    store = StoreWriter(engine, artifacts)
    config = make_config(train=RETAIN)
    run_id = store.create_run(config.model_dump(mode="json")).id
    assert store.transition(run_id, ["queued"], "running")
    first = artifacts / "runs" / run_id / "attempt-1"
    removed: list[int] = []

    class Removed(Recorder):
        def on_checkpoint_removed(self, step, path):
            assert not Path(path).exists()
            removed.append(step)

    rec = Removed(stop_after=3)
    Trainer(config, first, [StoreCallback(store.for_attempt(run_id, 1), run_id), OutputFolder(first), rec]).train()
    assert removed == [] and [s for s, _ in list_checkpoints(first)] == [1, 2, 3]
    assert [s for s, *_ in _store_steps(engine, run_id)] == [1, 2, 3]

    # resumed as attempt 2 (a cancel, then a resume: the store's newest checkpoint is step 3)
    assert store.transition(run_id, ["running"], "cancelled", when_attempt=1)
    assert store.transition(run_id, ["cancelled"], "queued", attempt=Run.attempt + 1)
    assert store.transition(run_id, ["queued"], "running")
    second = artifacts / "runs" / run_id / "attempt-2"
    newest = store.latest_checkpoint(run_id)
    for checkpoint in checkpoints_up_to(Path(newest)):  # worker/child.py
        link_checkpoint(second, checkpoint)
    rec2 = Removed()
    callback = StoreCallback(store.for_attempt(run_id, 2), run_id)
    result = Trainer(config, second, [callback, OutputFolder(second), rec2], resume=True).train()
    assert result.status == "succeeded" and result.step == 5
    assert sorted(removed) == [2, 3]  # step 4: 2 goes (newest 3, 4, best 1); step 5: 3 goes
    assert [s for s, _ in list_checkpoints(second)] == [1, 4, 5]
    assert (second / "checkpoints" / "step-1").is_symlink()
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-1"], "attempt 1's others are gone"

    lrs = {s: m["learning_rate"] for s, m in [*rec.metrics, *rec2.metrics]}
    assert _store_steps(engine, run_id) == [(1, 1, lrs[1]), (4, 2, lrs[4]), (5, 2, lrs[5])]
    for step in (1, 4, 5):
        info = read_info(second / "checkpoints" / f"step-{step}")
        assert info["metric"] == "learning_rate" and info["metric_value"] == pytest.approx(lrs[step])


def test_the_best_by_an_evaluation_metric_outlives_newer_checkpoints(tmp_path):
    """metric_for_best_model eval/reward, evaluated at every checkpoint: whichever checkpoint evaluated best is
    kept beside the newest, the others go; checkpoint.json holds each kept one's eval/reward."""
    train = {
        "max_steps": 4, "save_steps": 1, "save_total_limit": 1, "seed": 3, "eval_strategy": "steps", "eval_steps": 1,
        "eval_max_rows": 6, "per_device_eval_batch_size": 2, "metric_for_best_model": "eval/reward",
        "learning_rate": 5e-2,
    }  # fmt: skip
    rec = Recorder()
    Trainer(make_config(dataset={"eval_split": "test"}, train=train), tmp_path, [rec]).train()
    values = {step: m["eval/reward"] for step, m in rec.metrics}
    best = best_checkpoint(list(values.items()))
    kept = [s for s, _ in list_checkpoints(tmp_path)]
    assert kept == sorted({best, 4})
    for step in kept:
        assert read_info(tmp_path / "checkpoints" / f"step-{step}")["metric_value"] == pytest.approx(values[step])
