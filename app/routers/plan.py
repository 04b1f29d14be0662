"""``POST /plan``: the memory plan of a run config before it is launched (``collage plan``'s figures, for the
launch form and scripts). The model is built on the meta device from its ``config.json`` by the dataset helper
process (the web tier never loads torch), under the same bounds as a dataset check."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException

from collage.app.datasets.client import run_gated
from collage.training.memory_plan import parse_size

from ..auth import UNAUTHORIZED, require_token
from ..deps import CurrentUser, DatasetGateDep, SettingsDep
from ..schemas import ErrorOut, PlanOut, PlanRequest, ValidationErrorOut
from ..validation import check_model
from .datasets import BUSY

router = APIRouter(tags=["plan"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)


@router.post(
    "/plan",
    response_model=PlanOut,
    responses={
        400: {"model": ErrorOut, "description": "a model path refused, or one whose config cannot be read"},
        422: {"model": ValidationErrorOut, "description": "the config or a field is invalid (named)"},
        **BUSY,
    },
)
async def plan(body: PlanRequest, token: CurrentUser, settings: SettingsDep, gate: DatasetGateDep) -> PlanOut:
    """Bytes per process for DDP, FSDP2 and FSDP2 with offload: parameters, gradients, optimizer state, reference,
    activations, log-prob chunk, generation cache, the peaks, and with `gpu_memory` whether each fits."""
    problem = check_model(body.config.model.path, settings)
    if problem is not None:
        raise HTTPException(400, f"config.model.path: {problem}")
    try:
        memory = parse_size(body.gpu_memory) if body.gpu_memory else None
    except ValueError as exc:
        raise HTTPException(422, f"gpu_memory: {exc}") from exc
    job = {"op": "plan", "config": body.config.model_dump(mode="json"), "processes": body.gpus, "gpu_memory": memory}
    return PlanOut.model_validate(await run_gated(gate, settings, token, job, settings.check_timeout))
