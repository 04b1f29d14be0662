"""The trust model (docs/security.md) in the reward resolver: API clients choose none of the code a worker runs.

Through the real resolver alone: gadgets are refused even when their module is allowlisted, an allowlisted module
reaches only its own public functions, and nothing runs that the allowlist does not name.
"""

from __future__ import annotations

import pytest

from collage.training.rewards.registry import UnknownRewardError, resolve_reward
from tests.support.trust import ALLOWED, GADGETS


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


def test_the_default_model_roots_are_where_models_are_kept_not_the_home_with_its_token(tmp_path):
    """Without COLLAGE_MODEL_ROOTS a model path must lie under COLLAGE_HOME/models or COLLAGE_HOME/cache/models:
    the home itself holds the serve token, the store and the broker (the playground took the token file as a model)."""
    from collage.app.core.settings import Settings
    from collage.app.core.trust import model_violation

    settings = Settings(home=tmp_path, database_url="sqlite://", broker_url="memory://", artifacts=tmp_path / "a")
    assert settings.allowed_model_roots() == (tmp_path / "models", tmp_path / "cache" / "models")
    (tmp_path / "token").write_text("secret")
    assert "COLLAGE_MODEL_ROOTS" in model_violation(str(tmp_path / "token"), settings)
    assert "COLLAGE_MODEL_ROOTS" in model_violation(str(tmp_path), settings)
    assert model_violation(str(tmp_path / "models" / "mine"), settings) is None
    assert model_violation(str(tmp_path / "cache" / "models" / "tiny-qwen2-vl-b3"), settings) is None
