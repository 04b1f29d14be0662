"""The trust check of the held-out dataset keys (docs/training.md, Evaluation), on SQLite and PostgreSQL through the
in-process app: an ``eval_source`` outside the data roots and an ``eval_split`` that is a path are refused at submit
and by the worker's check, as ``dataset.source`` is."""

from __future__ import annotations

import json

from collage.app.core.settings import Settings
from collage.app.core.trust import config_violations
from collage.training.config import parse_config


def test_held_out_data_from_an_api_client_is_confined_like_the_training_data(api, tmp_path_factory):
    """eval_source is a dataset a worker reads: outside COLLAGE_DATA_ROOTS it is refused at submit (and by the
    worker's check), as dataset.source is; eval_split is a split name, never a path."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "data.jsonl").write_text(json.dumps({"prompt": "secret row"}) + "\n")
    client = api[0]
    body = {
        "name": "sneaky", "model": {"path": "tiny:qwen2-vl"}, "rewards": [{"name": "accuracy"}],
        "dataset": {"source": "synth:count-red", "eval_source": str(outside / "data.jsonl"), "eval_split": "../x"},
        "train": {"max_steps": 2, "eval_on_start": True}, "resources": {"gpus": 0},
    }  # fmt: skip
    response = client.post("/api/v1/runs", json=body)
    assert response.status_code == 422, response.text
    paths = {e["path"] for e in response.json()["detail"]}
    assert {"dataset.eval_source", "dataset.eval_split"} <= paths
    home = tmp_path_factory.mktemp("home")
    settings = Settings(home=home, database_url="sqlite://", broker_url="memory://", artifacts=home / "a")
    worker_check = [path for path, _ in config_violations(parse_config(body), settings)]
    assert worker_check == ["dataset.eval_source", "dataset.eval_split"]  # the worker child's check, before training
    body["dataset"] = {"source": "synth:count-red", "eval_split": "test"}
    assert client.post("/api/v1/runs", json=body).status_code == 201


def test_a_held_out_split_that_names_no_file_is_refused_at_submit(api, tmp_path):
    """`dataset.eval_split: validation` on a folder of train.jsonl and test.jsonl is refused at submit with its field
    and the files there are, as a wrong `dataset.split` is, instead of failing the run on the worker; the same for
    a `save_to_disk` folder's dataset_dict.json and a separate eval_source folder. (Accepted configs are checked
    with the same function, without a submit: a submit of a local dataset reads its rows in the dataset helper, a
    process, tests/processes/.)"""
    from collage.app.validation import semantic_errors

    client, _, _, app = api
    folder = tmp_path / "qa"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps({"prompt": f"a {split} row", "answer": "1"}) + "\n")
    body = {
        "name": "held-out", "model": {"path": "tiny:qwen2-vl"}, "rewards": [{"name": "accuracy"}],
        "dataset": {"source": str(folder), "eval_split": "validation", "min_images": 0, "max_images": 0},
        "train": {"max_steps": 2, "eval_on_start": True}, "resources": {"gpus": 0},
    }  # fmt: skip

    def errors() -> list[tuple[str, str]]:
        return semantic_errors(parse_config(body), app.state.settings)

    refused = client.post("/api/v1/runs", json=body)
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["detail"]
    assert error["path"] == "dataset.eval_split"
    assert "validation" in error["message"] and "test.jsonl, train.jsonl" in error["message"]
    body["dataset"]["split"] = "training"
    paths = [e["path"] for e in client.post("/api/v1/runs", json=body).json()["detail"]]
    assert paths == ["dataset.split", "dataset.eval_split"]
    body["dataset"].update(split="train", eval_split="test")
    assert errors() == []

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    body["dataset"] = {**body["dataset"], "source": str(saved), "eval_split": "validation"}
    refused = client.post("/api/v1/runs", json=body).json()["detail"]
    assert [(e["path"], "splits: train, test" in e["message"]) for e in refused] == [("dataset.eval_split", True)]
    body["dataset"]["eval_split"] = "test[:50]"  # a slice of a split that exists
    assert errors() == []

    other = tmp_path / "other"
    other.mkdir()
    for split in ("validation", "dev"):  # two files: a folder of one file reads it for any split
        (other / f"{split}.jsonl").write_text(json.dumps({"prompt": "held out", "answer": "1"}) + "\n")
    body["dataset"] = {**body["dataset"], "source": str(folder), "eval_source": str(other), "eval_split": "validation"}
    assert errors() == []  # read from eval_source, where it is
    body["dataset"]["eval_split"] = "test"
    refused = client.post("/api/v1/runs", json=body).json()["detail"]
    assert [e["path"] for e in refused] == ["dataset.eval_split"]  # test.jsonl is in source, not in eval_source
