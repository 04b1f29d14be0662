"""What a route may ask for, as typed aliases: ``def route(session: SessionDep, token: CurrentUser) -> ...``.

Each alias is ``Annotated[type, Depends(...)]``, so a route's signature says what it uses and mypy checks it; the
values come from the app's state (:mod:`collage.app.state`) or the request, never from a route reading
``request.app.state`` itself. None of them adds a parameter to the OpenAPI schema: they read the request, not its
query, path or body.

One request, one store session: every :data:`SessionDep` of a request (the route's, and any dependency's) is the
same Session (FastAPI runs a dependency once per request), connected on its first query and closed after the
response. A streamed download takes :data:`StreamSessionDep` instead (never both): its session is closed as soon as
the route returns, before the body streams, so that a slow client holds no connection.

Store work that is a transaction of its own, shared with the workers and the CLI (the writer's run transitions, a
job's lifecycle, tokens, the worker registry), takes :data:`EngineDep` or :data:`WriterDep` and opens its short
sessions inside ``app/store/``; a route never opens one itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.engine import Engine
from sqlmodel import Session

from collage.app.core.settings import Settings
from collage.app.datasets.client import DatasetGate
from collage.app.store.tables import ApiToken

from .auth import require_admin, require_token, token_if_valid
from .dispatch import Dispatcher
from .state import cursor_key_of, dataset_gate, dispatcher_of, engine_of, export_slots, settings_of, writer_of
from .store.writer import StoreWriter


def get_session(request: Request) -> Iterator[Session]:
    # expire_on_commit=False: objects read before a route's commit stay readable after it (the route answers with
    # them); a route that needs what another transaction wrote meanwhile expires them itself
    with Session(engine_of(request.app), expire_on_commit=False) as session:
        yield session


# the accessors are coroutines: a plain function dependency would take a threadpool thread just to read an attribute
async def _settings(request: Request) -> Settings:
    return settings_of(request.app)


async def _engine(request: Request) -> Engine:
    return engine_of(request.app)


async def _writer(request: Request) -> StoreWriter:
    return writer_of(request.app)


async def _dispatcher(request: Request) -> Dispatcher:
    return dispatcher_of(request.app)


async def _cursor_key(request: Request) -> bytes:
    return cursor_key_of(request.app)


async def _export_slots(request: Request) -> threading.BoundedSemaphore:
    return export_slots(request.app)


async def _dataset_gate(request: Request) -> DatasetGate:
    return dataset_gate(request.app)


# ----------------------------------------------------------------------------------------------------- the store
SessionDep = Annotated[Session, Depends(get_session)]
StreamSessionDep = Annotated[Session, Depends(get_session, scope="function")]
# for the store's own units of work that open their short sessions (jobs, tokens, the worker registry, streams)
EngineDep = Annotated[Engine, Depends(_engine)]
WriterDep = Annotated[StoreWriter, Depends(_writer)]  # run transitions, creation and deletion, retried

# -------------------------------------------------------------------------------------------------- the process
SettingsDep = Annotated[Settings, Depends(_settings)]
DispatcherDep = Annotated[Dispatcher, Depends(_dispatcher)]
CursorKeyDep = Annotated[bytes, Depends(_cursor_key)]  # signs the API's pagination cursors
ExportSlotsDep = Annotated[threading.BoundedSemaphore, Depends(_export_slots)]
DatasetGateDep = Annotated[DatasetGate, Depends(_dataset_gate)]

# ---------------------------------------------------------------------------------------------------- the caller
# the same checks as app/auth.py's (a bearer token, or a browser session with its CSRF header); FastAPI runs each once
# per request, so a route that names CurrentUser gets the token its router's dependency already checked
CurrentUser = Annotated[ApiToken, Depends(require_token)]  # 401 without a valid token
AdminUser = Annotated[ApiToken, Depends(require_admin)]  # 403 for a member token
MaybeUser = Annotated[ApiToken | None, Depends(token_if_valid)]  # None for no token or a bad one (never 401)
TokenDep = CurrentUser
