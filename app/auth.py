"""Bearer-token authentication for every route but ``/health``."""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .models import ApiToken
from .store.tokens import verify_token

bearer = HTTPBearer(auto_error=False, description="an API token from `collage token create`")

UNAUTHORIZED = {401: {"description": "missing or invalid API token"}}


async def require_token(request: Request) -> ApiToken:
    credentials: HTTPAuthorizationCredentials | None = await bearer(request)
    token = credentials.credentials if credentials is not None else None
    if not token:
        raise HTTPException(
            401, "missing API token: send 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"}
        )
    found = await run_in_threadpool(verify_token, request.app.state.engine, token)
    if found is None:
        raise HTTPException(401, "invalid or revoked API token", {"WWW-Authenticate": "Bearer"})
    return found
