"""The trust check of the held-out dataset keys (docs/training.md, Evaluation), on SQLite and PostgreSQL through the
in-process app: an ``eval_source`` outside the data roots and an ``eval_split`` that is a path are refused at submit
and by the worker's check, as ``dataset.source`` is."""

from __future__ import annotations

import json

from collage.app.settings import Settings
from collage.app.trust import config_violations
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
