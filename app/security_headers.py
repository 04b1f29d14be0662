"""Response headers that keep the dashboard out of frames, stop MIME sniffing and keep URLs (login links
included) out of Referer headers; HTML pages also get a Content-Security-Policy that allows only Collage's own
scripts."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

COMMON = [
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
# the pages load only /static scripts (no inline script, no eval); charts set styles from script, which CSP
# allows; images are served by the API or drawn into canvases
PAGE_CSP = (
    b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    b"connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
# the interactive API docs page (Swagger UI) brings its own inline bootstrap script and assets
DOCS_CSP = b"frame-ancestors 'none'; object-src 'none'; base-uri 'self'"


class SecurityHeaders:
    def __init__(self, app: ASGIApp, docs_prefix: str):
        self.app = app
        self.docs_prefix = docs_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        csp = DOCS_CSP if scope["path"].startswith(self.docs_prefix) else PAGE_CSP

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _OURS]
                message["headers"] = [*headers, *COMMON, (b"content-security-policy", csp)]
            await send(message)

        await self.app(scope, receive, with_headers)


_OURS = {name for name, _ in COMMON} | {b"content-security-policy"}
