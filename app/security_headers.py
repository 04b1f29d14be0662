"""Response headers that keep the dashboard out of frames, stop MIME sniffing and keep URLs (login links
included) out of Referer headers; every response carries a Content-Security-Policy that allows only Collage's own
scripts, the interactive API docs included (Swagger UI is vendored under /static and started by an external
script: no CDN, no inline script, no exception)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

COMMON = [
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
# the pages load only /static scripts (no inline script, no eval); charts and Swagger UI set styles from script,
# which CSP allows; images are served by the API, drawn into canvases, or (Swagger UI's icons) data: URLs
PAGE_CSP = (
    b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    b"connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)


class SecurityHeaders:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _OURS]
                message["headers"] = [*headers, *COMMON, (b"content-security-policy", PAGE_CSP)]
            await send(message)

        await self.app(scope, receive, with_headers)


_OURS = {name for name, _ in COMMON} | {b"content-security-policy"}
