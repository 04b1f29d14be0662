"""Downloads that stream for a while (exports of a run's samples or metrics, checkpoint and export tars): each
holds one of the web process's ``COLLAGE_MAX_EXPORTS`` slots while it streams; beyond them the answer is 429 with
``Retry-After``, so slow downloads never take every worker thread.

The slots are counted per web process, also with several web replicas behind one address: what they protect is
the process's own thread pool, which another replica's downloads do not touch, and a count that lives only in the
process can never be left held by a replica that was killed mid-download. Every replica applies the same limit to
itself; an installation with N replicas streams at most N x ``COLLAGE_MAX_EXPORTS`` downloads at once
(docs/scaling.md, Web replicas). The per-token limit of export *jobs* is the store's, shared by every replica
(``app/routers/exports.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fastapi import HTTPException
from fastapi.responses import StreamingResponse

from collage.app.core.settings import Settings

from ..state import export_slots as export_slots  # the app's slots (made on first use): the tests hold them

RETRY_AFTER_SECONDS = 10


class SlotStream(StreamingResponse):
    """A streamed download that holds an export slot until it ends, fails, or its client goes away."""

    def __init__(self, content: Iterable[Any] | Iterator[Any], release: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def hold_export_slot(slots: threading.BoundedSemaphore, settings: Settings) -> Callable[[], None]:
    """One of the web process's ``COLLAGE_MAX_EXPORTS`` export slots (429 with ``Retry-After`` when none is free);
    returns its release, which frees it exactly once however often it is called."""
    if not slots.acquire(blocking=False):
        raise HTTPException(
            429,
            f"{settings.max_exports} downloads are running: retry in {RETRY_AFTER_SECONDS} s",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):  # exactly once, whichever way the response ends
            slots.release()

    return release
