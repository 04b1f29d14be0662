"""The playground: upload images, generate with one or two models (a run's checkpoint or a base model) on a worker,
follow and cancel the generation (docs/playground.md).

Every member may use it. Uploads count against the uploading token's quota; a generation is seen (and cancelled)
only by the token that asked for it, and by admins. The web node never loads a model: a generation is a job
(``app.store.jobs``) on the run's queue, which a worker of that queue runs (``collage.worker.playground.service``).
"""

from __future__ import annotations

import logging
import threading
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.datastructures import UploadFile

from collage.app.core.settings import Settings
from collage.app.core.status import JobKind, RunStatus
from collage.app.playground.request import (
    Refused,
    ResolvedModel,
    clean_upload,
    prompt_conversation,
    request_tool_calls,
    request_tools,
    resolve_model,
    upload_growth_error,
)
from collage.app.store.jobs import model_summary
from collage.app.store.tables import ApiToken, Job
from collage.training.infra.images import ImageRefused

from ..auth import UNAUTHORIZED, Responses, is_admin, owns, require_token
from ..deps import CurrentUser, DispatcherDep, EngineDep, SessionDep, SettingsDep
from ..schemas import (
    ErrorOut,
    GenerateCreated,
    GenerateRequest,
    GenerationOut,
    PlaygroundModelOut,
    PlaygroundResult,
    UploadOut,
    UploadsOut,
    ValidationErrorOut,
)
from ..store import jobs
from ..store.image_index import image_sizes, known_images
from ..store.uploads import UploadLimits, UploadRefused, list_uploads, store_upload, used_bytes
from .common import API, image_ref
from .workers import queue_workers

log = logging.getLogger("collage.api")

router = APIRouter(tags=["playground"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

UPLOAD_PATH = "/images"
# what a multipart body carries besides the file itself (boundaries, part headers, a file name)
MULTIPART_SLACK = 64 << 10
# uploads decoded at once per web process (a 40-megapixel image takes ~200 MB): a thread semaphore, taken on the
# decoding thread (an asyncio one belongs to the first event loop that waits on it; a process may run several)
DECODES = threading.BoundedSemaphore(4)


def _clean_upload_bounded(data: bytes, max_pixels: int):
    with DECODES:
        return clean_upload(data, max_pixels)


INVALID: Responses = {422: {"model": ValidationErrorOut, "description": "every bad field, by its path"}}
NOT_FOUND: Responses = {404: {"model": ErrorOut, "description": "no such generation (or not this token's)"}}


def upload_body_limit(settings: Settings) -> dict[tuple[str, str], int]:
    """The body limit of the upload route (app.limits.BodySizeLimit): the file's bound plus the multipart frame."""
    return {("POST", API + UPLOAD_PATH): settings.upload_max_bytes + MULTIPART_SLACK}


def _field_error(path: str, message: str, status: int = 422) -> HTTPException:
    if status == 422:
        return HTTPException(422, [{"path": path, "message": message}])
    return HTTPException(status, message)


def _refused(exc: Refused) -> HTTPException:
    return _field_error(exc.path, exc.message, exc.status)


# ------------------------------------------------------------------------------------------------------ uploads
UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file"],
                "properties": {"file": {"type": "string", "format": "binary", "description": "PNG, JPEG or WebP"}},
            }
        }
    },
}


async def _read_file(request: Request, limit: int) -> bytes:
    """The bytes of the multipart field ``file`` (at most ``limit``: 413 beyond). The body arrives through
    BodySizeLimit, which stops it past the route's own bound while it is read."""
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=64 << 10)
    except HTTPException as exc:  # a malformed multipart body (Starlette's parser)
        raise _field_error("file", f"the body is not a readable multipart form: {exc.detail}") from exc
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise _field_error(
                "file", "send one image as multipart/form-data, in a file field named file (PNG, JPEG or WebP)"
            )
        data = await upload.read(limit + 1)
    finally:
        await form.close()
    if len(data) > limit:
        raise HTTPException(
            413, f"the image is larger than the {limit} bytes an upload may have (COLLAGE_UPLOAD_MAX_BYTES)"
        )
    return data


