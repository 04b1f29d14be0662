"""A run's checkpoints: the list (the best one marked) and a streamed tar of one checkpoint's model folder.

Every member reads every run (docs/security.md), so every member may list and download any run's checkpoints; a
download holds one of the web process's ``COLLAGE_MAX_EXPORTS`` export slots while it streams (429 beyond). The
folder comes from the store, so it is confined to the run's own folder under ``COLLAGE_ARTIFACTS`` and streamed
without following a link (``app/tarstream.py``). Torch-free: the web node serves it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException
from sqlmodel import Session

from collage.app.core.settings import Settings
from collage.app.store.tables import Run
from collage.training.infra.objectstore import ObjectMirror

from .. import tarstream
from ..auth import UNAUTHORIZED, Responses, require_token
from ..deps import ExportSlotsDep, SessionDep, SettingsDep, StreamSessionDep
from ..schemas import CheckpointList, CheckpointOut, ErrorOut, ValidationErrorOut
from ..store import checkpoints as store
from .common import API, get_run_or_404
from .downloads import SlotStream, hold_export_slot

router = APIRouter(tags=["checkpoints"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

TAR = "application/x-tar"
DOWNLOAD_ERRORS: Responses = {
    404: {"model": ErrorOut, "description": "no such run, or no checkpoint at that step"},
    409: {"model": ErrorOut, "description": "best/last of a run without checkpoints; a folder that may not be read"},
    410: {"model": ErrorOut, "description": "the checkpoint's files are gone"},
    422: {"model": ValidationErrorOut, "description": "a step that is neither a number, best nor last"},
    429: {"description": "too many downloads at once; retry after the Retry-After header's seconds"},
    502: {"model": ErrorOut, "description": "object storage: the bucket's copy does not match its manifest (named)"},
    503: {"model": ErrorOut, "description": "object storage: the bucket does not answer; retry after Retry-After"},
    200: {"content": {TAR: {}}, "description": "the checkpoint's model folder as a tar archive, streamed"},
}


def download_url(run_id: str, step: int | str) -> str:
    return f"{API}/runs/{run_id}/checkpoints/{step}/download"


@router.get("/runs/{run_id}/checkpoints", response_model=CheckpointList, responses={404: {"model": ErrorOut}})
def list_checkpoints(run_id: str, session: SessionDep) -> CheckpointList:
    """The run's checkpoints in step order: step, the attempt that wrote it, its model folder's size, when,
    `adapter` (LoRA) or `full`, the value of `train.metric_for_best_model` at that step, and which one is best."""
    run = get_run_or_404(session, run_id)
    rule = store.BestRule.of_config(run.config)
    items = [
        CheckpointOut(
            step=e.step,
            attempt=e.attempt,
            bytes=e.bytes,
            created_at=e.created_at,
            kind=e.kind if e.kind in ("adapter", "full") else None,
            metric=e.metric,
            best=e.best,
            download_url=download_url(run.id, e.step),
        )
        for e in store.run_checkpoints(session, run)
    ]
    return CheckpointList(items=items, metric_for_best_model=rule.metric, greater_is_better=rule.greater)


def asked_step(text: str) -> store.StepChoice:
    try:
        return store.parse_step(text)
    except ValueError as exc:
        raise HTTPException(422, [{"path": "path.step", "message": str(exc)}]) from exc


def resolve(session: Session, run: Run, asked: store.StepChoice) -> store.CheckpointEntry:
    """The checkpoint ``asked`` for; 404 / 409 with the store's reason."""
    entries = store.run_checkpoints(session, run)
    try:
        return store.pick(entries, asked, store.BestRule.of_config(run.config), f"run {run.id}")
    except store.CheckpointProblem as exc:
        raise HTTPException(exc.status, str(exc)) from exc


def model_folder(
    entry: store.CheckpointEntry, artifacts: Path, run_id: str, mirror: ObjectMirror | None = None
) -> Path:
    """The checkpoint's ``model/`` folder, confined to the run's folder under the artifacts (fetched from the bucket
    when this host does not have it); 409 / 410 otherwise."""
    folder = store.checkpoint_folder(entry.path, artifacts, run_id)
    if folder is None:
        raise HTTPException(
            409,
            f"checkpoint step {entry.step} of run {run_id} is recorded at a path outside the run's folder under "
            "COLLAGE_ARTIFACTS: it is not served",
        )
    model = folder / store.MODEL_FOLDER
    if not store.local_checkpoint(folder, artifacts, mirror) or not model.is_dir():
        raise HTTPException(
            410, f"checkpoint step {entry.step} of run {run_id} is recorded but its files are gone ({model.name}/)"
        )
    return model


def tar_response(slots: threading.BoundedSemaphore, settings: Settings, root: Path, name: str) -> SlotStream:
    """``root`` as a streamed tar download named ``name.tar`` (everything under the folder ``name/``), holding one of
    the web process's export ``slots`` while it streams."""
    release = hold_export_slot(slots, settings)
    try:
        plan = tarstream.plan(root, name)
    except tarstream.UnsafeFolder as exc:
        release()
        raise HTTPException(409, f"{name}: {exc}: refused") from exc
    except FileNotFoundError as exc:
        release()
        raise HTTPException(410, f"{name}: its files are gone") from exc
    except BaseException:
        release()
        raise
    headers = {"Content-Disposition": f'attachment; filename="{name}.tar"', "Content-Length": str(plan.size)}
    return SlotStream(tarstream.stream(plan), release, media_type=TAR, headers=headers)


@router.get("/runs/{run_id}/checkpoints/{step}/download", responses=DOWNLOAD_ERRORS)
def download_checkpoint(
    run_id: str,
    step: str,
    session: StreamSessionDep,  # closed when this returns, before the tar streams: a download holds no connection
    settings: SettingsDep,
    slots: ExportSlotsDep,
) -> SlotStream:
    """The model folder of the checkpoint at `step` (a number, `best` or `last`) as a tar archive, streamed: a
    folder `<run>-step-<N>/` holding the weights (or the LoRA adapter), the config and the processor's files. A
    sharded checkpoint (`resources.strategy: fsdp`) whose model folder holds no weights comes as written, shards and
    manifest included (`collage export` or the export job consolidates it into a plain folder)."""
    asked = asked_step(step)
    run = get_run_or_404(session, run_id)
    entry = resolve(session, run, asked)
    root = model_folder(entry, settings.artifacts, run.id, settings.mirror())
    if (root.parent / store.SHARDS).is_dir() and not any(root.glob("*.safetensors")):
        root = root.parent  # the weights are only in the shards: the checkpoint as written
    return tar_response(slots, settings, root, f"{run.id}-step-{entry.step}")
