"""Token management for admins: list, create, revoke, one-time login links, and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from collage.app.store.tables import ApiToken

from ..auth import FORBIDDEN, UNAUTHORIZED, require_admin
from ..deps import AdminUser, EngineDep, SessionDep
from ..store.tokens import (
    LINK_LIFETIME,
    TokenError,
    TokenRole,
    audit_entries,
    create_login_link,
    create_token,
    list_tokens,
    revoke_token,
)

router = APIRouter(tags=["tokens"], dependencies=[Depends(require_admin)], responses={**UNAUTHORIZED, **FORBIDDEN})

NAME = r"^[^\x00-\x1f/]+$"


class TokenOut(BaseModel):
    name: str
    role: str
    prefix: str = Field(description="the first characters of the token, to tell tokens apart; never the secret")
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked: bool


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=NAME)
    role: TokenRole = TokenRole.MEMBER
    expires_days: float | None = Field(None, gt=0, le=3650)


class TokenCreated(TokenOut):
    token: str = Field(description="the API token itself: shown only in this response")


class LoginLinkOut(BaseModel):
    url: str
    expires_in_seconds: int


class AuditOut(BaseModel):
    time: datetime
    actor: str
    action: str
    target: str
    detail: str | None


def _out(token: ApiToken) -> TokenOut:
    return TokenOut(
        name=token.name,
        role=token.role,
        prefix=token.prefix,
        created_at=token.created_at,
        last_used_at=token.last_used_at,
        expires_at=token.expires_at,
        revoked=token.revoked,
    )


@router.get("/tokens", response_model=list[TokenOut])
async def get_tokens(engine: EngineDep) -> list[TokenOut]:
    return [_out(t) for t in await run_in_threadpool(list_tokens, engine)]


@router.post("/tokens", status_code=201, response_model=TokenCreated, responses={409: {"description": "name taken"}})
async def post_token(body: TokenCreate, admin: AdminUser, engine: EngineDep) -> TokenCreated:
    try:
        secret = await run_in_threadpool(create_token, engine, body.name, body.role, body.expires_days, admin.name)
    except TokenError as exc:
        raise HTTPException(409, str(exc)) from exc
    made = next(t for t in await run_in_threadpool(list_tokens, engine) if t.name == body.name and not t.revoked)
    return TokenCreated(**_out(made).model_dump(), token=secret)


@router.delete("/tokens/{name}", status_code=204, responses={404: {"description": "no live token of that name"}})
async def delete_token(name: str, admin: AdminUser, engine: EngineDep) -> Response:
    """Revoke: the token's API access and its browser sessions end at once."""
    try:
        await run_in_threadpool(revoke_token, engine, name, admin.name)
    except TokenError as exc:
        raise HTTPException(404, str(exc)) from exc
    return Response(status_code=204)


@router.post("/tokens/{name}/link", response_model=LoginLinkOut, responses={404: {"description": "no live token"}})
async def post_login_link(request: Request, name: str, admin: AdminUser, engine: EngineDep) -> LoginLinkOut:
    """A one-time login URL for that token's owner (single use, 10 minutes)."""
    try:
        code = await run_in_threadpool(create_login_link, engine, name, admin.name)
    except TokenError as exc:
        raise HTTPException(404, str(exc)) from exc
    base = str(request.base_url).rstrip("/")
    return LoginLinkOut(url=f"{base}/login/link/{code}", expires_in_seconds=int(LINK_LIFETIME.total_seconds()))


@router.get("/audit", response_model=list[AuditOut])
def get_audit(session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> list[AuditOut]:
    """The newest entries first: who created, revoked or linked tokens, cancelled, resumed or deleted runs."""
    rows = audit_entries(session, limit)
    return [AuditOut(time=r.time, actor=r.actor, action=r.action, target=r.target, detail=r.detail) for r in rows]
