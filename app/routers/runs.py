"""Runs: create, list, read, cancel, resume, clone, delete, metrics, events, live stream.

The SQL behind these routes lives in the store (``app/store/queries.py`` for the listings, ``app/store/runs.py`` for
a run's details, its edits and their audit entries, ``app/store/writer.py`` for its transitions); a route does its
reads and its own writes in the request's one session (``SessionDep``)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session

from collage.app.core.settings import Settings
from collage.app.core.status import RunStatus
from collage.app.store.tables import ENDED, ApiToken, Run
from collage.training.config import ConfigError, RunConfig, apply_overrides, parse_config

from ..auth import FORBIDDEN, UNAUTHORIZED, Responses, check_may_change, is_admin, require_token, still_authorised
from ..deps import CurrentUser, CursorKeyDep, DispatcherDep, EngineDep, SessionDep, SettingsDep, WriterDep
from ..schemas import (
    CloneRequest,
    ErrorOut,
    EventOut,
    EventPage,
    RunCreated,
    RunEdit,
    RunOut,
    RunPage,
    ValidationErrorOut,
)
from ..store import queries
from ..store import runs as store
from ..store.faults import STORE_FAULTS
from ..store.queueing import RESUME_EVENT, queue_of
from ..store.text import TRACEBACK_LEVEL, public_error
from .common import get_run_or_404, run_out, run_url, set_best_model_metric
from .launch import LauncherDep, validation_error
from .workers import queue_workers

log = logging.getLogger("collage.api")

INT_MAX = 2**31 - 1  # steps and counts are 32-bit integers in the store

router = APIRouter(tags=["runs"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

NOT_FOUND: Responses = {404: {"model": ErrorOut, "description": "no such run"}}
CONFLICT: Responses = {409: {"model": ErrorOut, "description": "not allowed in the run's current status"}}
INVALID: Responses = {422: {"model": ValidationErrorOut, "description": "every bad field, by key path"}}


@dataclass(frozen=True)
class RunDetails:
    """``GET /runs/{id}``'s answer, which the routes that change a run answer with too, as the caller may see it."""

    session: Session
    token: ApiToken
    engine: Engine  # the worker registry is read in a short session of its own (see routers/workers.py)
    settings: Settings

    def of(self, run_id: str) -> RunOut:
        session = self.session
        run = get_run_or_404(session, run_id)
        tags = queries.run_tags(session, [run.id])[run.id]
        reward = queries.latest_metric(session, [run.id], "reward").get(run.id)
        out = run_out(run, tags, reward, with_config=True, creators=store.creator_names(session, [run]))
        out.eval_reward, out.best_eval_reward = queries.eval_rewards(session, [run]).get(run.id, (None, None))
        set_best_model_metric(out, queries.best_model_metrics(session, [run]), run)
        out.notes = run.notes
        if is_admin(self.token):
            out.error_detail = store.error_detail(session, run)
        else:
            out.error = public_error(out.error)
        if run.status == RunStatus.QUEUED:
            workers = self._workers_of(queue_of(run.config))
            out.queue_position, out.queue_estimate_s = store.queue_place(session, run, workers)
            out.queue_workers = None if workers is None else len(workers)
        return out

    def fresh(self, run_id: str) -> RunOut:
        """The answer after a change written in another transaction (the writer's) or committed just now: what the
        session read before is read again."""
        self.session.expire_all()
        return self.of(run_id)

    def _workers_of(self, queue: str) -> list[dict[str, Any]] | None:
        """The live workers of ``queue``; None when the registry cannot be read (no answer rather than no run)."""
        try:
            return queue_workers(self.engine, self.settings, queue)
        except Exception:
            log.exception("could not list the live workers of queue %s", queue)
            return None


async def _run_details(session: SessionDep, token: CurrentUser, engine: EngineDep, settings: SettingsDep) -> RunDetails:
    return RunDetails(session, token, engine, settings)


RunDetailsDep = Annotated[RunDetails, Depends(_run_details)]


@router.post("/runs", status_code=201, response_model=RunCreated, responses=INVALID)
def create_run(
    response: Response, config: Annotated[RunConfig, Body()], token: CurrentUser, launcher: LauncherDep
) -> RunCreated:
    """Validate the whole config, store the run as `queued` and hand it to the workers."""
    run = launcher.create(config, token)
    response.headers["Location"] = run_url(run.id)
    return RunCreated(id=run.id, status=RunStatus.QUEUED, url=run_url(run.id))