@router.post(
    UPLOAD_PATH,
    status_code=201,
    response_model=UploadOut,
    openapi_extra={"requestBody": UPLOAD_BODY},
    responses={
        **INVALID,
        413: {"model": ErrorOut, "description": "the file is larger than COLLAGE_UPLOAD_MAX_BYTES"},
        429: {"model": ErrorOut, "description": "the token's uploads would exceed COLLAGE_UPLOAD_QUOTA_MB"},
        503: {"model": ErrorOut, "description": "the image could not be written (the bucket or the disk refused it)"},
        507: {
            "model": ErrorOut,
            "description": "every token's uploads would pass COLLAGE_UPLOAD_BUDGET_MB, or the "
            "disk would keep less than COLLAGE_MIN_FREE_DISK_MB free",
        },
    },
)
async def upload_image(request: Request, token: CurrentUser, settings: SettingsDep, engine: EngineDep) -> UploadOut:
    """Upload one image (PNG, JPEG or WebP, multipart field `file`). It is decoded on the server, turned upright,
    flattened to RGB and stored again as a PNG of its pixels alone (no metadata), addressed by the SHA-256 of those
    bytes: use the `sha256` in `POST /generate`. An image this token uploaded before is not counted again."""
    data = await _read_file(request, settings.upload_max_bytes)
    try:
        image = await run_in_threadpool(_clean_upload_bounded, data, settings.upload_max_pixels)
    except ImageRefused as exc:
        raise _field_error("file", f"the file {exc}") from exc
    grown = upload_growth_error(len(data), len(image.png), settings.upload_max_bytes)
    if grown is not None:
        raise _field_error("file", f"the file {grown}")
    assert token.id is not None
    limits = UploadLimits(quota=settings.upload_quota_mb << 20, budget=settings.upload_budget_mb << 20,
                          min_free=settings.min_free_disk_mb << 20)  # fmt: skip
    try:
        stored = await run_in_threadpool(
            store_upload, engine, settings.artifacts, token.id, image.png, (image.width, image.height), limits,
            settings.mirror(),
        )  # fmt: skip
    except UploadRefused as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    sha = stored.sha256
    ref = image_ref(sha, image.width, image.height)
    return UploadOut(sha256=sha, width=image.width, height=image.height, bytes=stored.bytes, url=ref.url,
                     thumb_url=ref.thumb_url, new=stored.new)  # fmt: skip


