"""The trust model (docs/security.md): API clients choose neither the code a worker runs nor the files it reads.

Through the real app (SQLite and PostgreSQL) and the real resolver: gadget rewards and unlisted modules are refused
at submit, allowlisted functions accepted, and option-like values are dataset names, never options. The api fixture
allowlists tests.support.rewards and its COLLAGE_HOME (the default root) is the test's tmp_path.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.trust import ALLOWED, GADGETS, config, errors_of, run_count

API = "/api/v1"


@pytest.mark.parametrize("gadget", GADGETS)
def test_gadget_rewards_are_refused_at_submit_whatever_the_allowlist(api, gadget):
    client, _, dispatcher, app = api
    module = gadget.partition(":")[0]
    for allowlist in [(ALLOWED,), (ALLOWED, module, module.split(".")[0])]:  # even when the operator lists it
        app.state.settings = dataclasses.replace(app.state.settings, reward_modules=allowlist)
        body = config(rewards=[{"name": "accuracy"}, {"name": gadget, "args": {"filename": "/tmp/x", "filemode": "w"}}])
        errors = errors_of(client.post(API + "/runs", json=body))
        assert set(errors) == {"rewards[1].name"}
    assert run_count(app) == 0 and dispatcher.submitted == []


def test_an_unlisted_module_is_refused_saying_how_the_operator_allows_it(api):
    client, _, dispatcher, app = api
    errors = errors_of(client.post(API + "/runs", json=config(rewards=[{"name": "tests.store.test_trust:config"}])))
    assert "COLLAGE_REWARD_MODULES" in errors["rewards[0].name"]
    private = errors_of(client.post(API + "/runs", json=config(rewards=[{"name": f"{ALLOWED}:_private_helper"}])))
    assert "private" in private["rewards[0].name"]
    assert run_count(app) == 0 and dispatcher.submitted == []


def test_an_allowlisted_function_is_accepted(api):
    client, _, dispatcher, app = api
    response = client.post(API + "/runs", json=config(rewards=[{"name": f"{ALLOWED}:starts_with_digit"}]))
    assert response.status_code == 201, response.text
    assert [run_id for run_id, _ in dispatcher.submitted] == [response.json()["id"]]
    app.state.settings = dataclasses.replace(app.state.settings, reward_modules=("tests",))  # submodules too
    assert client.post(API + "/runs", json=config(rewards=[{"name": f"{ALLOWED}:sleepy"}])).status_code == 201


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


@pytest.mark.parametrize("inside", ["chat_template.jinja", "model.safetensors", "sub/tokenizer.json", "linked-dir"])
def test_a_model_folder_holding_a_link_out_of_the_roots_is_refused_everywhere_it_is_named(api, tmp_path, inside):
    """The folder is under COLLAGE_MODEL_ROOTS, one of its files (or folders) links outside: a run naming it, a
    reward model naming it and a data check with it are refused before anything loads it, naming the file."""
    client, _, dispatcher, app = api
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the serve token, say")
    model = tmp_path / "models" / "evil"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    link = model / inside
    link.symlink_to(outside if inside == "linked-dir" else outside / "secret.txt")
    app.state.settings = dataclasses.replace(app.state.settings, model_roots=(tmp_path / "models",))
    expected = f"holds {inside}, a link that leads outside the folders it may be read from"
    errors = errors_of(client.post(API + "/runs", json=config(model={"path": str(model)})))
    assert expected in errors["model.path"], errors
    reward = errors_of(client.post(API + "/runs", json=config(rewards=[{"name": str(model)}])))
    assert expected in reward["rewards[0].name"], reward
    check = client.post(API + "/datasets/check", json={"source": "synth:count-red", "model": str(model)})
    assert check.status_code == 400 and expected in check.json()["detail"], check.text
    assert run_count(app) == 0 and dispatcher.submitted == []
    link.unlink()  # the same folder without the link is a model folder like any other
    assert "model.path" not in errors_of(
        client.post(API + "/runs", json=config(model={"path": str(model)}, dataset={"source": "nope"}))
    )
