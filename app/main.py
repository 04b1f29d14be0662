"""The FastAPI application: routers per resource under ``/api/v1``."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from collage.app.core.settings import Settings, get_settings
from collage.app.store.engine import check_migrated, engine_for
from collage.training.config import error_message, error_path, format_errors

from .dispatch import Dispatcher
from .limits import BodySizeLimit, BodyTooLarge, RefuseNul
from .state import init_state, settings_of
from .unavailable import StoreUnavailable
from .version import collage_version

API = "/api/v1"


def loc_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """``("body", "train", "loss_type")`` -> ``train.loss_type``; a query or path parameter as ``query.name``."""
    items = list(loc)
    if items and items[0] in ("body", "query", "path", "header"):
        where, items = items[0], items[1:]
        if where != "body" and items:
            return f"{where}.{items[0]}"
    return error_path(items) or "body"


def validation_response(errors: list[tuple[str, str]]) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": [{"path": p, "message": m} for p, m in errors]})


def create_app(settings: Settings | None = None, dispatcher: Dispatcher | None = None) -> FastAPI:
    """Build the app. Refuses a database that is not migrated to the newest schema."""
    settings = settings or get_settings()
    # a request waits at most db_lock_timeout for another process's lock, then answers 503 (StoreUnavailable)
    engine = engine_for(settings.database_url, settings.db_lock_timeout)
    check_migrated(engine)
    if dispatcher is None:
        raise RuntimeError("create_app needs a dispatcher (the Celery one from worker/ in production)")

    app = FastAPI(
        title="Collage",
        version=collage_version(),
        description="Launch, run and inspect GRPO/RLOO fine-tuning of multi-image VLMs.",
        openapi_url=f"{API}/openapi.json",
        docs_url=None,  # served by _add_api_docs from the vendored Swagger UI: the docs work offline
        redoc_url=None,
    )
    Path(settings.artifacts).mkdir(parents=True, exist_ok=True)
    if (mirror := settings.mirror()) is not None:  # created when missing (an operator's bucket is kept as it is)
        mirror.ensure_bucket()
    from .store.tokens import installation_secret

    # the installation's signing key is kept in the store, shared by every web replica (never COLLAGE_HOME's)
    init_state(app, settings, engine, dispatcher, installation_secret(engine))
    # the order below is the order requests meet them: middleware first, then routes in the order they were added
    _add_middleware(app, settings)
    app.mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="static")
    _add_exception_handlers(app)
    _include_api_routers(app)
    _declare_bearer_auth(app)
    _add_api_docs(app)
    from .web import pages

    app.include_router(pages.router)
    return app


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    """Each one added wraps the ones before it: StoreUnavailable is innermost, the proxy headers outermost."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    from .routers.playground import upload_body_limit
    from .security_headers import SecurityHeaders

    # innermost: every route's store errors become 503 + Retry-After (a dropped connection retried once for reads)
    app.add_middleware(StoreUnavailable)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes, routes=upload_body_limit(settings))
    app.add_middleware(RefuseNul)
    app.add_middleware(SecurityHeaders)
    # behind a TLS proxy listed in COLLAGE_FORWARDED_ALLOW_IPS, X-Forwarded-Proto makes the request https (Secure
    # cookies); anyone else's forwarded headers are ignored
    app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.forwarded_allow_ips)


def _add_exception_handlers(app: FastAPI) -> None:
    from collage.training.infra.objectstore import StorageError

    app.exception_handler(RequestValidationError)(_validation)
    app.exception_handler(StarletteHTTPException)(_http)
    app.exception_handler(StorageError)(_storage)


# how long a client is told to wait when the artifacts' bucket does not answer
STORAGE_RETRY_AFTER = 30


