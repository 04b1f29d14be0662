"""The edges of bad input that need no store: every config maximum is itself accepted (a negative seed is refused,
naming the field), and only stale temp folders of the synthetic dataset cache are cleaned."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from collage.training.config import ConfigError, parse_config
from collage.training.data.synth import cached_synth_dataset, clean_stale_temp_folders
from collage.training.infra.home import cache_dir


def test_every_maximum_itself_is_accepted():
    maxima = {
        "dataset": {"rows": 10_000_000, "min_images": 64, "max_images": 64, "seed": 2**32 - 1},
        "train": {"max_steps": 10_000_000, "learning_rate": 1.0, "per_device_train_batch_size": 1024,
                  "gradient_accumulation_steps": 1024, "num_generations": 1024, "max_prompt_length": 1_000_000,
                  "max_completion_length": 131_072, "temperature": 100.0, "beta": 1000.0, "epsilon": 100.0,
                  "epsilon_high": 100.0, "num_iterations": 1024, "steps_per_generation": 1024, "seed": 2**32 - 1,
                  "save_steps": 10_000_000, "warmup_steps": 10_000_000, "weight_decay": 100.0, "max_grad_norm": 1e6},
        "model": {"lora": {"r": 4096, "alpha": 65_536}},
        "resources": {"gpus": 1024},
        "logging": {"samples_every": 10_000_000},
        "rewards": [{"name": "accuracy", "weight": 1e6}, {"name": "format", "weight": -1e6}],
    }  # fmt: skip
    parsed = parse_config(maxima)
    assert parsed.train.max_steps == 10_000_000 and parsed.dataset.rows == 10_000_000
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"seed": -1}})  # numpy cannot seed with a negative number
    assert err.value.errors == [("train.seed", "Input should be greater than or equal to 0")]


def test_stale_synth_temp_folders_are_cleaned_and_nothing_else():
    root = cache_dir("datasets")
    finished = cached_synth_dataset("count-red", rows=4, seed=91)  # a real finished dataset, written atomically
    prefix = finished.name + "."
    stale = tempfile.mkdtemp(prefix=prefix, dir=root)  # what a crash leaves behind, named as the cache names it
    os.makedirs(os.path.join(stale, "images"))
    writing = tempfile.mkdtemp(prefix=prefix, dir=root)  # an old folder whose images/ another process still fills
    os.makedirs(os.path.join(writing, "images"))
    fresh = tempfile.mkdtemp(prefix=prefix, dir=root)
    unrelated = tempfile.mkdtemp(prefix="mine.", dir=root)
    hour_ago = time.time() - 3700
    for folder in (finished, stale, os.path.join(stale, "images"), writing, unrelated):
        os.utime(folder, (hour_ago, hour_ago))
    assert clean_stale_temp_folders(max_age_seconds=3600) == 1
    assert not os.path.exists(stale)
    for kept in (finished, writing, fresh, unrelated):
        assert os.path.isdir(kept), kept
    assert (finished / "train.jsonl").is_file()
    assert clean_stale_temp_folders(max_age_seconds=0) == 2  # with no age limit, every temp folder but no other
    assert os.path.isdir(unrelated) and (finished / "train.jsonl").is_file()
    assert clean_stale_temp_folders(root=root / "missing") == 0
