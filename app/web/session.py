"""Browser sessions, kept server-side: the cookie holds a random id, the ``web_sessions`` table its SHA-256, the
token it stands for and the session's CSRF token. Logging out deletes the row; revoking the token deletes all
of its rows; an expired or revoked token ends its sessions even before that.

Before login, the login form's CSRF token is a double-submit cookie. Cookies are ``Secure`` when the request
came over HTTPS (directly, or through a proxy listed in COLLAGE_FORWARDED_ALLOW_IPS that says so).

Nothing of a session is kept in the web process or in ``COLLAGE_HOME``: sessions, login links and the CSRF token
are rows of the store (the login form's cookie is compared with the form, not with a server secret), so every web
replica of an installation accepts a session another one started, and a logout on one ends it on all of them
(docs/scaling.md, Web replicas).
"""

from __future__ import annotations

import hmac
import secrets
from datetime import timedelta
from typing import cast
from urllib.parse import urlsplit

from fastapi import Request, Response
from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.store.engine import session_scope
from collage.app.store.tables import ApiToken, WebSession, utcnow

from ..state import engine_of
from ..store.tokens import _aware, hash_secret, usable

SESSION_COOKIE = "collage_session"
LOGIN_CSRF_COOKIE = "collage_login_csrf"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"
SESSION_LIFETIME = timedelta(days=14)
_UNSET = object()


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def start_session(request: Request, response: Response, token: ApiToken) -> None:
    """Log the browser in as ``token``: a new session row and its cookie (an old session is ended first)."""
    end_session(request, response)
    assert token.id is not None
    raw = secrets.token_urlsafe(32)
    with session_scope(engine_of(request.app)) as session:
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
        with session_scope(engine_of(request.app)) as session:
            session.execute(delete(WebSession).where(col(WebSession.id_hash) == hash_secret(raw)))
        response.delete_cookie(SESSION_COOKIE, path="/", secure=_secure(request), httponly=True, samesite="lax")
    request.state.web_session = None


def live_session(engine: Engine, id_hash: str) -> tuple[WebSession, ApiToken] | None:
    """The session with this id hash and its token, while both are live (a read, never a write)."""
    with Session(engine, expire_on_commit=False) as session:
        row = session.get(WebSession, id_hash)
        token = session.get(ApiToken, row.token_id) if row is not None else None
    if row is not None and _aware(row.expires_at) > utcnow() and usable(token):  # type: ignore[operator]
        assert token is not None
        return row, token
    return None


def current_session(request: Request) -> tuple[WebSession, ApiToken] | None:
    """The live session of this request's cookie and its token (``None``: not logged in). Cached per request."""
    cached = getattr(request.state, "web_session", _UNSET)
    if cached is not _UNSET:
        return cast("tuple[WebSession, ApiToken] | None", cached)  # what this function stored for the request
    raw = request.cookies.get(SESSION_COOKIE)
    found = live_session(engine_of(request.app), hash_secret(raw)) if raw else None
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
    """Whether a cookie-authenticated unsafe request (an API write, the login and logout forms) may go on: it comes
    from this site (:func:`cross_origin`) and carries the session's CSRF token (before login, the form cookie's)."""
    if cross_origin(request) is not None:
        return False
    live = current_session(request)
    expected = live[0].csrf if live is not None else request.cookies.get(LOGIN_CSRF_COOKIE)
    return bool(expected and submitted and hmac.compare_digest(expected, submitted))


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(scheme: str, host: str | None, port: int | None) -> str | None:
    if scheme not in _DEFAULT_PORTS or not host:
        return None
    return f"{scheme}://{host.lower()}:{port or _DEFAULT_PORTS[scheme]}"


def _origin_of(url: str) -> str | None:
    """``scheme://host:port`` of a URL (the default port spelled out); None for ``null`` or anything unparseable."""
    try:
        parts = urlsplit(url.strip())
        return _origin(parts.scheme.lower(), parts.hostname, parts.port)
    except ValueError:
        return None


def own_origin(request: Request) -> str | None:
    """This request's own origin: its scheme (``https`` when a trusted proxy says so: ProxyHeadersMiddleware) and its
    ``Host`` header."""
    return _origin(request.url.scheme, request.url.hostname, request.url.port)


def cross_origin(request: Request) -> str | None:
    """Why an unsafe request that a browser's cookie authenticates is refused as cross-origin, or None (OWASP's
    "verify the origin with standard headers"). Its ``Origin`` must be this site's; ``null`` (an opaque origin: a
    sandboxed frame, a page that withholds its referrer) is refused too. Without ``Origin``, its ``Referer`` must
    be this site's when there is one. A request with neither (current browsers send ``Origin`` with every unsafe
    request; scripts may not) rests on the CSRF token alone. Bearer-token requests never get here: no browser
    attaches a bearer token on its own."""
    own = own_origin(request)
    origin = request.headers.get("origin")
    if origin is not None:
        if own is None or _origin_of(origin) != own:
            return f"Origin {origin[:200]!r} is not this site"
        return None
    referer = request.headers.get("referer")
    if referer and (own is None or _origin_of(referer) != own):
        return "the Referer is not this site"
    return None
