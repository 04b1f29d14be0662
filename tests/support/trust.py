"""What the trust-model tests of several tiers share (docs/security.md): the allowlisted reward module, code gadgets
no allowlist may reach, a run config, folders outside the roots, and the messages a refusal is expected to carry."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.store.tables import Run

from . import API

ALLOWED = "tests.support.rewards"


GADGETS = ["alembic.config:main", "logging:basicConfig", "os:system", "subprocess:run", "builtins:exec"]


def config(**changes):
    base = {
        "name": "trust",
        "model": {"path": "tiny:qwen2-vl"},
        "dataset": {"source": "synth:count-red", "rows": 16},
        "rewards": [{"name": "accuracy"}],
        "train": {"max_steps": 2},
        "resources": {"gpus": 0},
    }
    return {**base, **changes}


def run_count(app) -> int:
    with Session(app.state.engine) as session:
        return session.execute(select(func.count()).select_from(Run)).scalar_one()


def errors_of(response) -> dict[str, str]:
    assert response.status_code == 422, response.text
    return {e["path"]: e["message"] for e in response.json()["detail"]}


@pytest.fixture
def outside_folder(tmp_path_factory):
    """A folder beside COLLAGE_HOME (outside every root) holding a dataset and a model folder."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "data.jsonl").write_text(json.dumps({"prompt": "secret row"}) + "\n")
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    return folder


def run_message(client, field: str, value: str) -> str:
    if field == "model.path":
        body = config(model={"path": value})
    elif field == "dataset.source":
        body = config(dataset={"source": value})
    else:
        body = config(rewards=[{"name": value}])
    return errors_of(client.post(API + "/runs", json=body))[field]


def route_message(client, route: str, value: str) -> str:
    if route == "preview":
        response = client.get(API + "/datasets/preview", params={"source": value})
    elif route == "check":
        response = client.post(API + "/datasets/check", json={"source": value})
    else:
        response = client.post(API + "/datasets/check", json={"source": "synth:count-red", "model": value})
    assert response.status_code == 400, response.text
    return response.json()["detail"]
