"""The training config before any training: errors name every bad key, a resolved config loads again, and the examples
are valid configs runnable offline (the demo's evaluates held-out rows before any update)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from collage.training.config import ConfigError, parse_config
from tests.support.training import make_config

ROOT = Path(__file__).resolve().parents[2]


def test_config_errors_name_every_bad_key():
    with pytest.raises(ConfigError) as info:
        parse_config({"train": {"loss_type": "ppo", "max_steps": 0}, "modle": {}, "rewards": [{"nam": "x"}]})
    paths = [p for p, _ in info.value.errors]
    assert "train.loss_type" in paths and "train.max_steps" in paths and "modle" in paths
    assert "rewards[0].nam" in paths and "rewards[0].name" in paths
    with pytest.raises(ConfigError, match="does not apply to algorithm rloo"):
        parse_config({"algorithm": "rloo", "train": {"loss_type": "grpo"}})


def test_a_resolved_config_loads_again(tmp_path):
    from collage.training.config import dump_config, load_config

    for algorithm in ("grpo", "rloo"):
        config = make_config(algorithm=algorithm)
        (tmp_path / "c.yaml").write_text(dump_config(config))
        assert load_config(tmp_path / "c.yaml") == config


def test_examples_are_valid_configs():
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    # the README and the demo name these two: they must exist and load
    assert {p.name for p in examples} >= {"grpo-count-red.yaml", "rloo-count-red.yaml"}
    for path in examples:
        config = parse_config(yaml.safe_load(path.read_text()))
        assert config.model.path.startswith("tiny:"), path  # runnable offline
        assert path.name.startswith(config.algorithm + "-"), (path, config.algorithm)
    # the demo measures task accuracy on held-out rows, from an evaluation before any update (docs/demo.md)
    demo = parse_config(yaml.safe_load((ROOT / "examples" / "grpo-count-red.yaml").read_text()))
    assert demo.train.eval_on_start and demo.train.eval_strategy == "steps" and demo.dataset.eval_split == "eval"
    assert "accuracy" in [reward.name for reward in demo.rewards] and demo.dataset.min_images >= 1
