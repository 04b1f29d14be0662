"""The trust model (docs/security.md): API clients choose neither the code a worker runs nor the files it reads.

Through the real app (SQLite and PostgreSQL) and the real resolver; the api fixture allowlists
tests.rewards_for_tests and its COLLAGE_HOME (the default root) is the test's tmp_path.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from collage.app.models import Run
from collage.app.settings import Settings
from collage.app.trust import config_violations
from collage.training.config import parse_config
from collage.training.rewards.registry import UnknownRewardError, resolve_reward

API = "/api/v1"
ALLOWED = "tests.rewards_for_tests"
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


def _runs(app) -> int:
    with Session(app.state.engine) as session:
        return session.execute(select(func.count()).select_from(Run)).scalar_one()


def _errors(response) -> dict[str, str]:
    assert response.status_code == 422, response.text
    return {e["path"]: e["message"] for e in response.json()["detail"]}


@pytest.fixture
def outside(tmp_path_factory):
    """A folder beside COLLAGE_HOME (outside every root) holding a dataset and a model folder."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "data.jsonl").write_text(json.dumps({"prompt": "secret row"}) + "\n")
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    return folder


# ------------------------------------------------------------------------------------------------ code


@pytest.mark.parametrize("gadget", GADGETS)
def test_gadget_rewards_are_refused_at_submit_whatever_the_allowlist(api, gadget):
    client, _, dispatcher, app = api
    module = gadget.partition(":")[0]
    for allowlist in [(ALLOWED,), (ALLOWED, module, module.split(".")[0])]:  # even when the operator lists it
        app.state.settings = dataclasses.replace(app.state.settings, reward_modules=allowlist)
        body = config(rewards=[{"name": "accuracy"}, {"name": gadget, "args": {"filename": "/tmp/x", "filemode": "w"}}])
        errors = _errors(client.post(API + "/runs", json=body))
        assert set(errors) == {"rewards[1].name"}
    assert _runs(app) == 0 and dispatcher.submitted == []


def test_an_unlisted_module_is_refused_saying_how_the_operator_allows_it(api):
    client, _, dispatcher, app = api
    errors = _errors(client.post(API + "/runs", json=config(rewards=[{"name": "tests.test_trust:config"}])))
    assert "COLLAGE_REWARD_MODULES" in errors["rewards[0].name"]
    private = _errors(client.post(API + "/runs", json=config(rewards=[{"name": f"{ALLOWED}:_private_helper"}])))
    assert "private" in private["rewards[0].name"]
    assert _runs(app) == 0 and dispatcher.submitted == []


def test_an_allowlisted_function_is_accepted(api):
    client, _, dispatcher, app = api
    response = client.post(API + "/runs", json=config(rewards=[{"name": f"{ALLOWED}:starts_with_digit"}]))
    assert response.status_code == 201, response.text
    assert [run_id for run_id, _ in dispatcher.submitted] == [response.json()["id"]]
    app.state.settings = dataclasses.replace(app.state.settings, reward_modules=("tests",))  # submodules too
    assert client.post(API + "/runs", json=config(rewards=[{"name": f"{ALLOWED}:sleepy"}])).status_code == 201


@pytest.mark.parametrize("gadget", GADGETS)
def test_resolve_reward_refuses_gadgets_even_when_their_module_is_allowlisted(gadget):
    module = gadget.partition(":")[0]
    with pytest.raises(UnknownRewardError, match="never provides rewards"):
        resolve_reward(gadget, reward_modules=[ALLOWED, module, module.split(".")[0]])
    with pytest.raises(UnknownRewardError):
        resolve_reward(gadget, reward_modules=[ALLOWED])


