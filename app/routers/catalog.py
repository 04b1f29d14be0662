"""What can be chosen in a run config: rewards and models."""

from __future__ import annotations

import inspect
from pathlib import Path

from fastapi import APIRouter, Depends, Request

from collage.training.models.families import FAMILIES, TINY_FAMILIES
from collage.training.rewards.builtins import BUILTINS

from ..auth import UNAUTHORIZED, require_token
from ..schemas import FamilyInfo, ModelsOut, RewardInfo, RewardsOut

router = APIRouter(tags=["catalog"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)


@router.get("/rewards", response_model=RewardsOut)
def rewards() -> RewardsOut:
    return RewardsOut(
        builtins=[
            RewardInfo(name=n, kind="builtin", doc=inspect.getdoc(fn) or "") for n, fn in sorted(BUILTINS.items())
        ],
        user_functions="'package.module:function', importable on the worker; called with prompts, completions, "
        "completion_ids, images and every dataset column; returns one float or None per sample",
        text_reward_models="a local sequence-classification checkpoint folder; cannot see images "
        "(on_images_for_text_reward: error | drop)",
    )


def _local_models(home: Path) -> list[str]:
    found = []
    for folder in (home / "models", home / "cache" / "models"):
        if folder.is_dir():
            found += sorted(str(p) for p in folder.iterdir() if (p / "config.json").is_file())
    return found


@router.get("/models", response_model=ModelsOut)
def models(request: Request) -> ModelsOut:
    families = [
        FamilyInfo(name=f.name, layout=f.layout, tiny=f.tiny, model_types=list(f.model_types))
        for f in FAMILIES.values()
    ]
    return ModelsOut(
        families=families,
        tiny=[f"tiny:{n}" for n in TINY_FAMILIES],
        local=_local_models(request.app.state.settings.home),
    )
