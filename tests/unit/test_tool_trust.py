"""The tool allowlist's parts without a store (docs/security.md): COLLAGE_TOOL_MODULES read into Settings, the
policy the worker child applies again before it builds the Trainer (app.trust.config_violations), the allowlist
handed to the Trainer, and the launch form's tools group with its help texts from the config schema."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from collage.app.core.settings import ENV_VARS, Settings
from collage.app.core.trust import config_violations
from collage.training.config import RunConfig, parse_config


def _settings(**changes) -> Settings:
    base = Settings(home=Path("/nonexistent-home"), database_url="sqlite://", broker_url="memory://",
                    artifacts=Path("/nonexistent-home/artifacts"))  # fmt: skip
    return Settings(**{**base.__dict__, **changes})


def _config(**changes) -> RunConfig:
    return parse_config({"model": {"path": "tiny:qwen2-vl"}, "dataset": {"source": "synth:count-red"}, **changes})


def test_collage_tool_modules_is_read_like_the_reward_list(monkeypatch):
    assert "COLLAGE_TOOL_MODULES" in ENV_VARS
    monkeypatch.setenv("COLLAGE_TOOL_MODULES", " acme_tools , lab.vision.tools,, ")
    monkeypatch.setenv("COLLAGE_REWARD_MODULES", "acme_rewards")
    settings = Settings.from_env()
    assert settings.tool_modules == ("acme_tools", "lab.vision.tools")
    assert settings.reward_modules == ("acme_rewards",)
    monkeypatch.delenv("COLLAGE_TOOL_MODULES")
    assert Settings.from_env().tool_modules == ()


def test_the_worker_childs_policy_refuses_unlisted_tools_and_environments():
    config = _config(tools=[{"name": "image_rotate"}, {"name": "acme_tools.vision:count"}, {"name": "os:system"}],
                     environment="acme_tools.envs:Puzzle")  # fmt: skip
    violations = dict(config_violations(config, _settings()))
    assert set(violations) == {"tools[1].name", "tools[2].name", "environment"}, violations
    assert "COLLAGE_TOOL_MODULES" in violations["tools[1].name"]
    violations = dict(config_violations(config, _settings(tool_modules=("acme_tools", "os"))))
    assert set(violations) == {"tools[2].name"} and "never provides tools" in violations["tools[2].name"]
    assert config_violations(_config(tools=[{"name": "image_zoom_in"}]), _settings()) == []


def test_the_worker_child_hands_the_tool_allowlist_to_the_trainer(monkeypatch):
    import collage.training.trainer as trainer_module
    from collage.worker import child

    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

        def train(self):
            return "trained"

    monkeypatch.setattr(trainer_module, "Trainer", Recorder)
    settings = _settings(tool_modules=("acme_tools",), reward_modules=("acme_rewards",))
    assert child._train(SimpleNamespace(settings=settings), _config(), Path("/nonexistent-out"), [], False) == "trained"
    assert seen["tool_modules"] == ("acme_tools",) and seen["reward_modules"] == ("acme_rewards",)


@pytest.mark.parametrize("allowlist", [None, [], ["acme_tools"]])
def test_the_trainer_keeps_the_tool_allowlist(allowlist):
    from collage.training.trainer import Trainer

    trainer = Trainer(_config(), None, [], tool_modules=allowlist)
    assert trainer.tool_modules == (None if allowlist is None else tuple(allowlist))


def test_the_launch_forms_tools_group_takes_its_help_from_the_config_schema():
    from collage.app.web.fields import HELP, form_fields, tool_form
    from collage.training.config_docs import key_doc

    keys = ["train.max_tool_calling_iterations", "train.eval_max_tool_calling_iterations",
            "train.max_images_per_rollout", "train.mask_capped_trajectories", "environment"]  # fmt: skip
    fields = {f.path: f for f in form_fields()}
    for key in keys:
        assert HELP[key][0] == key_doc(key).description and fields[key].section == "tools", key
    assert fields["train.eval_max_tool_calling_iterations"].default is None
    assert fields["train.mask_capped_trajectories"].kind == "bool"
    form = tool_form(("acme_tools",))
    assert [t.name for t in form.builtins] == ["image_zoom_in", "image_rotate"]
    assert all(t.doc and "\n" not in t.doc for t in form.builtins)
    assert form.coords_choices == ["pixel", "normalised"] and form.coords_default == "pixel"
    assert form.coords_help == key_doc("tools[].coords").description and form.modules == ["acme_tools"]
