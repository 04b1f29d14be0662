"""The trust model for tools and environments (docs/security.md): a run's ``tools[k].name`` and ``environment``
name code a worker imports, so outside the built-ins they must lie in a module of the operator's
COLLAGE_TOOL_MODULES, a list of its own (the reward allowlist allows no tool, and the other way round).

Through the real app (SQLite and PostgreSQL): refusals are 422s naming the key path, nothing is stored or
dispatched; an allowlisted path is accepted without being imported (the worker imports it, and may have packages
the web node lacks). The api fixture allowlists tests.support.rewards as a reward module and no tool module.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.trust import ALLOWED, GADGETS, config, errors_of, run_count

API = "/api/v1"


def _allow_tools(app, *modules: str) -> None:
    app.state.settings = dataclasses.replace(app.state.settings, tool_modules=modules)


def test_an_unlisted_tool_module_is_refused_naming_the_tool_and_how_to_allow_it(api):
    client, _, dispatcher, app = api
    body = config(tools=[{"name": "image_zoom_in"}, {"name": "evil.module:fn"}])
    errors = errors_of(client.post(API + "/runs", json=body))
    assert set(errors) == {"tools[1].name"}, errors
    assert "not allowlisted for tools" in errors["tools[1].name"] and "COLLAGE_TOOL_MODULES" in errors["tools[1].name"]
    # an allowlist of other modules (a prefix of the name is no parent module) refuses it the same way
    _allow_tools(app, "evil.mod", "evil.module_x")
    assert set(errors_of(client.post(API + "/runs", json=body))) == {"tools[1].name"}
    assert run_count(app) == 0 and dispatcher.submitted == []


def test_an_allowlisted_tool_is_accepted_without_being_imported(api):
    client, _, dispatcher, app = api
    _allow_tools(app, "acme_tools")  # not installed here: the worker imports it
    tools = [{"name": "acme_tools.vision:count_objects", "timeout": 5, "args": {"threshold": 0.5}}]
    response = client.post(API + "/runs", json=config(tools=tools))
    assert response.status_code == 201, response.text
    assert [run_id for run_id, _ in dispatcher.submitted] == [response.json()["id"]]
    stored = client.get(f"{API}/runs/{response.json()['id']}").json()["config"]["tools"]
    assert [(t["name"], t["timeout"], t["args"]) for t in stored] == [
        ("acme_tools.vision:count_objects", 5.0, {"threshold": 0.5})
    ]


def test_the_built_in_tools_need_no_allowlist(api):
    client, _, dispatcher, app = api
    assert app.state.settings.tool_modules == ()
    tools = [{"name": "image_zoom_in", "coords": "normalised"}, {"name": "image_rotate"}]
    body = config(tools=tools, train={"max_steps": 2, "max_tool_calling_iterations": 3, "max_images_per_rollout": 6})
    response = client.post(API + "/runs", json=body)
    assert response.status_code == 201, response.text
    stored = client.get(f"{API}/runs/{response.json()['id']}").json()["config"]
    assert [(t["name"], t["coords"]) for t in stored["tools"]] == [
        ("image_zoom_in", "normalised"),
        ("image_rotate", "pixel"),
    ]
    assert stored["train"]["max_tool_calling_iterations"] == 3 and stored["train"]["max_images_per_rollout"] == 6
    # an unknown bare name is neither a built-in nor an import path
    errors = errors_of(client.post(API + "/runs", json=config(tools=[{"name": "image_crop"}])))
    assert "unknown tool 'image_crop'" in errors["tools[0].name"] and "image_zoom_in" in errors["tools[0].name"]


def test_the_reward_and_tool_allowlists_are_separate(api):
    client, _, _, app = api
    # tests.support.rewards is a reward module (the api fixture): it provides no tool
    errors = errors_of(client.post(API + "/runs", json=config(tools=[{"name": f"{ALLOWED}:starts_with_digit"}])))
    assert "COLLAGE_TOOL_MODULES" in errors["tools[0].name"]
    # and a tool module provides no reward
    app.state.settings = dataclasses.replace(app.state.settings, reward_modules=(), tool_modules=(ALLOWED,))
    errors = errors_of(client.post(API + "/runs", json=config(rewards=[{"name": f"{ALLOWED}:starts_with_digit"}])))
    assert "COLLAGE_REWARD_MODULES" in errors["rewards[0].name"]


def test_an_environment_outside_the_allowlist_is_refused_and_one_inside_it_accepted(api):
    client, _, dispatcher, app = api
    errors = errors_of(client.post(API + "/runs", json=config(environment="acme_envs.puzzles:Jigsaw")))
    assert set(errors) == {"environment"} and "COLLAGE_TOOL_MODULES" in errors["environment"], errors
    errors = errors_of(client.post(API + "/runs", json=config(environment="Jigsaw")))
    assert "package.module:Class" in errors["environment"], errors
    assert run_count(app) == 0 and dispatcher.submitted == []
    _allow_tools(app, "acme_envs")
    response = client.post(API + "/runs", json=config(environment="acme_envs.puzzles:Jigsaw"))
    assert response.status_code == 201, response.text
    private = errors_of(client.post(API + "/runs", json=config(environment="acme_envs.puzzles:_Hidden")))
    assert "private" in private["environment"], private


@pytest.mark.parametrize("gadget", GADGETS)
def test_denied_modules_are_refused_as_tools_and_environments_even_when_listed(api, gadget):
    client, _, dispatcher, app = api
    module = gadget.partition(":")[0]
    for allowlist in [(), (module, module.split(".")[0])]:  # even when the operator lists the module
        _allow_tools(app, *allowlist)
        errors = errors_of(client.post(API + "/runs", json=config(tools=[{"name": gadget}], environment=gadget)))
        assert set(errors) == {"tools[0].name", "environment"}, errors
        assert "never provides tools" in errors["tools[0].name"], errors
    assert run_count(app) == 0 and dispatcher.submitted == []


def test_a_config_with_type_errors_still_names_the_refused_tool(api):
    """raw_semantic_errors: one answer lists the schema's errors and the allowlist's."""
    client, _, _, _ = api
    body = config(tools=[{"name": "os:system"}], environment="evil:Env", train={"max_steps": "many"})
    errors = errors_of(client.post(API + "/runs", json=body))
    assert {"train.max_steps", "tools[0].name", "environment"} <= set(errors), errors


def test_the_catalog_lists_the_built_in_tools_and_the_allowlisted_modules(api):
    client, _, _, app = api
    tools = client.get(API + "/rewards").json()["tools"]
    by_name = {t["name"]: t for t in tools["builtins"]}
    assert set(by_name) == {"image_zoom_in", "image_rotate"}
    assert by_name["image_rotate"]["doc"].startswith("Rotate an image") and "\n" not in by_name["image_rotate"]["doc"]
    assert tools["modules"] == [] and "none: the operator has allowlisted no module" in tools["user_functions"]
    _allow_tools(app, "acme_tools", "acme_envs")
    tools = client.get(API + "/rewards").json()["tools"]
    assert tools["modules"] == ["acme_tools", "acme_envs"] and "acme_tools, acme_envs" in tools["user_functions"]
