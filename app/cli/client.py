"""The command line's REST client: which server and token to use, and the server's refusals as plain errors.

Server: ``--server``, else ``$COLLAGE_SERVER``, else the `collage serve` running on this COLLAGE_HOME
(:mod:`.serve_record`), else http://127.0.0.1:8000. Token: ``--token``, else ``$COLLAGE_TOKEN``, else the admin
token `collage serve` keeps in ``COLLAGE_HOME/token``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from collage.app.cli.serve_record import resolve_server
from collage.app.core.errors import WebError
from collage.app.core.settings import ClientSettings, get_settings


class ApiError(WebError):
    """A request the server refused or could not answer; ``exit_code`` 1 when it refused this run (no such run,
    not allowed now, not yours), 2 when the command could not talk to it at all (unreachable, bad token)."""

    def __init__(self, message: str, exit_code: int = 2):
        self.exit_code = exit_code
        super().__init__(message)


def resolve_token(explicit: str | None, home: Path | None = None) -> str | None:
    if explicit:
        return explicit
    from_env = ClientSettings.from_env().token
    if from_env:
        return from_env
    path = (home or get_settings().home) / "token"
    return path.read_text().strip() if path.is_file() else None


def connect(server: str | None, token: str | None) -> tuple[httpx.Client, str]:
    """A client of ``/api/v1`` on the chosen server with the chosen token, and the server's base URL."""
    home = get_settings().home
    base = resolve_server(server, home)
    secret = resolve_token(token, home)
    if not secret:
        raise ApiError("no API token: pass --token, set COLLAGE_TOKEN, or run `collage serve` (it writes "
                       f"{home / 'token'}) or `collage token create NAME`")  # fmt: skip
    client = httpx.Client(base_url=base + "/api/v1", headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    return client, base


def detail(response: httpx.Response) -> str:
    """The server's own words for a refusal: ``detail`` as text, or each field error as ``path: message``."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    found = body.get("detail") if isinstance(body, dict) else None
    if isinstance(found, list):
        return "; ".join(f"{d.get('path', '?')}: {d.get('message', d.get('msg', ''))}" for d in found)
    return str(found) if found else response.reason_phrase


def call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    """The JSON answer of one request; every failure becomes an :class:`ApiError` that says what to do."""
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        base = str(client.base_url).removesuffix("/api/v1/").removesuffix("/api/v1")
        raise ApiError(f"cannot reach {base}: {exc} (is `collage serve` running? choose the server with --server "
                       "or COLLAGE_SERVER)") from exc  # fmt: skip
    if response.status_code == 401:
        raise ApiError(f"the server refused the API token: {detail(response)}")
    if response.status_code in (403, 404, 409):
        raise ApiError(detail(response), exit_code=1)
    if response.status_code >= 400:
        raise ApiError(f"{method} {path} answered {response.status_code}: {detail(response)}")
    return response.json() if response.content else None
