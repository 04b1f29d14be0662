"""The trust model (docs/security.md): API clients choose neither the code a worker runs nor the files it reads.

Through the real app (SQLite and PostgreSQL) and the real dataset helper process: paths inside the roots are
accepted, operator roots replace the default, and relative names are Hub ids, never files on the server. The api
fixture allowlists tests.support.rewards and its COLLAGE_HOME (the default root) is the test's tmp_path.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tests.support.trust import (
    config,
    route_message,
    run_message,
)

API = "/api/v1"


def test_inside_paths_are_accepted(api, tmp_path):
    client, _, dispatcher, _ = api
    models = tmp_path / "models"  # COLLAGE_HOME/models: a default model root
    (models / "sub").mkdir(parents=True)
    (models / "model").mkdir()
    (models / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    body = config(
        model={"path": f"{models}/sub/../model"},
        dataset={"source": str(tmp_path / "data.jsonl")},
        rewards=[{"name": str(models / "model")}],
    )
    response = client.post(API + "/runs", json=body)
    assert response.status_code == 201, response.text
    assert len(dispatcher.submitted) == 1
    preview = client.get(API + "/datasets/preview", params={"source": str(tmp_path / "data.jsonl")})
    assert preview.status_code == 200 and "hello" in preview.text
    check = client.post(API + "/datasets/check", json={"source": str(tmp_path / "data.jsonl")})
    assert check.status_code == 200 and check.json()["rows"] == 1
    # inside the roots, existence may be told
    missing = run_message(client, "dataset.source", str(tmp_path / "gone.jsonl"))
    assert missing == f"{tmp_path / 'gone.jsonl'} does not exist"


def test_operator_roots_replace_the_default(api, tmp_path, outside_folder):
    client, _, _, app = api
    app.state.settings = dataclasses.replace(app.state.settings, data_roots=(outside_folder,))
    preview = client.get(API + "/datasets/preview", params={"source": str(outside_folder / "data.jsonl")})
    assert preview.status_code == 200 and "secret row" in preview.text
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    home = client.get(API + "/datasets/preview", params={"source": str(tmp_path / "data.jsonl")})
    assert home.status_code == 400 and str(outside_folder) in home.json()["detail"]  # the roots are told, not the path


def test_relative_names_are_hub_ids_never_files_on_the_server(api, tmp_path, monkeypatch):
    client, _, _, _ = api
    cwd = tmp_path / "cwd"
    (cwd / "org").mkdir(parents=True)
    (cwd / "org" / "data.jsonl").write_text(json.dumps({"prompt": "server file"}) + "\n")
    monkeypatch.chdir(cwd)
    assert os.path.exists("org/data.jsonl")
    response = client.get(API + "/datasets/preview", params={"source": "org/data.jsonl"})
    assert response.status_code == 400 and "server file" not in response.text
    for value in ["./org/data.jsonl", "org/../org/data.jsonl", "../cwd/org/data.jsonl"]:
        assert "never read from the server" in run_message(client, "dataset.source", value)
        assert "never read from the server" in route_message(client, "preview", value)