@router.get("/uploads", response_model=UploadsOut)
def my_uploads(
    session: SessionDep,
    token: CurrentUser,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> UploadsOut:
    """This token's uploads, newest first, and how much of its quota they use."""
    assert token.id is not None
    items = []
    for upload, image in list_uploads(session, token.id, limit):
        ref = image_ref(image.sha256, image.width, image.height)
        items.append(UploadOut(sha256=image.sha256, width=image.width, height=image.height, bytes=upload.bytes,
                               url=ref.url, thumb_url=ref.thumb_url, new=False))  # fmt: skip
    quota = settings.upload_quota_mb << 20
    return UploadsOut(items=items, used_bytes=used_bytes(session, token.id), quota_bytes=quota)


# --------------------------------------------------------------------------------------------------- generation
def _check_images(session: Session, shas: list[str], settings: Settings) -> list[tuple[str, str]]:
    errors = []
    if len(shas) > settings.playground_max_images:
        errors.append(("images", f"{len(shas)} images, more than the {settings.playground_max_images} a generation "
                                 "may have (COLLAGE_PLAYGROUND_MAX_IMAGES)"))  # fmt: skip
    known = known_images(session, shas)
    for i, sha in enumerate(shas):
        if sha not in known:
            errors.append((f"images[{i}]", f"no image {sha} in the store: upload it first (POST {API}/images)"))
    return errors


@router.post(
    "/generate",
    status_code=202,
    response_model=GenerateCreated,
    responses={
        **INVALID,
        404: {"model": ErrorOut, "description": "unknown run or checkpoint step"},
        409: {"model": ErrorOut, "description": "the run has no checkpoint yet"},
        429: {"model": ErrorOut, "description": "this token has COLLAGE_PLAYGROUND_PER_USER generations in flight"},
        503: {"model": ErrorOut, "description": "stored but could not be queued"},
    },
)
def generate(
    response: Response,
    body: GenerateRequest,
    session: SessionDep,
    token: CurrentUser,
    settings: SettingsDep,
    engine: EngineDep,  # the job's lifecycle is the jobs store's: its own transactions, shared with the workers
    dispatcher: DispatcherDep,
) -> GenerateCreated:
    """Queue a generation: each model (a run's checkpoint by step, `best` or `last`, or a base model) completes the
    prompt with its images `num_generations` times on a worker of the run's queue; with an `answer`, every reward of
    the run scores each completion. With `tools` (by default the first run model's own) each completion is a
    multi-turn rollout whose trajectory comes back turn by turn. Follow it with `GET /generate/{id}`."""
    errors = _check_images(session, body.images, settings)
    if body.max_new_tokens > settings.playground_max_new_tokens:
        errors.append(("max_new_tokens", f"{body.max_new_tokens} is more than the {settings.playground_max_new_tokens} "
                                         "a generation may ask for (COLLAGE_PLAYGROUND_MAX_NEW_TOKENS)"))  # fmt: skip
    try:
        conversation, order = prompt_conversation(body.conversation(), len(body.images))
    except Refused as exc:
        errors.append((exc.path, exc.message))
    if errors:
        raise HTTPException(422, [{"path": p, "message": m} for p, m in errors])
    try:
        models: list[ResolvedModel] = [
            resolve_model(session, ref.model_dump(), i, settings) for i, ref in enumerate(body.models)
        ]
    except Refused as exc:
        raise _refused(exc) from exc
    try:
        tools = request_tools(body.tools, models, settings)
    except Refused as exc:
        raise _refused(exc) from exc
    runs = [m for m in models if m.run is not None]
    queue = runs[0].queue if runs else "default"  # a generation runs on one worker: the first run's queue
    job_request = {
        "models": [m.to_json() for m in models],
        "prompt": conversation,
        "images": [body.images[i] for i in order],
        "answer": body.answer,
        "columns": body.columns or {},
        "num_generations": body.num_generations,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_new_tokens": body.max_new_tokens,
        "seed": body.seed,
        "tools": tools,
        "max_tool_calling_iterations": request_tool_calls(body.max_tool_calling_iterations, models),
    }
    job = jobs.new_job(JobKind.GENERATE, queue, job_request, run_id=runs[0].run if runs else None, created_by=token)
    busy = jobs.admit(engine, token, job, settings.playground_per_user)  # the count and the insert: one transaction
    if busy:
        raise HTTPException(
            429,
            f"this token already has {len(busy)} generation(s) queued or running (at most "
            f"{settings.playground_per_user}, COLLAGE_PLAYGROUND_PER_USER): wait for one to end, or cancel it",
        )
    try:
        dispatcher.submit_job(job.id, queue)
    except Exception as exc:  # any broker failure: the job is ended failed, never left queued without a message
        jobs.fail_queued(engine, job.id, f"could not queue the generation: {exc}")
        raise HTTPException(503, f"generation {job.id} was stored but could not be queued: {exc}") from exc
    url = f"{API}/generate/{job.id}"
    response.headers["Location"] = url
    return GenerateCreated(id=job.id, status="queued", url=url)


def _own_generation(session: Session, job_id: str, token: ApiToken) -> Job:
    """The generation ``job_id`` if this token may see it (its own, or any for an admin); else 404, so that other
    members' generations are not even confirmed to exist."""
    job = session.get(Job, job_id) if len(job_id) <= 32 else None
    if job is None or job.kind != JobKind.GENERATE.value or not (is_admin(token) or owns(token, job.created_by)):
        raise HTTPException(404, f"no generation with id {job_id!r}")
    return job


def _waiting(engine: Engine, settings: Settings, job: Job, position: int | None) -> str:
    """What a queued generation waits for: a free worker of its queue, the trainings every live worker of its queue
    is running, or a worker to start at all."""
    where = f"queue {job.queue!r}"
    ahead = f"position {position} in {where}" if position else f"queued in {where}"
    try:
        workers = queue_workers(engine, settings, job.queue)
    except Exception:
        log.exception("could not list the live workers of %s", where)
        return ahead
    if not workers:
        return f"{ahead}: no live worker takes {where}; it starts once one does (collage worker --queues {job.queue})"
    training = [w for w in workers if w["current_run"]]
    if len(training) == len(workers):
        runs = ", ".join(f"run {w['current_run']} on {w['name']}" for w in training[:4])
        return f"{ahead}: waiting behind training: every live worker of {where} is training ({runs}); it starts when one finishes its run"
    return f"{ahead}: a free worker of {where} takes it in a moment"


SAMPLING = ("num_generations", "temperature", "top_p", "max_new_tokens", "seed")


def _sampling_shown(request: dict) -> dict:
    shown = {k: request.get(k) for k in SAMPLING}
    shown["tools"] = [t["name"] for t in request.get("tools") or []]  # a generation from before tools: none
    shown["max_tool_calling_iterations"] = request.get("max_tool_calling_iterations") if shown["tools"] else None
    return shown


def generation_out(session: Session, engine: Engine, settings: Settings, job: Job) -> GenerationOut:
    status = RunStatus(job.status)
    shown = RunStatus.RUNNING if status == RunStatus.CANCELLING else status
    position = jobs.queue_position(engine, job) if status == RunStatus.QUEUED else None
    message = _waiting(engine, settings, job, position) if status == RunStatus.QUEUED else job.message
    results = (job.result or {}).get("results") or []
    shas = list(job.request.get("images") or [])
    sizes = image_sizes(session, shas)
    return GenerationOut(
        id=job.id,
        status=shown.value,
        queue_position=position,
        message=message,
        progress=job.progress,
        queue=job.queue,
        models=[PlaygroundModelOut.model_validate(model_summary(m)) for m in job.request.get("models", [])],
        prompt=job.request.get("prompt") or [],
        images=[image_ref(sha, *sizes.get(sha, (0, 0))) for sha in shas],
        answer=job.request.get("answer"),
        sampling=_sampling_shown(job.request),
        results=[PlaygroundResult.model_validate(r) for r in results],
        error=job.error,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        worker=job.worker,
        url=f"{API}/generate/{job.id}",
    )


@router.get("/generate/{job_id}", response_model=GenerationOut, responses=NOT_FOUND)
def get_generation(
    job_id: Annotated[str, Path(max_length=64)],
    session: SessionDep,
    token: CurrentUser,
    engine: EngineDep,
    settings: SettingsDep,
) -> GenerationOut:
    """A generation's status (`queued` with its queue position and what it waits for, `running`, or how it ended)
    and, once it succeeded, each model's completions with their rewards."""
    return generation_out(session, engine, settings, _own_generation(session, job_id, token))


@router.post("/generate/{job_id}/cancel", response_model=GenerationOut, responses=NOT_FOUND)
def cancel_generation(
    job_id: Annotated[str, Path(max_length=64)],
    session: SessionDep,
    token: CurrentUser,
    engine: EngineDep,
    settings: SettingsDep,
) -> GenerationOut:
    """Cancel: a queued generation ends at once, a running one stops at its next check (between models, or at the
    next token it generates). Cancelling an ended generation changes nothing."""
    job = _own_generation(session, job_id, token)
    jobs.cancel_job(engine, job.id)
    found = jobs.get_job(engine, job.id)  # the jobs store's fresh read: the cancel was its own transaction
    if found is None:  # its run was deleted meanwhile (a generation is deleted with the run it was tied to)
        raise HTTPException(404, f"no generation with id {job_id!r}")
    return generation_out(session, engine, settings, found)