@pytest.mark.parametrize(
    "attr,problem",
    [
        ("system", "not a function"),  # from os import system
        ("run_command", "defined in 'subprocess'"),  # from subprocess import run as run_command
        ("NotAReward", "not a function"),
        ("_private_helper", "private"),
        ("completion_text", "defined in 'collage.training.rewards.builtins'"),
    ],
)
def test_an_allowlisted_module_reaches_only_its_own_functions(attr, problem):
    with pytest.raises(UnknownRewardError, match=problem):
        resolve_reward(f"{ALLOWED}:{attr}", reward_modules=[ALLOWED])
    if not attr.startswith("_"):  # trusted (local collage train): any callable, as before
        assert resolve_reward(f"{ALLOWED}:{attr}").name == attr


def test_allowlisted_sync_and_async_functions_resolve():
    sync = resolve_reward(f"{ALLOWED}:starts_with_digit", reward_modules=[ALLOWED])
    async_ = resolve_reward(f"{ALLOWED}:slow_async_a", reward_modules=["tests"])
    assert sync.fn.__name__ == "starts_with_digit" and not sync.is_async and async_.is_async
    with pytest.raises(UnknownRewardError, match="not allowlisted"):
        resolve_reward(f"{ALLOWED}:starts_with_digit", reward_modules=[])  # nothing allowlisted: nothing runs
    with pytest.raises(UnknownRewardError, match="not allowlisted"):
        resolve_reward(f"{ALLOWED}:starts_with_digit", reward_modules=["tests.rewards"])  # a prefix is no parent


def test_the_trainer_enforces_the_allowlist_at_import():
    from collage.training.trainer import Trainer, TrainingError

    from .test_training import make_config

    config = make_config(rewards=[{"name": "numeric"}, {"name": f"{ALLOWED}:run_command"}])
    with pytest.raises(TrainingError, match=r"rewards\[1\].name: .*defined in 'subprocess'"):
        Trainer(config, None, [], reward_modules=[ALLOWED]).setup()


def test_config_violations_is_the_workers_check(tmp_path, outside):
    settings = Settings(home=tmp_path, database_url="sqlite://", broker_url="memory://", artifacts=tmp_path / "a",
                        reward_modules=(ALLOWED,))  # fmt: skip
    (tmp_path / "model").mkdir()
    fine = parse_config(
        config(model={"path": str(tmp_path / "model")}, rewards=[{"name": "accuracy"}, {"name": f"{ALLOWED}:sleepy"}])
    )
    assert config_violations(fine, settings) == []
    bad = parse_config(
        config(
            model={"path": str(outside / "model")},
            dataset={"source": str(outside / "data.jsonl"), "split": "../train"},
            rewards=[{"name": "alembic.config:main"}, {"name": str(outside / "model")}],
        )
    )
    assert [path for path, _ in config_violations(bad, settings)] == [
        "model.path", "dataset.source", "dataset.split", "rewards[0].name", "rewards[1].name",
    ]  # fmt: skip
    sneaky = parse_config(config(model={"path": "tiny:../../x"}, dataset={"source": "synth:../../x"}))
    assert [path for path, _ in config_violations(sneaky, settings)] == ["model.path", "dataset.source"]
    widened = dataclasses.replace(settings, data_roots=(outside,), model_roots=(outside,))
    assert [path for path, _ in config_violations(bad, widened)] == ["dataset.split", "rewards[0].name"]


# ----------------------------------------------------------------------------------------------- paths


def _run_message(client, field: str, value: str) -> str:
    if field == "model.path":
        body = config(model={"path": value})
    elif field == "dataset.source":
        body = config(dataset={"source": value})
    else:
        body = config(rewards=[{"name": value}])
    return _errors(client.post(API + "/runs", json=body))[field]


def _route_message(client, route: str, value: str) -> str:
    if route == "preview":
        response = client.get(API + "/datasets/preview", params={"source": value})
    elif route == "check":
        response = client.post(API + "/datasets/check", json={"source": value})
    else:
        response = client.post(API + "/datasets/check", json={"source": "synth:count-red", "model": value})
    assert response.status_code == 400, response.text
    return response.json()["detail"]


