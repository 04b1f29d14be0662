"""Dataset check and preview, answered by a long-lived child process (``collage.app.datasets.process``) through
:mod:`collage.app.datasets.client`, which starts it and bounds how many requests one web process takes on.

The client's values are checked against the operator's roots first (app.trust: an outside path never reaches the
child) and travel as JSON fields (never read as options). The operator's data roots travel with every request: the
child confines the image paths named inside rows to them. Beyond the bounds (``dataset_per_user`` per token,
``dataset_queue`` per process) the answer is 429 with ``Retry-After``; a request that runs past its time (waiting
included) is answered 504 and its helper is killed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from collage.app.core.settings import Settings
from collage.app.core.trust import split_violation
from collage.app.datasets.client import DataHelper as DataHelper  # the tests reach the helper through this module
from collage.app.datasets.client import data_helper as data_helper
from collage.app.datasets.client import run_gated
from collage.app.datasets.client import warm_up as warm_up  # the launch page starts the helper early
from collage.training.config import IMAGES_MAX, SEED_MAX, DatasetSettings
from collage.training.data.mapping import parse_columns

from ..auth import UNAUTHORIZED, Responses, require_token
from ..deps import CurrentUser, DatasetGateDep, EngineDep, SettingsDep
from ..schemas import DatasetCheckOut, DatasetCheckRequest, DatasetPreviewOut, PreviewRow
from ..store.image_index import register_images
from ..validation import check_dataset, check_model
from .common import image_ref

router = APIRouter(tags=["datasets"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

BUSY: Responses = {
    429: {"description": "too many dataset requests in flight (this token's, or the server's); see Retry-After"},
    503: {"description": "the dataset helper stayed busy with other requests for this request's whole time"},
    504: {"description": "the dataset took longer than the server allows (COLLAGE_PREVIEW_TIMEOUT / _CHECK_TIMEOUT)"},
}


def _refuse(settings: Settings, source: str, split: str, model: str | None = None, images: tuple[int, int] = (0, 3)):
    """400 naming the parameter when a value is refused (a path outside the operator's roots, an unknown synthetic
    task, a missing local path); the child never sees it. The same checks as a run config's."""
    problems = [
        ("source", check_dataset(source, *images, settings)),
        ("split", split_violation(split)),
        ("model", check_model(model, settings) if model is not None else None),
    ]
    for name, message in problems:
        if message is not None:
            raise HTTPException(400, f"{name}: {message}")


