"""Liveness of the store, the broker and the workers; the one API route that answers without a token (then
only ok / not ok)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import text

from ..auth import token_if_valid
from ..db import DatabaseNotMigrated, check_migrated
from ..models import ApiToken
from ..schemas import HealthOut

router = APIRouter(tags=["health"])


class HealthBrief(BaseModel):
    """What /health says without a token."""

    ok: bool


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


@router.get("/health", response_model=HealthOut | HealthBrief, responses={503: {"model": HealthOut | HealthBrief}})
async def health(request: Request, token: Annotated[ApiToken | None, Depends(token_if_valid)]):
    """ok / not ok for anyone (load balancers, compose health checks); with a token, the details: store,
    broker and live workers (host names, pids, paths stay behind authentication)."""
    store = await run_in_threadpool(_store, request.app.state.engine)
    try:
        info = await run_in_threadpool(request.app.state.dispatcher.health)
    except Exception as exc:  # noqa: BLE001
        info = {"broker": {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, "workers": []}
    broker = info.get("broker", {"ok": False})
    body = HealthOut(
        ok=bool(store["ok"] and broker.get("ok")), store=store, broker=broker, workers=info.get("workers", [])
    )
    status = 200 if body.ok else 503
    if token is None:
        return JSONResponse(status_code=status, content=HealthBrief(ok=body.ok).model_dump())
    return JSONResponse(status_code=status, content=body.model_dump())