@router.get("/runs", response_model=RunPage)
def list_runs(
    session: SessionDep,
    token: CurrentUser,
    key: CursorKeyDep,  # cursors are signed: a changed one is refused
    status: Annotated[str | None, Query(max_length=16)] = None,
    tag: Annotated[str | None, Query(max_length=100)] = None,
    algorithm: Annotated[str | None, Query(max_length=16)] = None,
    q: Annotated[str | None, Query(max_length=200, description="text in the run name, or an exact id")] = None,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> RunPage:
    try:
        runs, next_cursor = queries.list_runs(session, status, tag, algorithm, q, cursor, limit, key=key)
    except queries.BadCursor as exc:
        raise HTTPException(400, str(exc)) from exc
    ids = [r.id for r in runs]
    tags = queries.run_tags(session, ids)
    rewards = queries.latest_metric(session, ids, "reward")
    evals = queries.eval_rewards(session, runs)
    creators = store.creator_names(session, runs)
    items = [run_out(r, tags[r.id], rewards.get(r.id), creators=creators) for r in runs]
    ranked = queries.best_model_metrics(session, runs)
    for item, run in zip(items, runs, strict=True):
        item.eval_reward, item.best_eval_reward = evals.get(item.id, (None, None))
        set_best_model_metric(item, ranked, run)
    if not is_admin(token):
        for item in items:
            item.error = public_error(item.error)
    return RunPage(items=items, next_cursor=next_cursor)


@router.get("/runs/{run_id}", response_model=RunOut, responses=NOT_FOUND)
def get_run(run_id: str, details: RunDetailsDep) -> RunOut:
    """The run with its config and notes; a queued run also with its place in its queue and an estimate of the
    wait (see `queue_position`, `queue_estimate_s`)."""
    return details.of(run_id)


@router.patch("/runs/{run_id}", response_model=RunOut, responses={**NOT_FOUND, **FORBIDDEN, **INVALID})
def edit_run(run_id: str, body: RunEdit, session: SessionDep, token: CurrentUser, details: RunDetailsDep) -> RunOut:
    """Change a run's tags (replaced as a whole; the run's config keeps them too) and notes (`null` or `""`
    clears them), in any status. Members may edit only their own runs."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "edit")
    run_id = run.id
    set_notes = "notes" in body.model_fields_set
    if not store.edit_run(session, run_id, token.name, tags=body.tags, notes=body.notes, set_notes=set_notes):
        raise HTTPException(404, f"no run with id {run_id!r}")
    return details.fresh(run_id)


@router.post("/runs/{run_id}/cancel", response_model=RunOut, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN})
def cancel_run(
    run_id: str,
    session: SessionDep,
    token: CurrentUser,
    writer: WriterDep,
    dispatcher: DispatcherDep,
    details: RunDetailsDep,
) -> RunOut:
    """A queued run is cancelled at once; a running one checkpoints at its next step, then stops."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "cancel")
    if writer.transition(
        run.id, [RunStatus.QUEUED], RunStatus.CANCELLED, message="cancelled before it started", actor=token.name
    ):
        pass
    elif writer.transition(
        run.id,
        [RunStatus.RUNNING],
        RunStatus.CANCELLING,
        message="cancel requested: checkpoint, then stop",
        actor=token.name,
    ):
        dispatcher.cancel(run.id)
    else:
        now = writer.run_status(run.id)
        raise HTTPException(409, f"run {run.id} is {now}: only queued or running runs can be cancelled")
    store.record_action(session, token.name, "run.cancel", run)
    return details.fresh(run.id)


@router.post("/runs/{run_id}/resume", response_model=RunOut, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN})
def resume_run(
    run_id: str,
    session: SessionDep,
    token: CurrentUser,
    writer: WriterDep,
    launcher: LauncherDep,
    details: RunDetailsDep,
) -> RunOut:
    """Queue a failed or cancelled run again as a new attempt; it continues from its last checkpoint."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "resume")
    resumed = writer.transition(
        run.id,
        [RunStatus.FAILED, RunStatus.CANCELLED],
        RunStatus.QUEUED,
        message=f"{RESUME_EVENT}: attempt {run.attempt + 1}",
        actor=token.name,
        when_attempt=run.attempt,  # of two concurrent resumes, one wins
        attempt=Run.attempt + 1,
        error=None,
        finished_at=None,
        worker=None,
    )
    if not resumed:
        now = writer.run_status(run.id)
        raise HTTPException(409, f"run {run.id} is {now}: only failed or cancelled runs can be resumed")
    store.record_action(session, token.name, "run.resume", run)
    run_id = run.id
    session.expire_all()  # the writer's transaction changed the run: dispatch it as it is now
    launcher.dispatch(get_run_or_404(session, run_id))
    return details.fresh(run_id)


@router.post("/runs/{run_id}/clone", status_code=201, response_model=RunCreated, responses={**NOT_FOUND, **INVALID})
def clone_run(
    run_id: str,
    response: Response,
    session: SessionDep,
    token: CurrentUser,
    launcher: LauncherDep,
    body: Annotated[CloneRequest | None, Body()] = None,
) -> RunCreated:
    """A new run with the same config, changed by ``overrides``."""
    source = get_run_or_404(session, run_id)
    overrides = body.overrides if body else {}
    try:
        data = apply_overrides(source.config, overrides.items())
        if "name" not in overrides:
            data["name"] = f"{source.name}-clone"
        config = parse_config(data)
    except ConfigError as exc:
        raise validation_error(exc.errors) from exc
    run = launcher.create(config, token, parent_id=source.id)
    response.headers["Location"] = run_url(run.id)
    return RunCreated(id=run.id, status=RunStatus.QUEUED, url=run_url(run.id))


@router.delete("/runs/{run_id}", status_code=204, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN})
def delete_run(run_id: str, session: SessionDep, token: CurrentUser, writer: WriterDep) -> Response:
    """Only a run that has ended; its images stay (other runs may share them). The audit log keeps who did it."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "delete")
    if run.status not in ENDED:
        raise HTTPException(409, f"run {run.id} is {run.status}: cancel it first, only ended runs can be deleted")
    if not writer.delete_run(run.id, actor=token.name):  # conditional: of concurrent deletes, one wins
        now = writer.run_status(run.id)
        if now is None:
            raise HTTPException(404, f"no run with id {run_id!r}")
        raise HTTPException(409, f"run {run.id} is {now}: cancel it first, only ended runs can be deleted")
    return Response(status_code=204)