def _mapping_fields(
    source: str, columns: dict[str, Any] | None, template: str | None, system: str | None, config_name: str | None
) -> dict[str, Any]:
    """The helper request's ``mapping`` and ``config_name``, validated as ``dataset.*`` of a run config is (422
    naming the parameter: a template with attribute access, a template and columns.prompt together)."""
    fields = {"columns": columns, "prompt_template": template, "system_prompt": system, "config_name": config_name}
    try:
        DatasetSettings(source=source, **fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "dataset"
        raise HTTPException(422, f"{where}: {first['msg']}") from exc
    mapping = {k: v for k, v in fields.items() if k != "config_name" and v is not None}
    return {"mapping": mapping, "config_name": config_name}


@router.post(
    "/datasets/check",
    response_model=DatasetCheckOut,
    responses={400: {"description": "unreadable source"}, **BUSY},
)
async def check(
    body: DatasetCheckRequest, token: CurrentUser, settings: SettingsDep, gate: DatasetGateDep
) -> DatasetCheckOut:
    """The `collage data check` report: every bad row, images and image tokens per row."""
    images = (body.min_images, body.max_images)
    _refuse(settings, body.source, body.split, body.model or None, images)
    if body.max_prompt_length and not body.model:
        raise HTTPException(400, "max_prompt_length: needs a model to count the prompt's tokens")
    mapping = _mapping_fields(body.source, body.columns.model_dump(exclude_none=True) if body.columns else None,
                              body.prompt_template, body.system_prompt, body.config_name)  # fmt: skip
    job = {
        "op": "check",
        "source": body.source,
        "split": body.split,
        **mapping,
        "model": body.model or None,
        "max_prompt_length": body.max_prompt_length or None,
        "synth": {"rows": body.rows, "min_images": body.min_images, "max_images": body.max_images, "seed": body.seed},
        "data_roots": [str(root) for root in settings.allowed_data_roots()],
        "check": body.check,
    }
    report = await run_gated(gate, settings, token, job, settings.check_timeout)
    return DatasetCheckOut.model_validate(report)


@router.get(
    "/datasets/preview",
    response_model=DatasetPreviewOut,
    responses={400: {"description": "unreadable source"}, **BUSY},
)
async def preview(
    token: CurrentUser,
    settings: SettingsDep,
    gate: DatasetGateDep,
    engine: EngineDep,
    source: Annotated[str, Query(min_length=1, max_length=1000)],
    split: Annotated[str, Query(max_length=100)] = "train",
    rows: Annotated[int, Query(ge=1, le=200, description="how many rows to show")] = 5,
    dataset_rows: Annotated[
        int, Query(ge=1, le=100_000, description="synth:<task> only: rows of the generated dataset")
    ] = 256,
    min_images: Annotated[int, Query(ge=0, le=IMAGES_MAX, description="synth:<task> only")] = 0,
    max_images: Annotated[int, Query(ge=0, le=IMAGES_MAX, description="synth:<task> only")] = 3,
    seed: Annotated[int, Query(ge=0, le=SEED_MAX, description="synth:<task> only")] = 0,
    columns: Annotated[
        str | None, Query(max_length=2000, description="dataset.columns as prompt=question,images=image_1+image_2")
    ] = None,
    prompt_template: Annotated[str | None, Query(max_length=20_000, description="dataset.prompt_template")] = None,
    system_prompt: Annotated[str | None, Query(max_length=20_000, description="dataset.system_prompt")] = None,
    config_name: Annotated[str | None, Query(max_length=200, description="dataset.config_name")] = None,
) -> DatasetPreviewOut:
    """The first rows with their images (served by `GET /images/{sha256}`); for `synth:<task>`, the rows of the
    dataset a run with the same `dataset.rows`, `min_images`, `max_images` and `seed` trains on (generated for the
    preview alone: only the rows shown). Only the rows shown are read, at most `COLLAGE_PREVIEW_MAX_IMAGES` images
    and `COLLAGE_PREVIEW_MAX_BYTES` bytes of image data (`note` says where the preview stopped)."""
    _refuse(settings, source, split, images=(min_images, max_images))
    try:
        parsed = parse_columns(columns) if columns else None
    except ValueError as exc:
        raise HTTPException(422, f"columns: {exc}") from exc
    mapping = _mapping_fields(source, parsed, prompt_template, system_prompt, config_name)
    artifacts = Path(settings.artifacts).absolute()
    job = {
        "op": "preview",
        "source": source,
        "split": split,
        **mapping,
        "rows": rows,
        "artifacts": str(artifacts),
        "synth": {"rows": dataset_rows, "min_images": min_images, "max_images": max_images, "seed": seed},
        "data_roots": [str(root) for root in settings.allowed_data_roots()],
        "max_images": settings.preview_max_images,
        "max_bytes": settings.preview_max_bytes,
    }
    report = await run_gated(gate, settings, token, job, settings.preview_timeout)
    images = {im["sha256"]: im for row in report["rows"] for im in row["images"]}
    if images:
        await run_in_threadpool(register_images, engine, list(images.values()))
    return DatasetPreviewOut(
        source=source,
        total_rows=report.get("total_rows"),
        note=report.get("note"),
        column_names=report.get("column_names") or [],
        guess=report.get("guess") or {},
        rows=[
            PreviewRow(
                row=r["row"],
                prompt=r["prompt"],
                columns=r["columns"],
                error=r.get("error"),
                images=[image_ref(im["sha256"], im["width"], im["height"]) for im in r["images"]],
            )
            for r in report["rows"]
        ],
    )
