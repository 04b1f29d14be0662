"""The data door (issue 17) in the trainer with a tiny model: a training run refuses rows whose images lie outside
the operator's data roots, naming the rows and never the outside path."""

from __future__ import annotations

import pytest

from collage.training.config import parse_config
from tests.support.hostile_data import (
    escaping_rows,
)


def test_a_training_run_refuses_rows_with_outside_images(tmp_path, outside_images):
    from collage.training.trainer import Trainer, TrainingError

    escaping_rows(tmp_path, outside_images)
    config = parse_config(
        {
            "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
            "dataset": {"source": str(tmp_path / "data"), "bad_rows": "fail"},
            "rewards": [{"name": "accuracy"}],
            "train": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4},
            "resources": {"gpus": 0},
        }
    )
    with pytest.raises(TrainingError) as info:
        Trainer(config, tmp_path / "out", [], data_roots=[tmp_path]).setup()
    message = str(info.value)
    assert "10 of 11 rows fail `collage data check` (dataset.bad_rows: fail)" in message
    assert "row 1: image 0 is outside the folders datasets may be read from" in message
    assert str(outside_images) not in message
