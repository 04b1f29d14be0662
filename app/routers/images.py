"""Content-addressed images: only hashes the store knows, never a path."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response

from ..auth import UNAUTHORIZED, require_token
from ..deps import SessionDep, SettingsDep
from ..models import Image
from ..store.images import thumbnail

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
    artifacts = settings.artifacts
    path = artifacts / image.path
    if not path.is_file():
        raise HTTPException(404, f"image {sha256} is recorded but its file is missing from the artifacts folder")
    if size == "thumb":
        path = await run_in_threadpool(thumbnail, artifacts, sha256)
    return FileResponse(path, media_type="image/png", headers=headers)
