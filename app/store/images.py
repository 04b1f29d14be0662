"""Image files under ``COLLAGE_ARTIFACTS``, addressed by the SHA-256 of their PNG bytes.

``images/ab/cd/<sha256>.png`` holds the image, ``thumbs/ab/cd/<sha256>.png`` its thumbnail, made on first
request and kept. Files are written through a temporary name and renamed, so a reader never sees half a file.

With object storage (``COLLAGE_ARTIFACTS=s3://...``, :mod:`collage.training.infra.objectstore`) each file is also
written to the bucket, once (its key is its hash), and the local folder is this host's cache: a host that does not
have an image fetches it from the bucket.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from pathlib import Path

from collage.training.infra.images import open_raster_file
from collage.training.infra.objectstore import ObjectMirror, ensure_local_file

SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")  # \Z: `$` would accept a trailing newline
THUMB_SIZE = 160


def is_sha256(value: str) -> bool:
    return bool(SHA256_RE.match(value))


def relative_path(sha: str, kind: str = "images") -> str:
    if not is_sha256(sha):
        raise ValueError(f"not a SHA-256 hex digest: {sha!r}")
    return f"{kind}/{sha[:2]}/{sha[2:4]}/{sha}.png"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_image(
    artifacts: Path, png: bytes, sha: str | None = None, mirror: ObjectMirror | None = None
) -> tuple[str, str]:
    """Store PNG bytes once (in the bucket too, with a mirror); returns ``(sha256, relative path)``. The hash is
    checked, never trusted. The bucket is written before the local file, so a local file means the bucket has it."""
    digest = hashlib.sha256(png).hexdigest()
    if sha is not None and sha != digest:
        raise ValueError(f"image bytes hash to {digest}, not {sha}")
    rel = relative_path(digest)
    path = artifacts / rel
    if not path.exists():
        if mirror is not None:
            mirror.put_bytes(rel, png, once=True, content_type="image/png")
        _atomic_write(path, png)
    return digest, rel


def local_image(artifacts: Path, sha: str, mirror: ObjectMirror | None = None) -> Path | None:
    """The stored image's file on this host (fetched from the bucket when only the bucket has it), or None."""
    return ensure_local_file(artifacts, relative_path(sha), mirror)


def image_info(png: bytes) -> tuple[int, int, str]:
    # raster formats only (training.images): Pillow never hands these bytes to another program
    with open_raster_file(io.BytesIO(png)) as image:
        return image.width, image.height, (image.format or "png").lower()


def thumbnail(artifacts: Path, sha: str, mirror: ObjectMirror | None = None) -> Path:
    """The thumbnail's path, made once from the stored image (and kept in the bucket, with a mirror: another web
    node or a later cache finds it there)."""
    rel = relative_path(sha, "thumbs")
    found = ensure_local_file(artifacts, rel, mirror)
    if found is not None:
        return found
    thumb = artifacts / rel
    source = local_image(artifacts, sha, mirror)
    if source is None:
        raise FileNotFoundError(f"image {sha} is neither in the artifacts folder nor in the bucket")
    with open_raster_file(source) as stored:
        image = stored.convert("RGB")
        image.thumbnail((THUMB_SIZE, THUMB_SIZE))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
    if mirror is not None:
        mirror.put_bytes(rel, buf.getvalue(), once=True, content_type="image/png")
    _atomic_write(thumb, buf.getvalue())
    return thumb
