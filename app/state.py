"""The web app's long-lived objects, kept on ``app.state``: put there once by :func:`init_state` (``create_app``) and
read back only through the functions here, so their names and types are written down in one place.

Routes never call these: they take the typed aliases of :mod:`collage.app.deps`, which do. The plain functions are
for code that runs outside a route's dependencies: the token check (``app/auth.py``), the browser session
(``app/web/session.py``) and the exception handlers. Every read happens per request, never cached at import: the
tests swap ``app.state.settings`` on a live app and expect the next request to see it.

What is here is the process's own: nothing a request of another web replica needs to see. What replicas share
lives in the store (runs, tokens, sessions, login links, jobs and their per-token limits, the signing key) and in
the artifacts' bucket; the export slots and the dataset gate bound what *this* process takes on (its threads, its
dataset helper) and are per replica by design (docs/scaling.md, Web replicas).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from fastapi import FastAPI
from sqlalchemy.engine import Engine

from collage.app.core.settings import Settings

from .dispatch import Dispatcher
from .store.writer import StoreWriter

if TYPE_CHECKING:  # imported when first used: the token check and the pages import this module, not the helper
    from collage.app.datasets.client import DatasetGate

_LAZY_LOCK = threading.Lock()  # the lazily made objects below are made once per app, whichever request comes first


def init_state(app: FastAPI, settings: Settings, engine: Engine, dispatcher: Dispatcher, secret: str) -> None:
    """What every request of ``app`` shares. ``secret`` is the installation's signing key, the same for every web
    replica: kept in the store (``store.tokens.installation_secret``), read once when the app is made."""
    app.state.settings = settings
    app.state.engine = engine
    # the API's writes retry a dropped connection no longer than a request waits for a lock
    app.state.writer = StoreWriter(
        engine, settings.artifacts, retry_for=settings.db_lock_timeout, mirror=settings.mirror()
    )
    app.state.dispatcher = dispatcher
    app.state.secret = secret
    app.state.cursor_key = secret.encode()  # signs API cursors (HMAC)


def settings_of(app: FastAPI) -> Settings:
    settings: Settings = app.state.settings
    return settings


def engine_of(app: FastAPI) -> Engine:
    engine: Engine = app.state.engine
    return engine


def writer_of(app: FastAPI) -> StoreWriter:
    writer: StoreWriter = app.state.writer
    return writer


def dispatcher_of(app: FastAPI) -> Dispatcher:
    dispatcher: Dispatcher = app.state.dispatcher
    return dispatcher


def cursor_key_of(app: FastAPI) -> bytes:
    key: bytes = app.state.cursor_key
    return key


def export_slots(app: FastAPI) -> threading.BoundedSemaphore:
    """The app's export slots: ``settings.max_exports`` downloads at once per process, the rest get 429. Made on
    first use, from the settings of that moment. Per web replica on purpose: they keep this process's threads from
    all streaming slow downloads, and another replica's downloads hold none of them."""
    with _LAZY_LOCK:
        slots: threading.BoundedSemaphore | None = getattr(app.state, "export_slots", None)
        if slots is None:
            slots = app.state.export_slots = threading.BoundedSemaphore(settings_of(app).max_exports)
        return slots


def dataset_gate(app: FastAPI) -> DatasetGate:
    """The admission gate of the app's dataset requests (previews, checks, a run's submit-time probe). Per web
    replica on purpose: it bounds what waits for this process's own dataset helper."""
    from collage.app.datasets.client import DatasetGate

    with _LAZY_LOCK:
        gate: DatasetGate | None = getattr(app.state, "dataset_gate", None)
        if gate is None:
            gate = app.state.dataset_gate = DatasetGate()
        return gate
