"""Large datasets in the trainer with a tiny model: a sample check draws the same rows as a full one and checks the
others when a batch draws them (a bad one replaced, the same on resume, or failing the run with ``bad_rows:
fail``), ``auto`` checks a small split whole and a big one by sample, and a bad held-out row fails the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from collage.training.callbacks import Callback
from collage.training.config import parse_config
from collage.training.trainer import TrainingError
from tests.support.datasets import write_parquet


class Events(Callback):
    def __init__(self, stop_after: int | None = None):
        self.events: list[tuple[str, str]] = []
        self.rows: list[tuple[int, int]] = []  # (step, dataset row) of each training rollout
        self.steps = 0
        self.stop_after = stop_after

    def on_event(self, level, message):
        self.events.append((level, message))

    def on_metrics(self, step, metrics):
        self.steps = step

    def on_samples(self, step, rows):
        self.rows.extend((step, r.row) for r in rows if r.split == "train")

    def should_stop(self):
        return self.stop_after is not None and self.steps >= self.stop_after


def _train(source: Path, out: Path, resume: bool = False, stop_after: int | None = None, train=None, **dataset):
    from collage.training.output import OutputFolder
    from collage.training.trainer import Trainer

    config = parse_config({
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": str(source), **dataset},
        "rewards": [{"name": "accuracy"}],
        "train": {"max_steps": 3, "per_device_train_batch_size": 6, "num_generations": 2, "max_completion_length": 2,
                  "save_steps": 1, **(train or {})},
        "logging": {"samples_every": 1},
        "resources": {"gpus": 0},
    })  # fmt: skip
    recorder = Events(stop_after)
    result = Trainer(config, out, [OutputFolder(out), recorder], resume=resume).train()
    return result, recorder


def _first_drawn(n: int, seed: int = 0) -> list[int]:
    """The rows the first generation batch draws from an ``n``-row split (the trainer's epoch permutation)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003)).tolist()[:3]


def test_a_sample_check_draws_what_a_full_check_draws_and_checks_the_rest_when_drawn(tmp_path, monkeypatch):
    from collage.training import trainer
    from collage.training.data.check import check_sample

    monkeypatch.setattr(trainer, "CHECK_SAMPLE_ROWS", 8)
    clean = write_parquet(tmp_path / "clean.parquet", 60, group=10)
    full, full_events = _train(clean, tmp_path / "full", check="full")
    sampled, sampled_events = _train(clean, tmp_path / "sampled", check="sample")
    assert full.status == sampled.status == "succeeded"
    assert full_events.rows == sampled_events.rows  # the same shuffle whichever check ran
    assert not [m for level, m in sampled_events.events if level == "warning"]

    # a corrupt row the sample does not cover, drawn by the first batch
    bad = next(r for r in _first_drawn(60) if r not in check_sample(60, 8, 0))
    dirty = write_parquet(tmp_path / "dirty.parquet", 60, group=10, bad=(bad,))
    result, events = _train(dirty, tmp_path / "dirty", check="sample")
    assert result.status == "succeeded"
    drawn = [row for _, row in events.rows]
    assert bad not in drawn and len(set(drawn)) >= 8
    warnings = [m for level, m in events.events if level == "warning" and "skipped when drawn" in m]
    assert len(warnings) == 1 and f"row {bad}: image 0" in warnings[0], events.events
    # the other rows of that batch are the clean run's: only the bad one was replaced
    first_clean = {row for step, row in full_events.rows if step == 1}
    first_dirty = {row for step, row in events.rows if step == 1}
    assert len(first_clean - first_dirty) == 1 and first_clean - first_dirty == {bad}

    # a resume draws the same replacement rows
    part = tmp_path / "part"
    stopped, _ = _train(dirty, part, stop_after=1, check="sample")
    resumed, resumed_events = _train(dirty, part, resume=True, check="sample")
    assert resumed.step == 3
    assert [r for r in resumed_events.rows if r[0] > 1] == [r for r in events.rows if r[0] > 1]

    # bad_rows: fail stops the run at the drawn row, naming it
    with pytest.raises(TrainingError) as failed:
        _train(dirty, tmp_path / "failed", check="sample", bad_rows="fail")
    assert f"row {bad}: image 0" in str(failed.value) and "bad_rows: fail" in str(failed.value)


def test_auto_checks_a_small_split_whole_and_a_big_one_by_sample(tmp_path, monkeypatch):
    from collage.training import trainer

    monkeypatch.setattr(trainer, "AUTO_FULL_CHECK_ROWS", 40)
    monkeypatch.setattr(trainer, "CHECK_SAMPLE_ROWS", 8)
    small = write_parquet(tmp_path / "small.parquet", 40, group=10, bad=(3,))
    result, events = _train(small, tmp_path / "small")
    assert result.status == "succeeded"
    assert any("1 of 40 rows skipped" in m for _, m in events.events), events.events
    big = write_parquet(tmp_path / "big.parquet", 41, group=10)
    result, events = _train(big, tmp_path / "big", eval_fraction=0.2)
    assert result.status == "succeeded"
    infos = " ".join(m for _, m in events.events)
    assert "rows skipped" not in infos


@pytest.mark.parametrize("check", ["full", "sample"])
def test_a_bad_held_out_row_fails_the_run_whichever_check(tmp_path, monkeypatch, check):
    from collage.training import trainer
    from collage.training.data.heldout import fraction_rows

    monkeypatch.setattr(trainer, "CHECK_SAMPLE_ROWS", 4)
    held = fraction_rows(50, 0.1, 0)
    dirty = write_parquet(tmp_path / "dirty.parquet", 50, group=10, bad=(held[1],))
    with pytest.raises(TrainingError) as failed:
        _train(dirty, tmp_path / "out", check=check, eval_fraction=0.1, train={"eval_on_start": True})
    assert "dataset.eval_fraction: held-out rows fail" in str(failed.value) and str(held[1]) in str(failed.value)
