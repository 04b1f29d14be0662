"""Opening images that come from outside Collage: only raster formats, only from the operator's folders.

Everything that decodes an image Collage did not draw itself goes through here (dataset rows, the store's image
info and thumbnails, the trackers' rollout tables), so the rules live in one place:

- **Raster formats only** (:data:`RASTER_FORMATS`). Pillow picks a decoder from a file's first bytes, not its
  name, and some of its decoders are other programs: EPS/PostScript is handed to Ghostscript (``gs``), which runs
  the file as a PostScript program (its ``file`` operators read and write files). ``Image.open(...,
  formats=RASTER_FORMATS)`` never tries any other decoder, whatever the file is called. MPO (the multi-picture
  JPEG many phones and 3D cameras write) is allowed: it is a JPEG whose first frame is decoded by the same
  libjpeg decoder as any JPEG (Pillow recognises it through its JPEG decoder, the first frame is what Collage
  uses), so refusing it would refuse ordinary photos and protect nothing.
- **Confinement** (:func:`image_file`). With ``roots`` (the operator's ``COLLAGE_DATA_ROOTS``), a path named in a
  row is resolved (``~``, ``..``, symbolic links) and must lie under a root. That is decided before anything
  looks at the file, and the refusal is the same text whether the outside path exists or not, so a dataset row
  cannot be used to probe the disk. ``roots=None`` means unconfined: only the operator's own local CLI, with
  ``COLLAGE_DATA_ROOTS`` unset, reads that way.
- **Size**: an image file above :data:`MAX_FILE_BYTES`, or an image whose header announces more pixels than
  Pillow's ``Image.MAX_IMAGE_PIXELS`` (a decompression bomb: a few KB of PNG that decode to gigabytes), is
  refused before it is read or decoded. A :class:`ReadBudget` bounds what one preview may read in all.

Torch-free: the web app imports it.
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from PIL import Image, ImageOps, UnidentifiedImageError

from collage.training.infra.errors import InputError, RunError

# Pillow format ids; the only decoders Collage ever lets Pillow run. MPO has no id of its own: Pillow's JPEG
# decoder recognises it (and the image's format then reads "MPO")
RASTER_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
FORMAT_NAMES = "PNG, JPEG, WebP, GIF, BMP or TIFF"
MAX_FILE_BYTES = 512 << 20  # an image file larger than this is refused unread (an allowed-size raw TIFF fits)
ROOTS_ENV = "COLLAGE_DATA_ROOTS"


class ImageRefused(InputError):
    """An image Collage will not open; the message says why, without naming the row (the caller does)."""


class FileMissing(ImageRefused):
    """The (confined) file does not exist: inside the roots, that may be said."""


class BudgetExhausted(RunError):
    """A :class:`ReadBudget` ran out; not a problem of the row itself (a preview stops before it)."""


@dataclass
class ReadBudget:
    """What one request may read in all: images decoded, and bytes (file or inline bytes read, plus each image's
    decoded pixels, counted before it is decoded). :class:`BudgetExhausted` says which ran out."""

    max_images: int
    max_bytes: int
    images: int = 0
    bytes: int = 0

    def take_image(self) -> None:
        if self.images >= self.max_images:
            raise BudgetExhausted(f"more than the {self.max_images} images")
        self.images += 1

    def take_bytes(self, n: int) -> None:
        if self.bytes + n > self.max_bytes:
            raise BudgetExhausted(f"more than the {self.max_bytes} bytes of image data")
        self.bytes += n


def resolve_roots(roots: Sequence[Path | str] | None) -> tuple[Path, ...] | None:
    """The roots with ``~`` expanded and symbolic links resolved, once per dataset (None stays None)."""
    if roots is None:
        return None
    resolved = []
    for root in roots:
        try:
            resolved.append(Path(root).expanduser().resolve())
        except (OSError, RuntimeError, ValueError):
            continue  # a root that cannot be resolved admits nothing
    return tuple(resolved)


def outside_message(roots: Sequence[Path]) -> str:
    folders = ", ".join(str(r) for r in roots) or "none"
    return f"is outside the folders datasets may be read from ({folders}); the operator chooses them with {ROOTS_ENV}"


def image_file(value: str, base_dir: Path | None, roots: Sequence[Path] | None) -> Path:
    """The file an image path of a row names: ``~`` expanded, a relative path taken from ``base_dir`` (the data
    file's folder). With ``roots`` (already resolved, :func:`resolve_roots`) the path is resolved and must lie
    under one of them, else :class:`ImageRefused` with the same text whether it exists or not; a relative path in
    a row without a folder (a hub dataset) has nothing to be relative to and is refused alike."""
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # ~user of an unknown user
        path = Path(value)
    if not path.is_absolute():
        if base_dir is not None:
            path = base_dir / path
        elif roots is not None:
            raise ImageRefused(outside_message(roots))
    if roots is None:
        return path
    try:
        real = path.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise ImageRefused(outside_message(roots)) from exc
    if not any(real == root or real.is_relative_to(root) for root in roots):
        raise ImageRefused(outside_message(roots))
    return real


def read_image_file(path: Path, confined: bool, budget: ReadBudget | None = None) -> bytes:
    """The bytes of a regular file (never a FIFO, device or folder: those would block or never end). A
    ``confined`` path is already resolved: its last part must not have become a symbolic link meanwhile. The
    messages do not name the file (the caller names it as the row does)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if confined:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise FileMissing("file not found") from exc
        raise ImageRefused(f"cannot be read: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ImageRefused("is not a file")
        if st.st_size > MAX_FILE_BYTES:
            raise ImageRefused(f"is {st.st_size} bytes, more than the {MAX_FILE_BYTES} an image file may have")
        if budget is not None:
            budget.take_bytes(st.st_size)
        os.set_blocking(fh.fileno(), True)
        return fh.read(MAX_FILE_BYTES + 1)


def open_raster_file(fp: str | Path | IO[bytes]) -> Image.Image:
    """``Image.open`` restricted to :data:`RASTER_FORMATS` (lazy, like ``Image.open``): for the store's own PNGs."""
    return Image.open(fp, formats=RASTER_FORMATS)


def decode_raster(data: bytes, budget: ReadBudget | None = None) -> Image.Image:
    """Decode bytes as one of :data:`RASTER_FORMATS`; :class:`ImageRefused` for anything else, for a
    decompression bomb, or for bytes no decoder can read."""
    if not data:
        raise ImageRefused("has zero size (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=RASTER_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRefused(f"is too large to decode: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageRefused(
            f"is unreadable: not a {FORMAT_NAMES} image (Collage opens only these raster formats)"
        ) from exc
    except (OSError, SyntaxError, ValueError, TypeError, EOFError) as exc:
        raise ImageRefused(f"is unreadable: {_plain(exc)}") from exc
    width, height = image.size
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise ImageRefused(
            f"is {width}x{height} pixels, more than the {limit} Collage decodes (Pillow's Image.MAX_IMAGE_PIXELS; "
            "a decompression bomb?)"
        )
    if budget is not None:
        budget.take_bytes(width * height * max(1, len(image.getbands())))
    try:
        image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRefused(f"is too large to decode: {exc}") from exc
    except (OSError, SyntaxError, ValueError, TypeError, EOFError) as exc:
        raise ImageRefused(f"is unreadable: {_plain(exc)}") from exc
    return image


_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _plain(exc: BaseException) -> str:
    """A decoder's message without the in-memory object it names (``cannot identify image file <_io.BytesIO
    object at 0x...>``): the caller names the row and file; a Python object means nothing to the user."""
    return _OBJECT_REPR.sub("", str(exc)).strip() or type(exc).__name__


def as_processor_sees(image: Image.Image) -> tuple[Image.Image, list[str]]:
    """``image`` upright and in RGB, as the families' processors take it, and what was changed (``[]``: nothing).

    - EXIF orientation is applied (``transformers.image_utils.load_image`` does this for a file or URL; a photo
      taken sideways is shown upright to the model, as in every viewer);
    - a non-RGB image is converted like ``transformers.image_transforms.convert_to_rgb`` (``do_convert_rgb``):
      transparency (an alpha band, or a palette's transparent colour) composited onto white, everything else
      (L, 1, P, CMYK, I;16, ...) through Pillow's ``convert("RGB")``.
    """
    changes = []
    orientation = image.getexif().get(0x0112, 1)  # 0x0112: the EXIF Orientation tag
    if orientation not in (1, None):
        upright = ImageOps.exif_transpose(image)
        if upright is not None:
            image = upright
            changes.append(f"EXIF orientation {orientation} applied")
    if image.mode != "RGB":
        mode = image.mode
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba).convert("RGB")
            changes.append(f"{mode} with transparency composited onto white")
        else:
            image = image.convert("RGB")
            changes.append(f"{mode} converted to RGB")
    return image, changes
