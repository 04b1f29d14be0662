"""Overrides that pick a list item (`--set rewards[0].weight=2`), and errors that name the value a `--set` gave."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from collage.training.config import ConfigError, apply_overrides, load_config

from .dashboard_support import ROOT, small_config

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


def test_the_command_line_prints_the_key_and_the_value(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump(small_config("o")))
    done = subprocess.run([sys.executable, "-m", "collage.app.cli", "train", str(file), "--out", str(tmp_path / "o"),
                           "--set", "rewards[0].weight=x"], capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "collage: config error: rewards[0].weight: Input should be a valid number, unable to parse string as a "
        "number (--set gave 'x')"
    ], done.stderr


def test_clone_overrides_pick_list_items_too(api):
    client = api[0]
    run = client.post("/api/v1/runs", json=small_config("o")).json()["id"]
    clone = client.post(f"/api/v1/runs/{run}/clone", json={"overrides": {"rewards[1].weight": 3}})
    assert clone.status_code == 201, clone.text
    config = client.get(clone.json()["url"]).json()["config"]
    assert [r["weight"] for r in config["rewards"]] == [1.0, 3]
    bad = client.post(f"/api/v1/runs/{run}/clone", json={"overrides": {"rewards[5].weight": 3}})
    assert bad.status_code == 422
    assert bad.json()["detail"] == [
        {"path": "rewards[5].weight", "message": "rewards has 2 items: there is no item [5]"}
    ]