async def _storage(_request: Request, exc: Exception) -> JSONResponse:
    """The artifacts' bucket failed a request: 503 with Retry-After when it does not answer (it may come back), 502
    when what it holds cannot be used (a file not matching its manifest, a manifest naming a file outside its
    folder): never a 500, and the reason is said."""
    from collage.training.infra.objectstore import StorageUnreachable

    if isinstance(exc, StorageUnreachable):
        return JSONResponse(status_code=503, content={"detail": f"the artifacts' bucket is unreachable: {exc}"},
                            headers={"Retry-After": str(STORAGE_RETRY_AFTER)})  # fmt: skip
    return JSONResponse(status_code=502, content={"detail": f"the artifacts' bucket holds something unusable: {exc}"})


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Every bad field of a request as ``{"path", "message"}``, a run config's in the CLI's key paths and wording."""
    errors: list[tuple[str, str]] = []
    for e in exc.errors():
        loc = list(e["loc"])
        if loc == ["body"] and "json" not in request.headers.get("content-type", "json"):
            ctype = request.headers.get("content-type")
            errors.append(("body", f"must be a JSON object sent as application/json (got {ctype})"))
        elif loc[:1] == ["body"]:  # a run config (or another body): the CLI's key paths and wording
            errors += format_errors([{**e, "loc": loc[1:]}], root="body")
        else:
            errors.append((loc_path(loc), error_message(e)))
    if request.method == "POST" and request.url.path == f"{API}/runs":
        from .validation import raw_semantic_errors

        seen = {path for path, _ in errors}
        errors += [(p, m) for p, m in raw_semantic_errors(exc.body, settings_of(request.app)) if p not in seen]
    return validation_response(errors)


async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
        # JSON nested thousands deep stops the parser itself: still a field-level 422, never a 500
        return validation_response([("body", "nested too deeply to parse (at most 32 levels are allowed)")])
    if exc.status_code == 400 and isinstance(exc.__cause__, BodyTooLarge):
        # a body without Content-Length that grew past its limit while FastAPI parsed it as JSON
        return JSONResponse(status_code=413, content={"detail": str(exc.__cause__)})
    return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail}, headers=exc.headers)


def _include_api_routers(app: FastAPI) -> None:
    """Every API router under ``/api/v1``, in this order (the OpenAPI schema lists their paths in it)."""
    from .routers import (
        catalog,
        checkpoints,
        datasets,
        exports,
        health,
        images,
        plan,
        playground,
        runs,
        samples,
        stats,
        tokens,
        workers,
    )

    routers: tuple[ModuleType, ...] = (health, runs, samples, stats, images, datasets, catalog, tokens, workers)
    routers += (checkpoints, exports)  # a run's checkpoints, their downloads and export jobs (issue 18)
    routers += (playground,)
    routers += (plan,)  # the memory plan before launch (issue 29)
    for module in routers:
        app.include_router(module.router, prefix=API)


def _declare_bearer_auth(app: FastAPI) -> None:
    """The token check is a plain function (app/auth.py), so the schema would not say that routes take a bearer
    token: declared here, Swagger UI shows its Authorize button and sends the token with "Try it out"."""
    plain_openapi = app.openapi

    def openapi_with_bearer() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = plain_openapi()
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes["bearer"] = {
                "type": "http",
                "scheme": "bearer",
                "description": "an API token (collage token create)",
            }
            for path, item in schema["paths"].items():
                for operation in item.values():
                    if path != f"{API}/health" and isinstance(operation, dict):
                        operation.setdefault("security", [{"bearer": []}])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi_with_bearer  # type: ignore[method-assign]


def _add_api_docs(app: FastAPI) -> None:
    @app.get(f"{API}/docs", include_in_schema=False)
    def api_docs() -> HTMLResponse:
        return HTMLResponse(api_docs_html(app.title, app.openapi_url or f"{API}/openapi.json"))


SWAGGER_UI = "/static/vendor/swagger-ui-5.35.0"


def api_docs_html(title: str, openapi_url: str) -> str:
    """The interactive API docs (Swagger UI), every file served by Collage itself: no CDN, no inline script (the
    bootstrap is /static/api-docs.js), so the page works offline under the same Content-Security-Policy as the
    dashboard."""
    from html import escape

    return f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <title>{escape(title)} API · Swagger UI</title>
  <script src="/static/theme.js"></script>
  <link rel="icon" type="image/png" href="{SWAGGER_UI}/favicon-32x32.png">
  <link rel="stylesheet" href="{SWAGGER_UI}/swagger-ui.css">
  <link rel="stylesheet" href="/static/api-docs.css">
  <script src="{SWAGGER_UI}/swagger-ui-bundle.js" defer></script>
  <script src="/static/api-docs.js" defer></script>
</head>
<body>
  <nav class="api-docs-back" aria-label="Collage">
    <a href="/runs">&larr; Back to Collage</a> &middot; <a href="/runs">Runs</a> &middot; <a href="/launch">Launch</a>
    &middot; <a href="/playground">Playground</a>
  </nav>
  <div id="swagger-ui" data-openapi-url="{escape(openapi_url)}"></div>
</body>
</html>
"""
