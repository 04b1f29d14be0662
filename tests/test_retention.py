"""Checkpoint retention (``train.save_total_limit``) and the best checkpoint (``metric_for_best_model``): the pure
choice of what to delete, checkpoints of earlier worker attempts (links) counted and deleted with their folders,
and the store (real SQLite and PostgreSQL, through the worker's StoreCallback) ending with exactly the kept rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlmodel import Session

from collage.app.models import Checkpoint, Run
from collage.app.store.writer import StoreWriter
from collage.training.checkpoint import (
    STATE_FILE,
    checkpoints_up_to,
    latest_checkpoint,
    list_checkpoints,
    read_info,
    remove_checkpoint,
    save_checkpoint,
)
from collage.training.output import OutputFolder
from collage.training.retention import best_checkpoint, checkpoints_to_remove
from collage.training.trainer import Trainer
from collage.worker.child import link_checkpoint
from collage.worker.store_callback import StoreCallback

from .test_training import Recorder, make_config

# ----------------------------------------------------------------------------------- what is deleted


def test_the_newest_limit_are_kept():
    five = [(s, None) for s in (10, 20, 30, 40, 50)]
    assert checkpoints_to_remove(five, 2) == [10, 20, 30]
    assert checkpoints_to_remove(five, 5) == [] and checkpoints_to_remove(five, 9) == []
    assert checkpoints_to_remove(five, None) == []  # no limit: nothing goes
    assert checkpoints_to_remove(list(reversed(five)), 1) == [10, 20, 30, 40]  # order of the listing is irrelevant
    assert checkpoints_to_remove([], 1) == []


def test_the_best_is_kept_beside_the_newest():
    values = [(1, 0.2), (2, 0.9), (3, 0.1), (4, 0.3), (5, 0.4)]
    assert best_checkpoint(values) == 2
    assert checkpoints_to_remove(values, 2) == [1, 3]  # newest 4, 5 and the best 2
    assert checkpoints_to_remove(values, 1) == [1, 3, 4]
    assert best_checkpoint(values, greater_is_better=False) == 3
    assert checkpoints_to_remove(values, 2, greater_is_better=False) == [1, 2]
    # the newest being the best: nothing beyond the limit is kept
    assert checkpoints_to_remove([(1, 0.1), (2, 0.2), (3, 0.3)], 1) == [1, 2]


def test_checkpoints_without_a_metric_are_never_the_best():
    values = [(1, None), (2, math.nan), (3, 0.5), (4, None), (5, None)]
    assert best_checkpoint(values) == 3
    assert checkpoints_to_remove(values, 1) == [1, 2, 4]
    assert best_checkpoint([(1, None), (2, math.nan)]) is None
    assert checkpoints_to_remove([(1, None), (2, None), (3, None)], 1) == [1, 2]


def test_the_choice_is_torch_free_for_the_api():
    """The API marks a run's best checkpoint with the trainer's own rule, on the torch-free web node."""
    code = "import sys, collage.training.retention; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_equal_values_keep_the_first_checkpoint_that_reached_them():
    assert best_checkpoint([(3, 1.0), (1, 1.0), (2, 0.5)]) == 1
    assert best_checkpoint([(3, 0.0), (1, 0.0)], greater_is_better=False) == 1


# ------------------------------------------------------------------------- folders, links, attempts


def _fake_checkpoint(out: Path, step: int, metric: float | None = None) -> Path:
    folder = out / "checkpoints" / f"step-{step}"
    (folder / "model").mkdir(parents=True)
    (folder / STATE_FILE).write_bytes(b"state")
    info = {"step": step, "kind": "full", "bytes": 1, "metric": "m" if metric is not None else None,
            "metric_value": metric}  # fmt: skip
    (folder / "checkpoint.json").write_text(json.dumps(info))
    return folder


def test_links_to_an_earlier_attempt_are_listed_and_deleted_with_their_folders(tmp_path):
    first, second = tmp_path / "attempt-1", tmp_path / "attempt-2"
    for step in (1, 2, 3):
        _fake_checkpoint(first, step)
    (first / "checkpoints" / "step-4.tmp").mkdir()  # a save a crash interrupted: not a checkpoint
    (first / "checkpoints" / "step-5").mkdir()  # a folder without its trainer state: not a checkpoint
    newest = first / "checkpoints" / "step-3"
    assert [p.name for p in checkpoints_up_to(newest)] == ["step-1", "step-2", "step-3"]
    for checkpoint in checkpoints_up_to(newest):  # what the worker does for a resumed attempt
        link_checkpoint(second, checkpoint)
    _fake_checkpoint(second, 4)
    listed = list_checkpoints(second)
    assert [s for s, _ in listed] == [1, 2, 3, 4] and latest_checkpoint(second) == second / "checkpoints" / "step-4"
    assert all((second / "checkpoints" / f"step-{s}").is_symlink() for s in (1, 2, 3))
    # a third attempt sees the first attempt's checkpoints through the second's links, as real folders
    assert checkpoints_up_to(second / "checkpoints" / "step-4")[:3] == [
        first / "checkpoints" / f"step-{s}" for s in (1, 2, 3)
    ]

    removed = remove_checkpoint(second / "checkpoints" / "step-2")
    assert removed == (first / "checkpoints" / "step-2").resolve()
    assert not (second / "checkpoints" / "step-2").exists() and not (second / "checkpoints" / "step-2").is_symlink()
    assert not (first / "checkpoints" / "step-2").exists(), "the earlier attempt's folder goes with the link"
    assert remove_checkpoint(second / "checkpoints" / "step-4") == second / "checkpoints" / "step-4"
    assert [s for s, _ in list_checkpoints(second)] == [1, 3]
    # a link whose folder is gone is no checkpoint
    import shutil

    shutil.rmtree(first / "checkpoints" / "step-3")
    assert [s for s, _ in list_checkpoints(second)] == [1]


class _Saves:
    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "weights.bin").write_bytes(b"w")


def test_a_resumed_attempt_rewriting_the_step_it_resumed_from_replaces_the_link(tmp_path):
    """Saving over a linked checkpoint (an attempt that resumed from step N and saves step N again) writes its own
    folder and leaves the earlier attempt's folder as it was."""
    first, second = tmp_path / "attempt-1", tmp_path / "attempt-2"
    old = _fake_checkpoint(first, 2)
    link_checkpoint(second, old)
    folder, _ = save_checkpoint(second, 2, _Saves(), _Saves(), {"step": 2}, [{}], metric=("m", math.nan))
    assert folder == second / "checkpoints" / "step-2" and not folder.is_symlink()
    assert read_info(folder)["metric_value"] is None  # NaN is no value (and no valid JSON)
    assert (old / STATE_FILE).read_bytes() == b"state"


# ------------------------------------------------------------------------------------ end to end


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
    from collage.app.db import engine_for

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
