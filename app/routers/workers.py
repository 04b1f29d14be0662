"""The live workers (``GET /workers``): what the operations page shows."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Depends
from sqlalchemy.engine import Engine

from collage.app.core.settings import Settings
from collage.app.store.tables import utcnow
from collage.app.store.workers import live_workers

from ..auth import UNAUTHORIZED, require_token
from ..deps import EngineDep, SessionDep, SettingsDep
from ..schemas import GpuInfo, WorkerOut, WorkerRun, WorkersOut
from ..store.runs import run_labels
from .common import run_url

router = APIRouter(tags=["workers"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)


def live_within(settings: Settings) -> float:
    """A worker is live when seen within three heartbeat intervals (plus 5 s), as ``GET /health`` counts them."""
    return 3 * settings.heartbeat_interval + 5


def queue_workers(engine: Engine, settings: Settings, queue: str) -> list[dict[str, Any]]:
    """The live workers that take work from ``queue``. Read in the registry's own short session: the callers
    answer without them when the read fails, and a failed read must not break the request's session."""
    return [w for w in live_workers(engine, within=live_within(settings)) if queue in (w["queues"] or [])]


def _aware(value):
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


@router.get("/workers", response_model=WorkersOut)
def list_workers(session: SessionDep, engine: EngineDep, settings: SettingsDep) -> WorkersOut:
    """Each live worker: name, host, queues, GPU slot and GPUs (model, memory, utilisation when known), the run it
    is training (if any), and how long ago it last reported."""
    within = live_within(settings)
    workers = live_workers(engine, within=within)
    runs = run_labels(session, {w["current_run"] for w in workers if w["current_run"]})
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
