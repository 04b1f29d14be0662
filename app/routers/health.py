"""Liveness of the store, the broker and the workers, and the free space of the disks Collage writes to (this web
node's, and each worker's as its last heartbeat measured it); the one API route that answers without a token (then
only ok / not ok)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.engine import Engine

from collage.app.core.settings import Settings
from collage.training.infra.diskspace import existing_ancestor, space

from ..deps import DispatcherDep, EngineDep, MaybeUser, SettingsDep
from ..schemas import HealthOut
from ..store.faults import sqlite_path
from ..store.health import store_health

router = APIRouter(tags=["health"])


class HealthBrief(BaseModel):
    """What /health says without a token."""

    ok: bool


class FileSystemOut(BaseModel):
    paths: dict[str, str] = Field(description="what Collage keeps on this file system: home, artifacts, store, broker")
    free_bytes: int
    total_bytes: int
    low: bool = Field(description="less free than COLLAGE_MIN_FREE_DISK_MB: runs may fail for lack of space soon")


class DiskOut(BaseModel):
    ok: bool = Field(description="no file system is low on space")
    min_free_bytes: int
    filesystems: list[FileSystemOut]
    errors: dict[str, str] = Field(default_factory=dict, description="paths whose space could not be read")


class WorkerDiskOut(BaseModel):
    """A worker's file systems (its home, its artifacts or cache of the bucket) as its last heartbeat measured
    them, flagged against this web node's COLLAGE_MIN_FREE_DISK_MB."""

    ok: bool = Field(description="no file system of the worker is low on space")
    filesystems: list[FileSystemOut]


def _worker_disk(reported: Any, minimum: int) -> dict[str, Any] | None:
    """A worker's reported disks with their ``low`` flags; None when it reported none (started before 0011)."""
    if not isinstance(reported, list) or not reported:
        return None
    filesystems = [
        FileSystemOut(
            paths=dict(f.get("paths") or {}),
            free_bytes=int(f["free_bytes"]),
            total_bytes=int(f["total_bytes"]),
            low=int(f["free_bytes"]) < minimum,
        )  # fmt: skip
        for f in reported
        if isinstance(f, dict) and "free_bytes" in f and "total_bytes" in f
    ]
    return WorkerDiskOut(ok=not any(f.low for f in filesystems), filesystems=filesystems).model_dump()


class HealthDetail(HealthOut):
    """What /health says with a token. ``ok`` is about the service (store and broker); a disk low on space is
    reported in ``disk`` before it fills, without taking the service out of a load balancer."""

    disk: DiskOut


def _disk(settings: Settings, engine: Engine) -> DiskOut:
    """The free space of each file system holding the home, the artifacts and the SQLite store and broker."""
    paths: dict[str, Path] = {"home": settings.home}
    if not str(settings.artifacts).startswith("s3:"):
        paths["artifacts"] = settings.artifacts
    store = sqlite_path(engine)
    if store is not None:
        paths["store"] = store.parent
    if settings.broker_url.startswith("sqla+sqlite:///"):
        paths["broker"] = Path(settings.broker_url.removeprefix("sqla+sqlite:///")).parent
    minimum = settings.min_free_disk_mb << 20
    devices: dict[int, FileSystemOut] = {}
    errors: dict[str, str] = {}
    for name, path in paths.items():
        try:
            where = existing_ancestor(path)
            device, free = where.stat().st_dev, space(where)
        except OSError as exc:
            errors[name] = f"{path}: {exc.strerror or exc}"
            continue
        if device not in devices:
            devices[device] = FileSystemOut(paths={}, free_bytes=free.free, total_bytes=free.total,
                                            low=free.free < minimum)  # fmt: skip
        devices[device].paths[name] = str(path)
    filesystems = list(devices.values())
    return DiskOut(
        ok=not any(f.low for f in filesystems), min_free_bytes=minimum, filesystems=filesystems, errors=errors
    )


@router.get(
    "/health", response_model=HealthDetail | HealthBrief, responses={503: {"model": HealthDetail | HealthBrief}}
)
async def health(token: MaybeUser, engine: EngineDep, dispatcher: DispatcherDep, settings: SettingsDep):
    """ok / not ok for anyone (load balancers, compose health checks); with a token, the details: store,
    broker, live workers and the disks' free space (host names, pids, paths stay behind authentication)."""
    store = await run_in_threadpool(store_health, engine)
    try:
        info = await run_in_threadpool(dispatcher.health)
    except Exception as exc:  # noqa: BLE001
        info = {"broker": {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, "workers": []}
    broker = info.get("broker", {"ok": False})
    ok = bool(store["ok"] and broker.get("ok"))
    status = 200 if ok else 503
    if token is None:
        return JSONResponse(status_code=status, content=HealthBrief(ok=ok).model_dump())
    disk = await run_in_threadpool(_disk, settings, engine)
    # each worker's disks, flagged like this node's own (a low one is a warning: it does not change `ok`)
    workers = [{**w, "disk": _worker_disk(w.get("disk"), disk.min_free_bytes)} for w in info.get("workers", [])]
    body = HealthDetail(ok=ok, store=store, broker=broker, workers=workers, disk=disk)
    return JSONResponse(status_code=status, content=body.model_dump())
