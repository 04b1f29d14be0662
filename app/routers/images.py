"""Content-addressed images: only hashes the store knows, never a path."""

from __future__ import annotations

from pathlib import Path as FsPath
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, Response

from ..auth import UNAUTHORIZED, require_token
from ..deps import SessionDep, SettingsDep
from ..models import Image
from ..settings import Settings
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
    image = await run_in_threadpool(session.get, Image, sha256)
    if image is None:
        raise HTTPException(404, f"no image {sha256}")
    etag = f'"{sha256}-{size}"'
    headers = {"Cache-Control": CACHE, "ETag": etag}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    if settings.s3_presign > 0:  # the bucket serves the bytes: the web node only signs
        url = await run_in_threadpool(presigned_image, settings, sha256, size)
        if url is not None:
            return RedirectResponse(url, status_code=307, headers={"Cache-Control": presign_cache(settings)})
    mirror = settings.mirror()
    try:
        if size == "thumb":
            path: FsPath | None = await run_in_threadpool(thumbnail, settings.artifacts, sha256, mirror)
        else:
            path = await run_in_threadpool(local_image, settings.artifacts, sha256, mirror)
    except FileNotFoundError:
        path = None
    if path is None:
        raise HTTPException(404, f"image {sha256} is recorded but its file is missing from the artifacts")
    return FileResponse(path, media_type="image/png", headers=headers)


def presign_cache(settings: Settings) -> str:
    # the redirect may be reused while its URL is valid, less a margin for the browser's own clock
    return f"private, max-age={max(settings.s3_presign // 2, 1)}"


def presigned_image(settings: Settings, sha256: str, size: str) -> str | None:
    """A presigned URL of the image (its thumbnail made and stored first), or None without a bucket."""
    mirror = settings.mirror()
    if mirror is None:
        return None
    rel = relative_path(sha256)
    if size == "thumb":
        thumbnail(settings.artifacts, sha256, mirror)
        rel = relative_path(sha256, "thumbs")
    return mirror.presign(rel, settings.s3_presign)
