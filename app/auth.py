"""Bearer-token authentication for every route but ``/health``."""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from .models import ApiToken
from .store.tokens import verify_token
from .web.session import CSRF_HEADER, csrf_ok, logged_in_token_id

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

bearer = HTTPBearer(auto_error=False, description="an API token from `collage token create`")

UNAUTHORIZED = {401: {"description": "missing or invalid API token"}}


def _session_token(request: Request, token_id: int) -> ApiToken | None:
    with Session(request.app.state.engine) as session:
        token = session.get(ApiToken, token_id)
    return token if token is not None and not token.revoked else None


async def require_token(request: Request) -> ApiToken:
    """A bearer token, or the browser session of someone who logged in with one (then unsafe methods also
    need the session's CSRF token in the X-CSRF-Token header)."""
    credentials: HTTPAuthorizationCredentials | None = await bearer(request)
    token = credentials.credentials if credentials is not None else None
    if not token and request.headers.get("authorization") is None:
        token_id = logged_in_token_id(request)
        if token_id is not None:
            found = await run_in_threadpool(_session_token, request, token_id)
            if found is None:
                raise HTTPException(401, "your session's API token was revoked: log in again")
            if request.method not in SAFE_METHODS and not csrf_ok(request, request.headers.get(CSRF_HEADER)):
                raise HTTPException(403, "missing or invalid CSRF token (X-CSRF-Token header)")
            return found
    if not token:
        raise HTTPException(
            401, "missing API token: send 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"}
        )
    found = await run_in_threadpool(verify_token, request.app.state.engine, token)
    if found is None:
        raise HTTPException(401, "invalid or revoked API token", {"WWW-Authenticate": "Bearer"})
    return found
