"""The run config's one override rule and one error wording, shared by `collage train/submit --set`, the API's
clone and the launch form."""

from __future__ import annotations

import pytest
import yaml

from collage.training.config import ConfigError, apply_overrides, load_config, parse_config, parse_override

BASE = {
    "name": "base",
    "model": {"path": "tiny:qwen2-vl", "lora": None},
    "train": {"max_steps": 5, "learning_rate": 1e-5, "num_generations": 4},
    "tags": ["a"],
}


def test_parse_override_reads_yaml_values():
    assert parse_override("train.max_steps=3") == ("train.max_steps", 3)
    assert parse_override(" train.learning_rate = 1e-4") == ("train.learning_rate", 1e-4)
    assert parse_override("tags=[x, y]") == ("tags", ["x", "y"])
    assert parse_override("model.lora={r: 4}") == ("model.lora", {"r": 4})
    assert parse_override("name=") == ("name", "")
    with pytest.raises(ConfigError) as err:
        parse_override("train.max_steps")
    assert err.value.errors[0][1] == "override must look like key.path=value"
    with pytest.raises(ConfigError) as err:
        parse_override("tags=[unclosed")
    assert err.value.errors[0][0] == "tags" and "not valid YAML" in err.value.errors[0][1]


def test_mappings_merge_everything_else_replaces_and_the_input_is_untouched():
    out = apply_overrides(
        BASE,
        [
            ("train", {"max_steps": 9}),  # merged: learning_rate and num_generations stay
            ("model.lora", {"r": 4}),  # null mapping on the way: created
            ("dataset.rows", 16),  # missing mapping: created
            ("tags", ["b"]),  # a list replaces
        ],
    )
    assert out["train"] == {"max_steps": 9, "learning_rate": 1e-5, "num_generations": 4}
    assert out["model"] == {"path": "tiny:qwen2-vl", "lora": {"r": 4}}
    assert out["dataset"] == {"rows": 16} and out["tags"] == ["b"]
    assert BASE["train"]["max_steps"] == 5 and BASE["model"]["lora"] is None and "dataset" not in BASE


@pytest.mark.parametrize(
    "key,message",
    [("train.max_steps.x", "train.max_steps is not a mapping"), ("tags.first", "tags is not a mapping"),
     ("train..x", "override keys are dotted paths like train.learning_rate")],
)  # fmt: skip
def test_a_path_through_a_value_names_the_key(key, message):
    with pytest.raises(ConfigError) as err:
        apply_overrides(BASE, [(key, 1)])
    assert err.value.errors == [(key, message)]


def test_cli_overrides_load_the_same_config_as_nested_keys(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump({**BASE, "train": {**BASE["train"], "max_steps": 2}}))
    config = load_config(file, ["train={learning_rate: 0.001}", "model.lora.r=4", "train.num_generations=2"])
    assert config.train.max_steps == 2 and config.train.learning_rate == 0.001 and config.train.num_generations == 2
    assert config.model.lora is not None and config.model.lora.r == 4 and config.model.lora.alpha == 16


def test_config_errors_name_their_paths_once_each():
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"loss_type": "ppo", "epsilon": -1, "bogus": 1}, "rewards": [{"name": "x", "w": 1}]})
    errors = dict(err.value.errors)
    assert errors["train.loss_type"].startswith("must be one of 'grpo'")
    assert errors["train.epsilon"] == "Input should be greater than 0"
    assert errors["train.bogus"] == "unknown key" and errors["rewards[0].w"] == "unknown key"
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"per_device_train_batch_size": 3, "num_generations": 2}})
    (path, message), = err.value.errors  # fmt: skip
    assert path == "train" and "multiple of num_generations" in message


def test_generation_backend_is_hf_and_nothing_pretends_otherwise():
    from collage.training.generation import BACKENDS, generate

    assert parse_config({}).train.generation_backend == "hf" and set(BACKENDS) == {"hf"} and BACKENDS["hf"] is generate
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"generation_backend": "vllm"}})
    assert err.value.errors == [("train.generation_backend", "must be one of 'hf'")]
