"""Browser sessions: a signed cookie holding the API token's id and a CSRF token.

The signing secret is made once per installation and kept in ``$COLLAGE_HOME/secret`` (mode 0600), so sessions
survive restarts and every web node of one installation shares them when they share ``COLLAGE_HOME``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import Request

SESSION_COOKIE = "collage_session"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"


def session_secret(home: Path) -> str:
    path = home / "secret"
    if path.is_file():
        value = path.read_text().strip()
        if value:
            return value
    home.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(48)
    path.touch(mode=0o600)
    path.write_text(value + "\n")
    os.chmod(path, 0o600)
    return value


def csrf_token(request: Request) -> str:
    """This session's CSRF token (made on first use)."""
    token = request.session.get("csrf")
    if not token:
        token = secrets.token_urlsafe(32)
        request.session["csrf"] = token
    return token


def csrf_ok(request: Request, submitted: str | None) -> bool:
    expected = request.session.get("csrf")
    return bool(expected and submitted and hmac.compare_digest(expected, submitted))


def logged_in_token_id(request: Request) -> int | None:
    value = request.session.get("token_id") if "session" in request.scope else None
    return value if isinstance(value, int) else None
