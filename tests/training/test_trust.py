"""The trust model (docs/security.md): API clients choose neither the code a worker runs nor the files it reads.

Through the real app (SQLite and PostgreSQL), the worker's check and the trainer with a tiny model: the trainer
enforces the allowlist at import, ``config_violations`` is the worker's check, and paths outside the roots (or a
split leaving its dataset folder) are refused alike whether they exist or not. The api fixture allowlists
tests.support.rewards and its COLLAGE_HOME (the default root) is the test's tmp_path.
"""

from __future__ import annotations

import dataclasses

import pytest

from collage.app.core.settings import Settings
from collage.app.core.trust import config_violations
from collage.training.config import parse_config
from tests.support.trust import (
    ALLOWED,
    config,
    errors_of,
    route_message,
    run_count,
    run_message,
)

API = "/api/v1"


def test_the_trainer_enforces_the_allowlist_at_import():
    from collage.training.trainer import Trainer, TrainingError
    from tests.support.training import make_config

    config = make_config(rewards=[{"name": "numeric"}, {"name": f"{ALLOWED}:run_command"}])
    with pytest.raises(TrainingError, match=r"rewards\[1\].name: .*defined in 'subprocess'"):
        Trainer(config, None, [], reward_modules=[ALLOWED]).setup()


def test_config_violations_is_the_workers_check(tmp_path, outside_folder):
    settings = Settings(home=tmp_path, database_url="sqlite://", broker_url="memory://", artifacts=tmp_path / "a",
                        reward_modules=(ALLOWED,))  # fmt: skip
    (tmp_path / "models" / "model").mkdir(parents=True)  # COLLAGE_HOME/models: a default model root
    fine = parse_config(
        config(model={"path": str(tmp_path / "models" / "model")},
               rewards=[{"name": "accuracy"}, {"name": f"{ALLOWED}:sleepy"}])
    )  # fmt: skip
    assert config_violations(fine, settings) == []
    bad = parse_config(
        config(
            model={"path": str(outside_folder / "model")},
            dataset={"source": str(outside_folder / "data.jsonl"), "split": "../train"},
            rewards=[{"name": "alembic.config:main"}, {"name": str(outside_folder / "model")}],
        )
    )
    assert [path for path, _ in config_violations(bad, settings)] == [
        "model.path", "dataset.source", "dataset.split", "rewards[0].name", "rewards[1].name",
    ]  # fmt: skip
    sneaky = parse_config(config(model={"path": "tiny:../../x"}, dataset={"source": "synth:../../x"}))
    assert [path for path, _ in config_violations(sneaky, settings)] == ["model.path", "dataset.source"]
    widened = dataclasses.replace(settings, data_roots=(outside_folder,), model_roots=(outside_folder,))
    assert [path for path, _ in config_violations(bad, widened)] == ["dataset.split", "rewards[0].name"]


FIELDS = [("run", "model.path"), ("run", "dataset.source"), ("run", "rewards[0].name"),
          ("route", "preview"), ("route", "check"), ("route", "check-model")]  # fmt: skip


@pytest.mark.parametrize("kind,field", FIELDS)
def test_outside_paths_are_refused_alike_whether_they_exist_or_not(api, outside_folder, tmp_path, kind, field):
    client, _, dispatcher, app = api
    message = run_message if kind == "run" else route_message
    target = "model" if "model" in field or "rewards" in field else "data.jsonl"
    existing = message(client, field, str(outside_folder / target))
    missing = message(client, field, str(outside_folder / "missing" / target))
    assert existing == missing and "COLLAGE_" in existing and str(outside_folder) not in existing
    (tmp_path / "escape").symlink_to(outside_folder)
    home = tmp_path.name
    escapes = [str(tmp_path / "escape" / target), f"{tmp_path}/../{outside_folder.name}/{target}",
               f"{tmp_path}/../{home}/escape/{target}"]  # fmt: skip
    assert {message(client, field, value) for value in escapes} == {existing}
    assert run_count(app) == 0 and dispatcher.submitted == []


def test_a_split_never_leaves_the_dataset_folder(api, tmp_path, outside_folder):
    client, _, _, _ = api
    (tmp_path / "d").mkdir()
    split = f"../../{outside_folder.name}/data"
    response = client.get(API + "/datasets/preview", params={"source": str(tmp_path / "d"), "split": split})
    assert response.status_code == 400 and "secret row" not in response.text
    body = config(dataset={"source": str(tmp_path / "d"), "split": split})
    assert "dataset.split" in errors_of(client.post(API + "/runs", json=body))
