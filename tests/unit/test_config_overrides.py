"""Overrides that pick a list item (`--set rewards[0].weight=2`), and errors that name the key, the list and the
value a `--set` gave, through ``apply_overrides`` and ``load_config``."""

from __future__ import annotations

import pytest
import yaml

from collage.training.config import ConfigError, apply_overrides, load_config
from tests.support.browser import small_config

BASE = {"name": "b", "rewards": [{"name": "accuracy", "weight": 1.0}, {"name": "format"}], "tags": ["a"]}


def test_an_index_picks_a_list_item_and_merges_into_it():
    out = apply_overrides(BASE, [("rewards[1].weight", 0.5), ("rewards[0]", {"weight": 2})])
    assert out["rewards"] == [{"name": "accuracy", "weight": 2}, {"name": "format", "weight": 0.5}]
    assert BASE["rewards"][0]["weight"] == 1.0 and "weight" not in BASE["rewards"][1]  # the input is untouched


@pytest.mark.parametrize(
    "key,message",
    [("rewards[2].weight", "rewards has 2 items: there is no item [2]"),
     ("tags[0].x", "tags[0] is not a mapping"),
     ("name[0]", "name is not a list: [0] picks an item of a list"),
     ("dataset[0]", "dataset is not a list: [0] picks an item of a list"),
     ("rewards[x].weight", "override keys are dotted paths like train.learning_rate")],
)  # fmt: skip
def test_a_bad_index_names_the_key_and_the_list(key, message):
    with pytest.raises(ConfigError) as err:
        apply_overrides(BASE, [(key, 1)])
    assert err.value.errors == [(key, message)]


def test_a_bad_value_through_an_index_is_named_with_the_value(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump(small_config("o")))
    with pytest.raises(ConfigError) as err:
        load_config(file, ["rewards[0].weight=x", "train.max_steps=-3"])
    errors = dict(err.value.errors)
    assert set(errors) == {"rewards[0].weight", "train.max_steps"}, errors  # never "rewards[0]: unknown key"
    assert "valid number" in errors["rewards[0].weight"] and "(--set gave 'x')" in errors["rewards[0].weight"]
    assert errors["train.max_steps"].endswith("(--set gave -3)")
    assert load_config(file, ["rewards[1].weight=0.25"]).rewards[1].weight == 0.25
