"""Runs: create, list, read, cancel, resume, clone, delete, metrics, events, live stream."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import delete, select
from sqlmodel import Session, col

from collage.training.config import ConfigError, RunConfig, apply_overrides, parse_config

from ..auth import FORBIDDEN, UNAUTHORIZED, Responses, check_may_change, require_token, still_authorised
from ..dataset_probe import probe_errors
from ..db import session_scope
from ..models import ENDED, ApiToken, Event, Metric, Run, RunTag, utcnow
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
from ..status import RunStatus
from ..store import queries
from ..store.faults import STORE_FAULTS
from ..store.queueing import RESUME_EVENT, queue_of, queued_runs
from ..store.text import TRACEBACK_LEVEL, has_traceback, public_error
from ..store.tokens import TokenRole, audit
from ..validation import semantic_errors
from .common import creator_names, get_run_or_404, get_session, run_out, run_url

log = logging.getLogger("collage.api")

INT_MAX = 2**31 - 1  # steps and counts are 32-bit integers in the store

router = APIRouter(tags=["runs"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

NOT_FOUND: Responses = {404: {"model": ErrorOut, "description": "no such run"}}
CONFLICT: Responses = {409: {"model": ErrorOut, "description": "not allowed in the run's current status"}}
INVALID: Responses = {422: {"model": ValidationErrorOut, "description": "every bad field, by key path"}}


def _validation_error(errors: list[tuple[str, str]]) -> HTTPException:
    return HTTPException(422, [{"path": p, "message": m} for p, m in errors])


def _dispatch(request: Request, run: Run) -> None:
    """Hand a stored run to the dispatcher; if that fails the run is marked failed, never left dangling."""
    try:
        request.app.state.dispatcher.submit(run.id, run.config.get("resources", {}).get("queue", "default"))
    except Exception as exc:  # any broker failure: the run is marked failed and the error re-raised as 503
        request.app.state.writer.transition(
            run.id, [RunStatus.QUEUED], RunStatus.FAILED, error=f"could not queue the run: {exc}"
        )
        raise HTTPException(503, f"run {run.id} was stored but could not be queued: {exc}") from exc


def _create(request: Request, config: RunConfig, token: ApiToken, parent_id: str | None = None) -> Run:
    errors = semantic_errors(config, request.app.state.settings)
    if not errors:  # the dataset is read only once its source may be read at all
        errors = probe_errors(request, config, token)
    if errors:
        raise _validation_error(errors)
    run = request.app.state.writer.create_run(config.model_dump(mode="json"), parent_id=parent_id, created_by=token)
    _dispatch(request, run)
    return run


@router.post("/runs", status_code=201, response_model=RunCreated, responses=INVALID)
def create_run(
    request: Request,
    response: Response,
    config: Annotated[RunConfig, Body()],
    token: Annotated[ApiToken, Depends(require_token)],
) -> RunCreated:
    """Validate the whole config, store the run as `queued` and hand it to the workers."""
    run = _create(request, config, token)
    response.headers["Location"] = run_url(run.id)
    return RunCreated(id=run.id, status=RunStatus.QUEUED, url=run_url(run.id))


@router.get("/runs", response_model=RunPage)
def list_runs(
    request: Request,
    session: Annotated[Session, Depends(get_session)],
    status: Annotated[str | None, Query(max_length=16)] = None,
    tag: Annotated[str | None, Query(max_length=100)] = None,
    algorithm: Annotated[str | None, Query(max_length=16)] = None,
    q: Annotated[str | None, Query(max_length=200, description="text in the run name, or an exact id")] = None,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> RunPage:
    try:
        key = request.app.state.cursor_key  # cursors are signed: a changed one is refused
        runs, next_cursor = queries.list_runs(session, status, tag, algorithm, q, cursor, limit, key=key)
    except queries.BadCursor as exc:
        raise HTTPException(400, str(exc)) from exc
    ids = [r.id for r in runs]
    tags = queries.run_tags(session, ids)
    rewards = queries.latest_metric(session, ids, "reward")
    evals = queries.eval_rewards(session, runs)
    creators = creator_names(session, runs)
    items = [run_out(r, tags[r.id], rewards.get(r.id), creators=creators) for r in runs]
    for item in items:
        item.eval_reward, item.best_eval_reward = evals.get(item.id, (None, None))
    if not _is_admin(request):
        for item in items:
            item.error = public_error(item.error)
    return RunPage(items=items, next_cursor=next_cursor)


def _is_admin(request: Request) -> bool:
    token = getattr(request.state, "token", None)  # set by the router's token check
    return token is not None and token.role == TokenRole.ADMIN


def _error_detail(session: Session, run: Run) -> str | None:
    """The traceback behind a failed run's error: its newest traceback event (or, for a run that failed before
    tracebacks moved there, the stored error itself)."""
    if run.error is None:
        return None
    if has_traceback(run.error):
        return run.error
    return session.scalars(
        select(col(Event.message))
        .where(col(Event.run_id) == run.id, col(Event.level) == TRACEBACK_LEVEL)
        .order_by(col(Event.id).desc())
        .limit(1)
    ).first()


@router.get("/runs/{run_id}", response_model=RunOut, responses=NOT_FOUND)
def get_run(request: Request, run_id: str, session: Annotated[Session, Depends(get_session)]) -> RunOut:
    """The run with its config and notes; a queued run also with its place in its queue and an estimate of the
    wait (see `queue_position`, `queue_estimate_s`)."""
    run = get_run_or_404(session, run_id)
    tags = queries.run_tags(session, [run.id])[run.id]
    reward = queries.latest_metric(session, [run.id], "reward").get(run.id)
    out = run_out(run, tags, reward, with_config=True, creators=creator_names(session, [run]))
    out.eval_reward, out.best_eval_reward = queries.eval_rewards(session, [run]).get(run.id, (None, None))
    out.notes = run.notes
    if _is_admin(request):
        out.error_detail = _error_detail(session, run)
    else:
        out.error = public_error(out.error)
    if run.status == RunStatus.QUEUED:
        out.queue_position, out.queue_estimate_s = queue_place(request, session, run)
        out.queue_workers = _queue_workers(request, queue_of(run.config))
    return out


RECENT_RUNS = 20  # finished runs whose durations make the estimate


def queue_place(request: Request, session: Session, run: Run) -> tuple[int | None, float | None]:
    """``(position, estimate_s)`` of a queued run.

    Position: 1-based among the queued runs of the same ``resources.queue``, in the order they were queued (a
    run's creation, or its latest resume: the broker hands runs out first in, first out).

    Estimate: with D the mean wall-clock duration (start to finish) of the last 20 succeeded runs of that queue,
    each live worker of the queue is free after the rest of its current run (D minus the time it has run so far,
    or its own pace, elapsed x steps left / steps done, once it has made progress; at least 0) or at once when
    idle; the runs ahead are handed to whichever worker is free first, D each, and the estimate is when a worker
    is free for this run. None without a live worker on the queue or without a finished run to take D from.
    """
    queue = queue_of(run.config)
    order = queued_runs(session, queue)
    position = next((i + 1 for i, q in enumerate(order) if q.run_id == run.id), None)
    if position is None:
        return None, None
    return position, _estimate(request, session, queue, position)


def _live_workers_of(request: Request, queue: str) -> list[dict[str, Any]] | None:
    """The live workers that take runs from ``queue``; None when the registry cannot be read."""
    from collage.app.store.workers import live_workers

    from .workers import live_within

    try:
        return [w for w in live_workers(request.app.state.engine, within=live_within(request))
                if queue in (w["queues"] or [])]  # fmt: skip
    except Exception:  # no answer rather than no run
        log.exception("could not list the live workers of queue %s", queue)
        return None


def _queue_workers(request: Request, queue: str) -> int | None:
    workers = _live_workers_of(request, queue)
    return None if workers is None else len(workers)


def _estimate(request: Request, session: Session, queue: str, position: int) -> float | None:
    workers = _live_workers_of(request, queue)
    if not workers:
        return None
    recent = session.execute(
        select(col(Run.config), col(Run.started_at), col(Run.finished_at))
        .where(col(Run.status) == RunStatus.SUCCEEDED, col(Run.started_at).is_not(None))
        .order_by(col(Run.finished_at).desc())
        .limit(RECENT_RUNS * 5)
    ).all()
    durations = [
        (r.finished_at - r.started_at).total_seconds()
        for r in recent
        if r.finished_at is not None and queue_of(r.config) == queue
    ][:RECENT_RUNS]
    if not durations:
        return None
    mean = sum(durations) / len(durations)
    busy_ids = [w["current_run"] for w in workers if w["current_run"]]
    busy = {
        r.id: r
        for r in session.execute(
            select(col(Run.id), col(Run.started_at), col(Run.step), col(Run.max_steps)).where(col(Run.id).in_(busy_ids))
        ).all()
    } if busy_ids else {}  # fmt: skip
    now = utcnow().replace(tzinfo=None)
    free_at = []
    for w in workers:
        current = busy.get(w["current_run"]) if w["current_run"] else None
        if current is None or current.started_at is None:
            free_at.append(0.0)
            continue
        elapsed = max(0.0, (now - current.started_at.replace(tzinfo=None)).total_seconds())
        if current.step > 0 and current.max_steps > current.step:
            left = elapsed * (current.max_steps - current.step) / current.step
        else:
            left = mean - elapsed
        free_at.append(max(0.0, left))
    for _ in range(position - 1):  # the runs ahead take the first free worker, one mean duration each
        first = min(range(len(free_at)), key=free_at.__getitem__)
        free_at[first] += mean
    return round(min(free_at), 1)


@router.patch("/runs/{run_id}", response_model=RunOut, responses={**NOT_FOUND, **FORBIDDEN, **INVALID})
def edit_run(
    run_id: str,
    request: Request,
    body: RunEdit,
    session: Annotated[Session, Depends(get_session)],
    token: Annotated[ApiToken, Depends(require_token)],
) -> RunOut:
    """Change a run's tags (replaced as a whole; the run's config keeps them too) and notes (`null` or `""`
    clears them), in any status. Members may edit only their own runs."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "edit")
    changed = []
    with session_scope(request.app.state.engine) as s:
        stored = s.get(Run, run.id)
        if stored is None:
            raise HTTPException(404, f"no run with id {run_id!r}")
        if body.tags is not None:
            tags = list(dict.fromkeys(body.tags))
            s.execute(delete(RunTag).where(col(RunTag.run_id) == run.id))
            for tag in tags:
                s.add(RunTag(run_id=run.id, tag=tag))
            stored.config = {**stored.config, "tags": tags}
            changed.append("tags")
        if "notes" in body.model_fields_set:
            stored.notes = body.notes or None
            changed.append("notes")
        if changed:
            stored.updated_at = utcnow()
            audit(s, token.name, "run.edit", run.id, f"{run.name}: {', '.join(changed)}")
    return _reload(request, run.id)


