"""Content-addressed images: only hashes the store knows, never a path."""

from __future__ import annotations

from pathlib import Path as FsPath
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, Response
from sqlmodel import Session

from collage.app.core.settings import Settings
from collage.app.store.tables import Image
from collage.training.infra.objectstore import ObjectMirror

from ..auth import UNAUTHORIZED, require_token
from ..bucket import bucket_call, request_mirror
from ..deps import SessionDep, SettingsDep
from ..store.images import local_image, relative_path, thumbnail

router = APIRouter(tags=["images"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

CACHE = "private, max-age=31536000, immutable"  # content-addressed: a hash never changes its bytes


@router.get(
    "/images/{sha256}",
    response_class=FileResponse,
    responses={
        200: {"content": {"image/png": {}}},
        304: {"description": "not modified"},
        404: {"description": "unknown image"},
    },
)
async def get_image(
    request: Request,
    sha256: Annotated[str, Path(pattern="^[0-9a-f]{64}$", description="SHA-256 of the PNG bytes")],
    session: SessionDep,
    settings: SettingsDep,
    size: Annotated[Literal["thumb", "full"], Query()] = "full",
) -> Response:
    # the store is read, and its session closed, before anything waits on the bucket (app/bucket.py says why)
    if not await run_in_threadpool(known_image, session, sha256):
        raise HTTPException(404, f"no image {sha256}")
    etag = f'"{sha256}-{size}"'
    headers = {"Cache-Control": CACHE, "ETag": etag}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    mirror = request_mirror(settings)
    if mirror is not None and settings.s3_presign > 0:  # the bucket serves the bytes: the web node only signs
        url = await bucket_call(settings, f"signing image {sha256}", presigned_image, settings, mirror, sha256, size)
        return RedirectResponse(url, status_code=307, headers={"Cache-Control": presign_cache(settings)})
    find = thumbnail if size == "thumb" else local_image
    try:
        if mirror is None:
            path: FsPath | None = await run_in_threadpool(find, settings.artifacts, sha256, None)
        else:
            path = await bucket_call(settings, f"fetching image {sha256}", find, settings.artifacts, sha256, mirror)
    except FileNotFoundError:
        path = None
    if path is None:
        raise HTTPException(404, f"image {sha256} is recorded but its file is missing from the artifacts")
    return FileResponse(path, media_type="image/png", headers=headers)


def known_image(session: Session, sha256: str) -> bool:
    """Whether the store records the image; the session is closed after (its connection back to the pool)."""
    try:
        return session.get(Image, sha256) is not None
    finally:
        session.close()


def presign_cache(settings: Settings) -> str:
    # the redirect may be reused while its URL is valid, less a margin for the browser's own clock
    return f"private, max-age={max(settings.s3_presign // 2, 1)}"


def presigned_image(settings: Settings, mirror: ObjectMirror, sha256: str, size: str) -> str:
    """A presigned URL of the image (its thumbnail made and stored first)."""
    rel = relative_path(sha256)
    if size == "thumb":
        thumbnail(settings.artifacts, sha256, mirror)
        rel = relative_path(sha256, "thumbs")
    return mirror.presign(rel, settings.s3_presign)
