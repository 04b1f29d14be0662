"""Browser sessions, kept server-side: the cookie holds a random id, the ``web_sessions`` table its SHA-256, the
token it stands for and the session's CSRF token. Logging out deletes the row; revoking the token deletes all
of its rows; an expired or revoked token ends its sessions even before that.

Before login, the login form's CSRF token is a double-submit cookie. Cookies are ``Secure`` when the request
came over HTTPS (directly, or through a proxy listed in COLLAGE_FORWARDED_ALLOW_IPS that says so).

``session_secret`` is the installation's signing key (``$COLLAGE_HOME/secret``, mode 0600): it signs API
cursors; every web node of one installation shares it when they share ``COLLAGE_HOME``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from datetime import timedelta
from pathlib import Path

from fastapi import Request, Response
from sqlalchemy import delete
from sqlmodel import Session, col

from ..db import session_scope
from ..models import ApiToken, WebSession, utcnow
from ..store.tokens import _aware, hash_secret, usable

SESSION_COOKIE = "collage_session"
LOGIN_CSRF_COOKIE = "collage_login_csrf"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"
SESSION_LIFETIME = timedelta(days=14)
_UNSET = object()


def session_secret(home: Path) -> str:
    path = home / "secret"
    if path.is_file():
        value = path.read_text().strip()
        if value:
            return value
    home.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(48)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")
    os.chmod(path, 0o600)
    return value


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def start_session(request: Request, response: Response, token: ApiToken) -> None:
    """Log the browser in as ``token``: a new session row and its cookie (an old session is ended first)."""
    end_session(request, response)
    assert token.id is not None
    raw = secrets.token_urlsafe(32)
    with session_scope(request.app.state.engine) as session:
        session.add(
            WebSession(
                id_hash=hash_secret(raw),
                token_id=token.id,
                csrf=secrets.token_urlsafe(32),
                expires_at=utcnow() + SESSION_LIFETIME,
            )
        )
    response.set_cookie(
        SESSION_COOKIE,
        raw,
        max_age=int(SESSION_LIFETIME.total_seconds()),
        httponly=True,
        secure=_secure(request),
        samesite="lax",
        path="/",
    )
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/")


def end_session(request: Request, response: Response) -> None:
    raw = request.cookies.get(SESSION_COOKIE)
    if raw:
        with session_scope(request.app.state.engine) as session:
            session.execute(delete(WebSession).where(col(WebSession.id_hash) == hash_secret(raw)))
        response.delete_cookie(SESSION_COOKIE, path="/", secure=_secure(request), httponly=True, samesite="lax")
    request.state.web_session = None


def current_session(request: Request) -> tuple[WebSession, ApiToken] | None:
    """The live session of this request's cookie and its token (``None``: not logged in). Cached per request."""
    cached = getattr(request.state, "web_session", _UNSET)
    if cached is not _UNSET:
        return cached
    found = None
    raw = request.cookies.get(SESSION_COOKIE)
    if raw:
        with Session(request.app.state.engine, expire_on_commit=False) as session:
            row = session.get(WebSession, hash_secret(raw))
            token = session.get(ApiToken, row.token_id) if row is not None else None
            if row is not None and _aware(row.expires_at) > utcnow() and usable(token):  # type: ignore[operator]
                assert token is not None
                found = (row, token)
    request.state.web_session = found
    return found


def csrf_token(request: Request) -> str:
    """The CSRF token to embed in this page: the session's, or before login the login-form cookie's (made on
    first use; :func:`finish_page` sets the cookie)."""
    live = current_session(request)
    if live is not None:
        return live[0].csrf
    value = request.cookies.get(LOGIN_CSRF_COOKIE) or getattr(request.state, "new_login_csrf", None)
    if not value:
        value = secrets.token_urlsafe(32)
        request.state.new_login_csrf = value
    return value


def finish_page(request: Request, response: Response) -> Response:
    value = getattr(request.state, "new_login_csrf", None)
    if value:
        response.set_cookie(
            LOGIN_CSRF_COOKIE, value, max_age=3600, httponly=True, secure=_secure(request), samesite="strict", path="/"
        )
    return response


def csrf_ok(request: Request, submitted: str | None) -> bool:
    live = current_session(request)
    expected = live[0].csrf if live is not None else request.cookies.get(LOGIN_CSRF_COOKIE)
    return bool(expected and submitted and hmac.compare_digest(expected, submitted))
