"""Downloads that stream for a while (exports of a run's samples or metrics, checkpoint and export tars): each
holds one of the web process's ``COLLAGE_MAX_EXPORTS`` slots while it streams; beyond them the answer is 429 with
``Retry-After``, so slow downloads never take every worker thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse

RETRY_AFTER_SECONDS = 10


_SLOTS_LOCK = threading.Lock()


def export_slots(app) -> threading.BoundedSemaphore:
    """The app's export slots: ``settings.max_exports`` downloads at once per process, the rest get 429."""
    with _SLOTS_LOCK:
        slots = getattr(app.state, "export_slots", None)
        if slots is None:
            slots = app.state.export_slots = threading.BoundedSemaphore(app.state.settings.max_exports)
        return slots


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


def hold_export_slot(request: Request) -> Callable[[], None]:
    """One of the web process's ``COLLAGE_MAX_EXPORTS`` export slots (429 with ``Retry-After`` when none is free);
    returns its release, which frees it exactly once however often it is called."""
    slots = export_slots(request.app)
    if not slots.acquire(blocking=False):
        raise HTTPException(
            429,
            f"{request.app.state.settings.max_exports} downloads are running: retry in {RETRY_AFTER_SECONDS} s",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):  # exactly once, whichever way the response ends
            slots.release()

    return release
