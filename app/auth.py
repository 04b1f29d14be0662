"""Who is calling: a bearer API token, or the browser session of someone who logged in with one. Every route but
``/health`` (and the login pages) needs one; token management needs the admin role."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from collage.app.store.tables import ApiToken, Run

from .state import engine_of
from .store.tokens import TokenRole, active_token, verify_token
from .web.session import CSRF_HEADER, cross_origin, csrf_ok, current_session, live_session

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

bearer = HTTPBearer(auto_error=False, description="an API token from `collage token create`")

# the ``responses`` of a route or router: status code -> its OpenAPI description (model, content, description)
Responses = dict[int | str, dict[str, Any]]

UNAUTHORIZED: Responses = {401: {"description": "missing or invalid API token"}}
FORBIDDEN: Responses = {403: {"description": "the token's role does not allow this"}}


async def optional_token(request: Request) -> ApiToken | None:
    """The caller's token, ``None`` when the request carries none; a bad one is still a 401."""
    credentials: HTTPAuthorizationCredentials | None = await bearer(request)
    token = credentials.credentials if credentials is not None else None
    if not token and not request.headers.get("authorization"):
        live = await run_in_threadpool(current_session, request)
        if live is None:
            return None
        if request.method not in SAFE_METHODS:
            if (why := cross_origin(request)) is not None:
                raise HTTPException(403, f"cross-origin request refused: {why}")
            if not csrf_ok(request, request.headers.get(CSRF_HEADER)):
                raise HTTPException(403, "missing or invalid CSRF token (X-CSRF-Token header)")
        request.state.token = live[1]
        return live[1]
    if not token:
        raise HTTPException(
            401, "missing API token: send 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"}
        )
    found = await run_in_threadpool(verify_token, engine_of(request.app), token)
    if found is None:
        raise HTTPException(401, "invalid, expired or revoked API token", {"WWW-Authenticate": "Bearer"})
    request.state.token = found
    return found


def still_authorised(request: Request) -> bool:
    """Whether the credentials this request came with are still good: its browser session (not logged out, not
    expired, its token live) or its bearer token (not revoked, not expired). Reads, never writes: long-lived
    responses (``GET /runs/{id}/stream``) ask every few seconds and end once the answer is no."""
    engine = engine_of(request.app)
    live = getattr(request.state, "web_session", None)
    if live is not None:
        return live_session(engine, live[0].id_hash) is not None
    token = getattr(request.state, "token", None)
    return token is not None and token.id is not None and active_token(engine, token.id) is not None


async def token_if_valid(request: Request) -> ApiToken | None:
    """For routes that answer everyone (``/health``): the caller's token, or ``None`` for none or a bad one."""
    try:
        return await optional_token(request)
    except HTTPException:
        return None


async def require_token(token: Annotated[ApiToken | None, Depends(optional_token)]) -> ApiToken:
    if token is None:
        raise HTTPException(
            401, "missing API token: send 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"}
        )
    return token


async def require_admin(token: Annotated[ApiToken, Depends(require_token)]) -> ApiToken:
    if not is_admin(token):
        raise HTTPException(403, f"token {token.name!r} is a member token: this needs an admin token")
    return token


def is_admin(token: ApiToken) -> bool:
    return token.role == TokenRole.ADMIN


def owns(token: ApiToken, created_by: int | None) -> bool:
    """Whether ``token`` created what ``created_by`` names (a run, a job); nothing is owned by nobody."""
    return created_by is not None and created_by == token.id


def may_change(token: ApiToken, run: Run) -> bool:
    """Admins change any run; members only the runs they created."""
    return is_admin(token) or owns(token, run.created_by)


def check_may_change(token: ApiToken, run: Run, action: str) -> None:
    if not may_change(token, run):
        raise HTTPException(403, f"only the run's creator or an admin may {action} run {run.id}")
