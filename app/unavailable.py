"""A store that is locked, timing out or unreachable answers 503 with ``Retry-After``, never 500; an idempotent read
(GET, HEAD) whose database connection dropped is tried once more on a fresh connection first.

An ASGI middleware just outside the routes, so that it sees every route's database errors (dependencies, sync
routes, pages) before Starlette would turn them into a 500. A response that has begun (a stream, a download) is
not touched: those end themselves (see the run stream)."""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .store.faults import dropped_connection, is_store_fault

log = logging.getLogger("collage.api")

RETRY_AFTER = 5  # seconds a client is asked to wait before trying again
IDEMPOTENT = ("GET", "HEAD")


class StoreUnavailable:
    def __init__(self, app: ASGIApp, retry_after: int = RETRY_AFTER):
        self.app = app
        self.retry_after = retry_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        received: list[Message] = []  # the request's body messages, replayed to a second try

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received.append(message)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        tries = 2 if scope["method"] in IDEMPOTENT else 1
        for attempt in range(1, tries + 1):
            try:
                await self.app(scope, recording_receive if attempt == 1 else _replay(received, receive), tracking_send)
                return
            except Exception as exc:
                if started or not is_store_fault(exc):
                    raise
                if attempt < tries and dropped_connection(exc):
                    log.warning("%s %s: the database connection dropped (%s): trying once more",
                                scope["method"], scope["path"], type(exc).__name__)  # fmt: skip
                    continue
                log.warning("%s %s: the store is unavailable: %s", scope["method"], scope["path"], exc)
                await self._unavailable(send, exc)
                return

    async def _unavailable(self, send: Send, exc: Exception) -> None:
        reason = "unreachable" if dropped_connection(exc) else "busy or unreachable"
        body = json.dumps(
            {"detail": f"the run store is {reason} right now: try again in {self.retry_after} s"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(self.retry_after).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replaying_receive() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replaying_receive
