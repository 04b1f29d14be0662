"""What can be chosen in a run config: rewards, tools and models."""

from __future__ import annotations

import inspect
from pathlib import Path

from fastapi import APIRouter, Depends

from collage.app.core.trust import confined
from collage.training.models.families import FAMILIES, TINY_FAMILIES
from collage.training.rewards.builtins import BUILTINS
from collage.training.tools.image_tools import BUILTIN_TOOLS

from ..auth import UNAUTHORIZED, require_token
from ..deps import SettingsDep
from ..schemas import FamilyInfo, ModelsOut, RewardInfo, RewardsOut, ToolInfo, ToolsInfo

router = APIRouter(tags=["catalog"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)


@router.get("/rewards", response_model=RewardsOut)
def rewards(settings: SettingsDep) -> RewardsOut:
    modules = ", ".join(settings.reward_modules) or "none: the operator has allowlisted no module"
    roots = ", ".join(str(r) for r in settings.allowed_model_roots())
    return RewardsOut(
        builtins=[
            RewardInfo(name=n, kind="builtin", doc=inspect.getdoc(fn) or "") for n, fn in sorted(BUILTINS.items())
        ],
        user_functions="'package.module:function', a function defined in a module the operator allowlists "
        f"(COLLAGE_REWARD_MODULES; here: {modules}) and importable on the worker; called with prompts, completions, "
        "completion_ids, images and every dataset column; returns one float or None per sample",
        text_reward_models="the absolute path of a sequence-classification checkpoint folder under the model roots "
        f"({roots}); cannot see images (on_images_for_text_reward: error | drop)",
        tools=tools_info(settings.tool_modules),
    )


def tools_info(tool_modules: tuple[str, ...]) -> ToolsInfo:
    """The built-in tools (each with the first line of its docstring) and what the operator's COLLAGE_TOOL_MODULES
    lets a run name as a tool or as its environment."""
    modules = ", ".join(tool_modules) or "none: the operator has allowlisted no module"
    return ToolsInfo(
        builtins=[
            ToolInfo(name=n, kind="builtin", doc=(inspect.getdoc(fn) or "").partition("\n")[0])
            for n, fn in sorted(BUILTIN_TOOLS.items())
        ],
        modules=list(tool_modules),
        user_functions="'package.module:function', a function with type hints and a docstring (Args: for each "
        f"parameter) defined in a module the operator allowlists (COLLAGE_TOOL_MODULES, not the reward list; here: "
        f"{modules}) and importable on the worker; called with the model's arguments, plus images (the rollout's "
        "images so far), row (the dataset row) and its tools[].args when it declares them",
        environments="'package.module:Class' from the same allowlisted modules: one instance per rollout, reset(row) "
        "starts it and its public methods are tools",
    )


def _local_models(roots: tuple[Path, ...]) -> list[str]:
    """Model folders at the top of each model root and in its models/ and cache/models/ folders."""
    found: set[str] = set()
    for root in roots:
        for folder in (root, root / "models", root / "cache" / "models"):
            if folder.is_dir():
                found.update(
                    str(p) for p in folder.iterdir() if (p / "config.json").is_file() and confined(str(p), roots)
                )
    return sorted(found)


@router.get("/models", response_model=ModelsOut)
def models(settings: SettingsDep) -> ModelsOut:
    families = [
        FamilyInfo(name=f.name, layout=f.layout, tiny=f.tiny, model_types=list(f.model_types))
        for f in FAMILIES.values()
    ]
    return ModelsOut(
        families=families,
        tiny=[f"tiny:{n}" for n in TINY_FAMILIES],
        local=_local_models(settings.allowed_model_roots()),
    )
