"""Checkpoint retention (``train.save_total_limit``) and the best checkpoint (``metric_for_best_model``), on
checkpoint folders alone: the pure choice of what to delete (the newest kept, and the best beside them, ties to the
first), and checkpoints of earlier worker attempts (links) listed and deleted with their folders or replaced by a
resumed attempt's own."""

from __future__ import annotations

import json
import math
from pathlib import Path

from collage.training.checkpoint import (
    STATE_FILE,
    checkpoints_up_to,
    latest_checkpoint,
    list_checkpoints,
    read_info,
    remove_checkpoint,
    save_checkpoint,
)
from collage.training.retention import best_checkpoint, checkpoints_to_remove
from collage.worker.child import link_checkpoint


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


def test_equal_values_keep_the_first_checkpoint_that_reached_them():
    assert best_checkpoint([(3, 1.0), (1, 1.0), (2, 0.5)]) == 1
    assert best_checkpoint([(3, 0.0), (1, 0.0)], greater_is_better=False) == 1


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
