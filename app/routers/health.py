"""Liveness of the store, the broker and the workers; the one route without a token."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from ..db import DatabaseNotMigrated, check_migrated
from ..schemas import HealthOut

router = APIRouter(tags=["health"])


def _store(engine) -> dict:
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        check_migrated(engine)
    except DatabaseNotMigrated as exc:
        return {"ok": False, "dialect": engine.dialect.name, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - report any store failure
        return {"ok": False, "dialect": engine.dialect.name, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "dialect": engine.dialect.name}


@router.get("/health", response_model=HealthOut, responses={503: {"model": HealthOut}})
async def health(request: Request):
    store = await run_in_threadpool(_store, request.app.state.engine)
    try:
        info = await run_in_threadpool(request.app.state.dispatcher.health)
    except Exception as exc:  # noqa: BLE001
        info = {"broker": {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, "workers": []}
    broker = info.get("broker", {"ok": False})
    body = HealthOut(
        ok=bool(store["ok"] and broker.get("ok")), store=store, broker=broker, workers=info.get("workers", [])
    )
    return JSONResponse(status_code=200 if body.ok else 503, content=body.model_dump())
