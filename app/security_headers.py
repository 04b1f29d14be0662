"""Response headers that keep the dashboard out of frames, stop MIME sniffing, keep URLs (login links included)
out of other sites' Referer headers and keep private answers out of caches (``Cache-Control: no-store`` on all but
/static and the content-addressed images); every response carries a Content-Security-Policy that allows only
Collage's own scripts, the interactive API docs included (Swagger UI is vendored under /static and started by an
external script: no CDN, no inline script, no exception)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

COMMON = [
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    # same-origin: a page's own requests say where they come from (the CSRF check refuses an unsafe request whose
    # Origin is not this site, and with no-referrer browsers send "Origin: null" on form posts); other sites get
    # nothing, so no URL (a login link's included) leaves the site in a Referer
    (b"referrer-policy", b"same-origin"),
]
# the pages load only /static scripts (no inline script, no eval); charts and Swagger UI set styles from script,
# which CSP allows; images are served by the API, drawn into canvases, or (Swagger UI's icons) data: URLs
PAGE_CSP = (
    b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    b"connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)


# Pages and API answers hold private data (runs, rollouts, tokens): no browser or proxy cache may keep them, nor the
# back button show them after logout. Static files and content-addressed images keep their own (long) caching.
NO_STORE = (b"cache-control", b"no-store")
CACHEABLE_PREFIXES = ("/static/", "/api/v1/images/")


class SecurityHeaders:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cacheable = scope.get("path", "").startswith(CACHEABLE_PREFIXES)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _OURS]
                ours = [*COMMON, (b"content-security-policy", PAGE_CSP)]
                if not cacheable:
                    headers = [(k, v) for k, v in headers if k.lower() != NO_STORE[0]]
                    ours.append(NO_STORE)
                message["headers"] = [*headers, *ours]
            await send(message)

        await self.app(scope, receive, with_headers)


_OURS = {name for name, _ in COMMON} | {b"content-security-policy"}
