"""Exports: a run's checkpoint as a plain transformers folder, made by a worker (the web node has no torch), then
downloaded as a tar.

``POST /runs/{id}/exports`` checks the checkpoint exists and queues a job of kind ``export`` on the run's
``resources.queue`` (``app/store/jobs.py``); a worker of that queue runs ``worker/export_job.py``, which writes
``COLLAGE_ARTIFACTS/exports/<job id>/`` and reports its progress. Members read every run, so any member may export
any run's checkpoint; each token has one export in flight at a time (429 beyond) and keeps its newest finished export
on disk (``app/store/exports.py``). Only the token that asked, or an admin, cancels an export.

``GET /runs/{id}/exports`` lists a run's exports (every token's: members read every run, as ``GET /exports/{id}``
lets them) and ``GET /exports`` the calling token's own (an admin's: everyone's), newest first, so a finished
export is found again after its browser tab is gone.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy.engine import Engine

from collage.app.core.status import ENDED, JobKind, RunStatus
from collage.app.store.tables import ApiToken, Job
from collage.training.infra.objectstore import ensure_local_folder

from ..auth import FORBIDDEN, UNAUTHORIZED, is_admin, owns, require_token
from ..deps import CurrentUser, DispatcherDep, EngineDep, ExportSlotsDep, SessionDep, SettingsDep
from ..schemas import ErrorOut, ExportCreated, ExportOut, ExportRequest, ValidationErrorOut
from ..store import checkpoints as checkpoint_store
from ..store import exports as store
from ..store import jobs
from ..store.queueing import queue_of
from .checkpoints import resolve, tar_response
from .common import API, get_run_or_404

router = APIRouter(tags=["exports"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

RETRY_EXPORT_AFTER = 10  # seconds a token that has an export in flight is told to wait


class ExportItem(ExportOut):
    """An export in a listing: :class:`ExportOut`, who asked for it, and whether the caller did."""

    created_by: str | None = Field(description="the name of the token that asked for it (null: unknown)")
    mine: bool = Field(description="whether the calling token asked for it")


class ExportList(BaseModel):
    items: list[ExportItem] = Field(description="newest first")


Limit = Annotated[int, Query(ge=1, le=store.LIST_MAX, description=f"at most this many exports, 1..{store.LIST_MAX}")]


def export_url(job_id: str) -> str:
    return f"{API}/exports/{job_id}"


def _job_or_404(engine: Engine, job_id: str) -> Job:
    job = jobs.get_job(engine, job_id) if len(job_id) <= 32 else None
    if job is None or job.kind != JobKind.EXPORT:
        raise HTTPException(404, f"no export with id {job_id!r}")
    return job


def export_out(engine: Engine, job: Job) -> ExportOut:
    result = job.result if isinstance(job.result, dict) else {}
    removed = result.get("removed")
    done = job.status == RunStatus.SUCCEEDED and not removed
    return ExportOut(
        id=job.id,
        run_id=job.run_id,
        status=job.status,
        progress=job.progress,
        message=job.message,
        error=job.error,
        queue_position=jobs.queue_position(engine, job),
        step=job.request.get("step"),
        merge_lora=bool(job.request.get("merge_lora")),
        kind=result.get("kind"),
        bytes=result.get("bytes"),
        created_at=job.created_at,
        finished_at=job.finished_at,
        download_url=f"{export_url(job.id)}/download" if done else None,
        removed=removed,
    )


@router.post(
    "/runs/{run_id}/exports",
    status_code=202,
    response_model=ExportCreated,
    responses={
        404: {"model": ErrorOut, "description": "no such run, or no checkpoint at that step"},
        409: {"model": ErrorOut, "description": "the run has no checkpoint (or no best one)"},
        422: {"model": ValidationErrorOut, "description": "a bad step or merge_lora"},
        429: {"model": ErrorOut, "description": "this token already has an export in flight"},
        503: {"model": ErrorOut, "description": "the export could not be queued"},
    },
)
def create_export(
    run_id: str,
    response: Response,
    session: SessionDep,
    token: CurrentUser,
    engine: EngineDep,  # the job's lifecycle is the jobs store's: its own transactions, shared with the workers
    dispatcher: DispatcherDep,
    body: Annotated[ExportRequest | None, Body()] = None,
) -> ExportCreated:
    """Queue the export of a checkpoint (`step`: a number, `best` or `last`, default `last`) as a plain transformers
    folder; `merge_lora` merges a LoRA adapter into the base weights. A worker of the run's queue makes it; follow it
    with `GET /exports/{id}`, then download it."""
    asked = body or ExportRequest()
    run = get_run_or_404(session, run_id)
    if not checkpoint_store.run_checkpoints(session, run):
        raise HTTPException(409, f"run {run.id} has no checkpoint to export yet")
    entry = resolve(session, run, asked.step)
    if asked.merge_lora and entry.kind == "full":
        raise HTTPException(
            422,
            [{"path": "merge_lora", "message": f"checkpoint step {entry.step} is a full model: it has no LoRA "
              "adapter to merge"}],
        )  # fmt: skip
    queue = queue_of(run.config)
    request_json = {"run_id": run.id, "step": entry.step, "asked": asked.step, "merge_lora": asked.merge_lora}
    # the look and the insert are one transaction (store.admit): of concurrent requests on any replica, one gets in
    job = jobs.new_job(JobKind.EXPORT, queue, request_json, run_id=run.id, created_by=token)
    busy = store.admit(engine, token, job)
    if busy is not None:
        raise _one_at_a_time(busy)
    try:
        dispatcher.submit_job(job.id, queue)
    except Exception as exc:  # any broker failure: the job is cancelled (it would otherwise wait for a resend)
        jobs.cancel_job(engine, job.id)
        raise HTTPException(503, f"the export could not be queued: {exc}") from exc
    response.headers["Location"] = export_url(job.id)
    return ExportCreated(id=job.id, url=export_url(job.id))


def _one_at_a_time(busy: Job) -> HTTPException:
    return HTTPException(
        429,
        f"export {busy.id} of this token is still {busy.status} ({export_url(busy.id)}): one export at a time per "
        "token; wait for it to end or cancel it",
        headers={"Retry-After": str(RETRY_EXPORT_AFTER)},
    )


def _listing(engine: Engine, token: ApiToken, rows: list[tuple[Job, str | None]]) -> ExportList:
    return ExportList(
        items=[
            ExportItem(**export_out(engine, job).model_dump(), created_by=name, mine=owns(token, job.created_by))
            for job, name in rows
        ]
    )


@router.get("/runs/{run_id}/exports", response_model=ExportList, responses={404: {"model": ErrorOut}})
def list_run_exports(
    run_id: str, session: SessionDep, token: CurrentUser, engine: EngineDep, limit: Limit = store.LIST_DEFAULT
) -> ExportList:
    """The run's exports, every token's (any token reads every run), newest first: each with its step, whether the
    LoRA adapter was merged, its status, size and `download_url` once it succeeded, and the token that asked."""
    run = get_run_or_404(session, run_id)
    return _listing(engine, token, store.list_exports(engine, run_id=run.id, limit=limit))


@router.get("/exports", response_model=ExportList)
def list_exports(token: CurrentUser, engine: EngineDep, limit: Limit = store.LIST_DEFAULT) -> ExportList:
    """The calling token's exports, of every run, newest first (an admin token: every token's)."""
    mine = None if is_admin(token) else token.id
    return _listing(engine, token, store.list_exports(engine, created_by=mine, limit=limit))


@router.get("/exports/{job_id}", response_model=ExportOut, responses={404: {"model": ErrorOut}})
def get_export(job_id: str, engine: EngineDep) -> ExportOut:
    """The export's status (`queued`, `running`, `cancelling`, `succeeded`, `failed`, `cancelled`), progress (0..1)
    and what it does now, its place in its queue while it waits, its error, and `download_url` once it succeeded."""
    return export_out(engine, _job_or_404(engine, job_id))


@router.get(
    "/exports/{job_id}/download",
    responses={
        404: {"model": ErrorOut, "description": "no such export"},
        409: {"model": ErrorOut, "description": "the export has not succeeded (yet)"},
        410: {"model": ErrorOut, "description": "the exported folder was removed"},
        429: {"description": "too many downloads at once; retry after the Retry-After header's seconds"},
        200: {"content": {"application/x-tar": {}}, "description": "the exported folder as a tar archive, streamed"},
    },
)
def download_export(job_id: str, engine: EngineDep, settings: SettingsDep, slots: ExportSlotsDep) -> StreamingResponse:
    """The exported folder as a tar archive, streamed (a folder `<run>-step-<N>/`, `-merged` for a merged LoRA)."""
    job = _job_or_404(engine, job_id)
    result = job.result if isinstance(job.result, dict) else {}
    if job.status != RunStatus.SUCCEEDED:
        raise HTTPException(409, f"export {job.id} is {job.status}: it can be downloaded once it has succeeded")
    if result.get("removed"):
        raise HTTPException(410, f"export {job.id} was removed: {result['removed']}")
    root = store.exports_root(settings.artifacts) / job.id  # never a path from the store
    # with object storage the export is in the bucket; a web node that has not served it yet fetches it first
    if not ensure_local_folder(settings.artifacts, root, settings.mirror()):
        raise HTTPException(410, f"export {job.id}: its files are gone")
    name = f"{job.run_id}-step-{job.request.get('step')}" + ("-merged" if job.request.get("merge_lora") else "")
    return tar_response(slots, settings, root, name)


@router.post(
    "/exports/{job_id}/cancel",
    response_model=ExportOut,
    responses={404: {"model": ErrorOut}, 409: {"model": ErrorOut, "description": "it has ended"}, **FORBIDDEN},
)
def cancel_export(job_id: str, token: CurrentUser, engine: EngineDep) -> ExportOut:
    """A queued export ends at once; a running one stops at its next step and leaves no files. Only the token that
    asked for it, or an admin."""
    job = _job_or_404(engine, job_id)
    if not (is_admin(token) or owns(token, job.created_by)):
        raise HTTPException(403, f"only the token that asked for export {job.id}, or an admin, may cancel it")
    if job.status in ENDED:
        raise HTTPException(409, f"export {job.id} has ended ({job.status}): nothing to cancel")
    jobs.cancel_job(engine, job.id)
    return export_out(engine, _job_or_404(engine, job_id))
