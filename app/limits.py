"""ASGI guards in front of every route: refuse request bodies above a size limit (413) before the app reads them,
and NUL bytes in query or path parameters (422).

One limit holds for every route (JSON bodies: 1 MiB), except the routes given their own (``routes``: an image
upload may be larger); either way the bound is enforced on the declared ``Content-Length`` and again on the bytes
as they arrive, so a body is never read past it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from collage.app.core.errors import WebError
from collage.training.config import NUL_MESSAGE


async def _send_json(send, status: int, content: Any) -> None:
    body = json.dumps(content).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """``max_bytes`` for every request body; ``routes`` maps ``(method, path)`` to a route's own limit."""

    def __init__(self, app, max_bytes: int, routes: Mapping[tuple[str, str], int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.routes = dict(routes or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.routes.get((scope.get("method", ""), scope.get("path", "")), self.max_bytes)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                return await self._reject(send, 400, "Content-Length is not a number")
            if too_big:
                return await self._reject(send, 413, f"request body is larger than {limit} bytes")
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:
            await self._reject(send, 413, f"request body is larger than {limit} bytes")

    @staticmethod
    async def _reject(send, status: int, detail: str):
        await _send_json(send, status, {"detail": detail})


class BodyTooLarge(WebError):
    """Raised while a body streams in past its limit. FastAPI reads a JSON body inside its own error handling and
    turns this into a 400 "error parsing the body"; app.main maps that 400 back to this 413."""

    def __init__(self, limit: int = 0):
        super().__init__(f"request body is larger than {limit} bytes")
        self.limit = limit


class RefuseNul:
    """A NUL byte in a query or path parameter is a 422 naming it (``query.q``, ``path.run_id``) before any
    route sees it: PostgreSQL refuses NUL in text, and no name, id or search text holds one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (where := nul_parameter(scope)) is not None:
            return await _send_json(send, 422, {"detail": [{"path": where, "message": NUL_MESSAGE}]})
        return await self.app(scope, receive, send)


def nul_parameter(scope) -> str | None:
    """The first query or path parameter of a request that holds a NUL byte, as ``query.<name>`` or
    ``path.<name>`` (plain ``query`` / ``path`` when no name can be given)."""
    query = scope.get("query_string", b"").decode("latin-1")
    if "\x00" in query or "%00" in query:
        for name, value in parse_qsl(query, keep_blank_values=True):
            if "\x00" in name:
                return "query"
            if "\x00" in value:
                return f"query.{name}"
    path = scope.get("path", "")
    if "\x00" in path:  # the path is percent-decoded already
        return _path_parameter(scope.get("app"), path)
    return None


def _path_parameter(app, path: str) -> str:
    """``path.<name>`` of the documented route template whose parameter segment holds the NUL byte."""
    parts = path.split("/")
    schema = app.openapi() if hasattr(app, "openapi") else {}
    for template in schema.get("paths", {}):
        names = template.split("/")
        if len(names) == len(parts) and all(n == p or n.startswith("{") for n, p in zip(names, parts, strict=True)):
            return next(f"path.{n.strip('{}')}" for n, p in zip(names, parts, strict=True) if "\x00" in p)
    return "path"