@router.post("/runs/{run_id}/cancel", response_model=RunOut, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN})
def cancel_run(
    run_id: str,
    request: Request,
    session: Annotated[Session, Depends(get_session)],
    token: Annotated[ApiToken, Depends(require_token)],
) -> RunOut:
    """A queued run is cancelled at once; a running one checkpoints at its next step, then stops."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "cancel")
    writer = request.app.state.writer
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
        request.app.state.dispatcher.cancel(run.id)
    else:
        now = writer.run_status(run.id)
        raise HTTPException(409, f"run {run.id} is {now}: only queued or running runs can be cancelled")
    _audit(request, token, "run.cancel", run)
    return _reload(request, run.id)


@router.post("/runs/{run_id}/resume", response_model=RunOut, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN})
def resume_run(
    run_id: str,
    request: Request,
    session: Annotated[Session, Depends(get_session)],
    token: Annotated[ApiToken, Depends(require_token)],
) -> RunOut:
    """Queue a failed or cancelled run again as a new attempt; it continues from its last checkpoint."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "resume")
    resumed = request.app.state.writer.transition(
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
        now = request.app.state.writer.run_status(run.id)
        raise HTTPException(409, f"run {run.id} is {now}: only failed or cancelled runs can be resumed")
    _audit(request, token, "run.resume", run)
    with _fresh(request) as fresh:
        run = get_run_or_404(fresh, run.id)
    _dispatch(request, run)
    return _reload(request, run.id)


def _audit(request: Request, token: ApiToken, action: str, run: Run) -> None:
    with session_scope(request.app.state.engine) as s:
        audit(s, token.name, action, run.id, run.name)


@router.post("/runs/{run_id}/clone", status_code=201, response_model=RunCreated, responses={**NOT_FOUND, **INVALID})
def clone_run(
    run_id: str,
    request: Request,
    response: Response,
    session: Annotated[Session, Depends(get_session)],
    token: Annotated[ApiToken, Depends(require_token)],
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
        raise _validation_error(exc.errors) from exc
    run = _create(request, config, token, parent_id=source.id)
    response.headers["Location"] = run_url(run.id)
    return RunCreated(id=run.id, status=RunStatus.QUEUED, url=run_url(run.id))


@router.delete("/runs/{run_id}", status_code=204, responses={**NOT_FOUND, **CONFLICT, **FORBIDDEN})
def delete_run(
    run_id: str,
    request: Request,
    session: Annotated[Session, Depends(get_session)],
    token: Annotated[ApiToken, Depends(require_token)],
) -> Response:
    """Only a run that has ended; its images stay (other runs may share them). The audit log keeps who did it."""
    run = get_run_or_404(session, run_id)
    check_may_change(token, run, "delete")
    if run.status not in ENDED:
        raise HTTPException(409, f"run {run.id} is {run.status}: cancel it first, only ended runs can be deleted")
    writer = request.app.state.writer
    if not writer.delete_run(run.id, actor=token.name):  # conditional: of concurrent deletes, one wins
        now = writer.run_status(run.id)
        if now is None:
            raise HTTPException(404, f"no run with id {run_id!r}")
        raise HTTPException(409, f"run {run.id} is {now}: cancel it first, only ended runs can be deleted")
    return Response(status_code=204)


@router.get("/runs/{run_id}/metrics", response_model=dict[str, list[tuple[int, float | None]]], responses=NOT_FOUND)
def get_metrics(
    run_id: str,
    session: Annotated[Session, Depends(get_session)],
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
) -> dict[str, list[list[float | None]]]:  # [step, value] pairs: response_model validates them as tuples
    get_run_or_404(session, run_id)
    names = [k for item in keys or [] for k in item.split(",") if k] or None
    if names and any(len(k) > 100 for k in names):
        raise _validation_error([("query.keys", "metric names are at most 100 characters")])
    return queries.query_metrics(session, run_id, names, from_step, to_step, max_points)


@router.get("/runs/{run_id}/events", response_model=EventPage, responses=NOT_FOUND)
def get_events(
    run_id: str,
    request: Request,
    session: Annotated[Session, Depends(get_session)],
    after: Annotated[int | None, Query(ge=0, le=2**62, description="only events with a larger id")] = None,
    level: Annotated[str | None, Query(pattern="^(debug|info|warning|error|traceback)$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> EventPage:
    """The run's events, oldest first. Tracebacks (level `traceback`) name server paths and code: admins only."""
    get_run_or_404(session, run_id)
    admin = _is_admin(request)
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


def _fresh(request: Request) -> Session:
    return Session(request.app.state.engine, expire_on_commit=False)


def _reload(request: Request, run_id: str) -> RunOut:
    with _fresh(request) as session:
        return get_run(request, run_id, session)


def _snapshot(engine, run_id: str, after_step: int) -> tuple[dict[str, Any] | None, dict[int, dict[str, float]]]:
    with Session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            return None, {}
        state = {"status": run.status, "step": run.step, "max_steps": run.max_steps, "error": run.error}
        metrics: dict[int, dict[str, float]] = {}
        for step, key, value in session.execute(
            select(col(Metric.step), col(Metric.key), col(Metric.value))
            .where(col(Metric.run_id) == run_id, col(Metric.step) > after_step)
            .order_by(col(Metric.step))
            .limit(5000)
        ):
            metrics.setdefault(step, {})[key] = value
        return state, metrics


RECHECK_EVERY = 2.0  # seconds between re-reads of a stream's token or session


@router.get(
    "/runs/{run_id}/stream",
    responses={**NOT_FOUND, 200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}},
)
async def stream_run(
    run_id: str,
    request: Request,
    poll: Annotated[float, Query(ge=0.1, le=10.0, description="seconds between checks")] = 1.0,
    after_step: Annotated[
        int, Query(ge=-1, le=INT_MAX, description="send `metrics` only for steps after this one (-1: every step)")
    ] = -1,
) -> StreamingResponse:
    """Server-sent events: `status` and `progress` on change, `metrics` per new step; ends when the run ends.
    Non-finite values (a NaN loss) are sent as `null`: JSON has no NaN.

    The caller's token or browser session is checked again every few seconds: once it is revoked, expired or
    logged out the stream sends `unauthorized` and ends. A store that fails mid-stream ends it with `unavailable`
    (the client reconnects)."""
    engine = request.app.state.engine
    state, _ = await run_in_threadpool(_snapshot, engine, run_id, INT_MAX)
    if state is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    admin = _is_admin(request)

    async def events():
        last_status, last_step, metric_step = None, None, after_step
        recheck_at = time.monotonic() + RECHECK_EVERY
        try:
            while True:
                state, metrics = await run_in_threadpool(_snapshot, engine, run_id, metric_step)
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
                    left = wake - time.monotonic()
                    if left <= 0:
                        break
                    await asyncio.sleep(min(left, max(0.0, recheck_at - time.monotonic()) + 0.01))
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
