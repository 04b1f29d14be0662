"""What can be chosen in a run config: rewards and models."""

from __future__ import annotations

import inspect
from pathlib import Path

from fastapi import APIRouter, Depends

from collage.training.models.families import FAMILIES, TINY_FAMILIES
from collage.training.rewards.builtins import BUILTINS

from ..auth import UNAUTHORIZED, require_token
from ..deps import SettingsDep
from ..schemas import FamilyInfo, ModelsOut, RewardInfo, RewardsOut
from ..trust import confined

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