FIELDS = [("run", "model.path"), ("run", "dataset.source"), ("run", "rewards[0].name"),
          ("route", "preview"), ("route", "check"), ("route", "check-model")]  # fmt: skip


@pytest.mark.parametrize("kind,field", FIELDS)
def test_outside_paths_are_refused_alike_whether_they_exist_or_not(api, outside, tmp_path, kind, field):
    client, _, dispatcher, app = api
    message = _run_message if kind == "run" else _route_message
    target = "model" if "model" in field or "rewards" in field else "data.jsonl"
    existing = message(client, field, str(outside / target))
    missing = message(client, field, str(outside / "missing" / target))
    assert existing == missing and "COLLAGE_" in existing and str(outside) not in existing
    (tmp_path / "escape").symlink_to(outside)
    home = tmp_path.name
    escapes = [str(tmp_path / "escape" / target), f"{tmp_path}/../{outside.name}/{target}",
               f"{tmp_path}/../{home}/escape/{target}"]  # fmt: skip
    assert {message(client, field, value) for value in escapes} == {existing}
    assert _runs(app) == 0 and dispatcher.submitted == []


def test_inside_paths_are_accepted(api, tmp_path):
    client, _, dispatcher, _ = api
    (tmp_path / "sub").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    body = config(
        model={"path": f"{tmp_path}/sub/../model"},
        dataset={"source": str(tmp_path / "data.jsonl")},
        rewards=[{"name": str(tmp_path / "model")}],
    )
    response = client.post(API + "/runs", json=body)
    assert response.status_code == 201, response.text
    assert len(dispatcher.submitted) == 1
    preview = client.get(API + "/datasets/preview", params={"source": str(tmp_path / "data.jsonl")})
    assert preview.status_code == 200 and "hello" in preview.text
    check = client.post(API + "/datasets/check", json={"source": str(tmp_path / "data.jsonl")})
    assert check.status_code == 200 and check.json()["rows"] == 1
    # inside the roots, existence may be told
    missing = _run_message(client, "dataset.source", str(tmp_path / "gone.jsonl"))
    assert missing == f"{tmp_path / 'gone.jsonl'} does not exist"


def test_operator_roots_replace_the_default(api, tmp_path, outside):
    client, _, _, app = api
    app.state.settings = dataclasses.replace(app.state.settings, data_roots=(outside,))
    preview = client.get(API + "/datasets/preview", params={"source": str(outside / "data.jsonl")})
    assert preview.status_code == 200 and "secret row" in preview.text
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    home = client.get(API + "/datasets/preview", params={"source": str(tmp_path / "data.jsonl")})
    assert home.status_code == 400 and str(outside) in home.json()["detail"]  # the roots are told, not the path


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
        assert "never read from the server" in _run_message(client, "dataset.source", value)
        assert "never read from the server" in _route_message(client, "preview", value)


def test_a_split_never_leaves_the_dataset_folder(api, tmp_path, outside):
    client, _, _, _ = api
    (tmp_path / "d").mkdir()
    split = f"../../{outside.name}/data"
    response = client.get(API + "/datasets/preview", params={"source": str(tmp_path / "d"), "split": split})
    assert response.status_code == 400 and "secret row" not in response.text
    body = config(dataset={"source": str(tmp_path / "d"), "split": split})
    assert "dataset.split" in _errors(client.post(API + "/runs", json=body))


# ------------------------------------------------------------------------------------------ dataset routes


@pytest.mark.parametrize("value", ["--help", "-h"])
def test_option_like_values_are_dataset_names_not_options(api, value):
    client, _, _, _ = api
    for response in [
        client.get(API + "/datasets/preview", params={"source": value}),
        client.post(API + "/datasets/check", json={"source": value}),
        client.post(API + "/datasets/check", json={"source": "synth:count-red", "model": value}),
        client.get(API + "/datasets/preview", params={"source": "synth:count-red", "split": value}),
    ]:
        assert 400 <= response.status_code < 500 and "usage:" not in response.text