@router.get("/runs/{run_id}/metrics", response_model=dict[str, list[tuple[int, float | None]]], responses=NOT_FOUND)
def get_metrics(
    run_id: str,
    session: SessionDep,
    keys: Annotated[
        list[str] | None, Query(description="metric names; repeat or comma-separate; all if absent")
    ] = None,
    from_step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    to_step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    max_points: Annotated[
        int,
        Query(
            ge=3,
            le=100_000,
            description="points per key (default 2000); above it each bucket of steps keeps its min and max",
        ),
    ] = 2000,
) -> Response:
    get_run_or_404(session, run_id)
    names = [k for item in keys or [] for k in item.split(",") if k] or None
    if names and any(len(k) > 100 for k in names):
        raise validation_error([("query.keys", "metric names are at most 100 characters")])
    # tens of thousands of [step, value] pairs for a long run: written as JSON straight from the store's arrays, not
    # validated one by one against response_model (which the API documentation still shows)
    body = queries.metrics_json(session, run_id, names, from_step, to_step, max_points)
    return Response(body, media_type="application/json")


@router.get("/runs/{run_id}/events", response_model=EventPage, responses=NOT_FOUND)
def get_events(
    run_id: str,
    session: SessionDep,
    token: CurrentUser,
    after: Annotated[int | None, Query(ge=0, le=2**62, description="only events with a larger id")] = None,
    level: Annotated[str | None, Query(pattern="^(debug|info|warning|error|traceback)$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> EventPage:
    """The run's events, oldest first. Tracebacks (level `traceback`) name server paths and code: admins only."""
    get_run_or_404(session, run_id)
    admin = is_admin(token)
    if level == TRACEBACK_LEVEL and not admin:
        return EventPage(items=[], last_id=after)
    events = queries.query_events(session, run_id, after, limit, level)
    # last_id covers the hidden events too, so a member's next page starts after them
    items = [
        EventOut(id=e.id, time=e.time, level=e.level, message=e.message)
        for e in events
        if admin or e.level != TRACEBACK_LEVEL
    ]
    return EventPage(items=items, last_id=events[-1].id if events else after)


RECHECK_EVERY = 2.0  # seconds between re-reads of a stream's token or session
# seconds a stream may go without sending anything before it sends an SSE comment: a proxy (nginx: 60 s, a cloud
# load balancer: 60 s or less) ends a response that stays quiet longer, as a queued or a slow run's stream does
KEEPALIVE_EVERY = 15.0
KEEPALIVE = ": keep-alive\n\n"  # a comment line: EventSource ignores it


@router.get(
    "/runs/{run_id}/stream",
    responses={**NOT_FOUND, 200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
)
async def stream_run(
    run_id: str,
    request: Request,
    engine: EngineDep,
    token: CurrentUser,
    poll: Annotated[float, Query(ge=0.1, le=10.0, description="seconds between checks")] = 1.0,
    after_step: Annotated[
        int, Query(ge=-1, le=INT_MAX, description="send `metrics` only for steps after this one (-1: every step)")
    ] = -1,
) -> StreamingResponse:
    """Server-sent events: `status` and `progress` on change, `metrics` per new step; ends when the run ends.
    Non-finite values (a NaN loss) are sent as `null`: JSON has no NaN.

    The caller's token or browser session is checked again every few seconds: once it is revoked, expired or
    logged out the stream sends `unauthorized` and ends. A store that fails mid-stream ends it with `unavailable`
    (the client reconnects). A stream with nothing to send for 15 s sends the comment `: keep-alive`, so that a
    proxy never takes it for a dead connection."""
    state, _ = await run_in_threadpool(store.run_snapshot, engine, run_id, INT_MAX)
    if state is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    admin = is_admin(token)

    async def events():
        last_status, last_step, metric_step = None, None, after_step
        recheck_at = time.monotonic() + RECHECK_EVERY
        sent_at = time.monotonic()  # when the stream last sent something (the response's headers count)
        try:
            while True:
                state, metrics = await run_in_threadpool(store.run_snapshot, engine, run_id, metric_step)
                sent_at = time.monotonic() if (state is None or state["status"] != last_status
                                               or state["step"] != last_step or metrics) else sent_at  # fmt: skip
                if state is None:
                    yield _sse("status", {"status": "deleted"})
                    return
                if not admin:
                    state["error"] = public_error(state["error"])
                if state["status"] != last_status:
                    last_status = state["status"]
                    yield _sse("status", state)
                if state["step"] != last_step:
                    last_step = state["step"]
                    yield _sse("progress", {"step": state["step"], "max_steps": state["max_steps"]})
                for step, values in metrics.items():
                    metric_step = max(metric_step, step)
                    yield _sse("metrics", {"step": step, **values})
                if state["status"] in ENDED:
                    return
                # wait `poll` seconds, in slices of at most RECHECK_EVERY: the credentials are re-read on time even
                # when the client asked for a slow poll
                wake = time.monotonic() + poll
                while True:
                    if await request.is_disconnected():
                        return
                    if time.monotonic() >= recheck_at:
                        if not await run_in_threadpool(still_authorised, request):
                            yield _sse("unauthorized", {"detail": "the token or session was revoked, expired or ended"})
                            return
                        recheck_at = time.monotonic() + RECHECK_EVERY
                    if time.monotonic() - sent_at >= KEEPALIVE_EVERY:
                        yield KEEPALIVE
                        sent_at = time.monotonic()
                    left = wake - time.monotonic()
                    if left <= 0:
                        break
                    due = min(recheck_at, sent_at + KEEPALIVE_EVERY) - time.monotonic()
                    await asyncio.sleep(min(left, max(0.0, due) + 0.01))
        except STORE_FAULTS as exc:  # the answer has begun: no 503 now; end it, the client reconnects
            log.warning("run %s stream ended: the store failed (%s)", run_id, type(exc).__name__)
            yield _sse("unavailable", {"detail": "the run store is unavailable: reconnect shortly"})

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(_finite(data), default=str, allow_nan=False)}\n\n"
