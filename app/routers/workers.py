"""The live workers (``GET /workers``): what the operations page shows."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from sqlalchemy import select
from sqlmodel import Session, col

from collage.app.store.workers import live_workers

from ..auth import UNAUTHORIZED, require_token
from ..models import Run, utcnow
from ..schemas import GpuInfo, WorkerOut, WorkerRun, WorkersOut
from .common import get_session, run_url

router = APIRouter(tags=["workers"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)


def live_within(request: Request) -> float:
    """A worker is live when seen within three heartbeat intervals (plus 5 s), as ``GET /health`` counts them."""
    return 3 * request.app.state.settings.heartbeat_interval + 5


def _aware(value):
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


@router.get("/workers", response_model=WorkersOut)
def list_workers(request: Request, session: Annotated[Session, Depends(get_session)]) -> WorkersOut:
    """Each live worker: name, host, queues, GPU slot and GPUs (model, memory, utilisation when known), the run it
    is training (if any), and how long ago it last reported."""
    within = live_within(request)
    workers = live_workers(request.app.state.engine, within=within)
    run_ids = {w["current_run"] for w in workers if w["current_run"]}
    runs = {}
    if run_ids:
        rows = session.execute(
            select(col(Run.id), col(Run.name), col(Run.status)).where(col(Run.id).in_(run_ids))
        ).all()
        runs = {r.id: (r.name, r.status) for r in rows}
    now = utcnow()
    items = []
    for w in workers:
        last_seen = _aware(datetime.fromisoformat(w["last_seen"]))
        run = None
        if w["current_run"]:
            name, status = runs.get(w["current_run"], (None, None))
            run = WorkerRun(id=w["current_run"], name=name, status=status, url=run_url(w["current_run"]))
        gpus = [GpuInfo.model_validate(g) for g in w["gpu_info"]] if w.get("gpu_info") else None
        items.append(
            WorkerOut(
                name=w["name"],
                hostname=w["hostname"],
                pid=w["pid"],
                queues=w["queues"] or [],
                gpu_slots=w["gpu_slots"] or [],
                gpus=gpus,
                current_run=run,
                started_at=_aware(datetime.fromisoformat(w["started_at"])),
                last_seen=last_seen,
                heartbeat_age_s=round(max(0.0, (_aware(now) - last_seen).total_seconds()), 1),
            )
        )
    return WorkersOut(items=items, live_within_s=within)
