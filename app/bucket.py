"""A web request's calls to the artifacts' bucket: bounded in time and in threads, never with a store session.

A route that needs the bucket (an image or its thumbnail fetched into this node's cache, a presigned URL) first
reads what it needs from the store and closes its session, then calls :func:`bucket_call`. The call runs on a
small thread pool of its own (:data:`BUCKET_THREADS`), not on the threads every other route shares, and the request
waits for it at most ``COLLAGE_S3_REQUEST_WAIT`` seconds (:attr:`Settings.s3_request_wait`): past that it raises
:class:`~collage.training.infra.objectstore.StorageUnreachable`, which the app answers ``503`` with ``Retry-After``. So
an outage of the bucket makes those requests fail fast while every other route keeps answering: no store
connection waits on the bucket (PostgreSQL would end an idle transaction after 60 s, and a pool held by waiting
requests starves the rest), and no shared thread does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from collage.app.core.settings import Settings
from collage.training.infra.objectstore import ObjectMirror, StorageUnreachable, mirror_for

T = TypeVar("T")

# the most bucket calls one web process makes at once; a request beyond them waits (within its bound) for a thread
BUCKET_THREADS = 8
_pool = ThreadPoolExecutor(max_workers=BUCKET_THREADS, thread_name_prefix="collage-bucket")


def request_mirror(settings: Settings) -> ObjectMirror | None:
    """The bucket as a web request uses it: its calls retry an unreachable server no longer than a request waits
    (so that a thread of :data:`_pool` is not kept for ``COLLAGE_S3_RETRY_FOR`` after its request answered)."""
    retry_for = min(settings.s3_retry_for, settings.s3_request_wait)
    return mirror_for(settings.artifacts_url, settings.s3_endpoint_url, retry_for, settings.s3_public_url)


async def bucket_call(settings: Settings, what: str, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the bucket's threads, waited for at most ``settings.s3_request_wait`` seconds; then
    :class:`StorageUnreachable` naming ``what`` (the call itself, if it started, ends on its own retry window)."""
    future = asyncio.wrap_future(_pool.submit(fn, *args))
    try:
        return await asyncio.wait_for(future, settings.s3_request_wait)
    except TimeoutError:  # wait_for cancelled the future: a call still queued never starts
        where = settings.artifacts_url
        raise StorageUnreachable(
            f"object storage {where} ({settings.s3_endpoint_url or 'AWS'}): {what} did not finish within "
            f"{settings.s3_request_wait:g} s (COLLAGE_S3_REQUEST_WAIT)"
        ) from None
