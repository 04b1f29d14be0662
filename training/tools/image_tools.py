"""The built-in image tools: ``image_zoom_in`` (a crop of a region, DeepEyes / Mini-o3 style) and ``image_rotate``.

Both name the image they act on by its number in the rollout: the row's own images first (0, 1, ...), then every
image a tool returned, in order of appearance; the default is the last image. Their docstrings are what the model
is told about them (the JSON schema comes from the signature, as for every tool); the keyword-only parameters after
``*`` are Collage's (the rollout's images and the tool's settings) and are never shown to the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PIL import Image

from collage.training.infra.errors import InputError

from .types import ToolImage, ToolResult

MIN_CROP_SIDE = 28  # a crop smaller than this on a side is refused: it is smaller than one vision patch pair


class ToolArgumentError(InputError):
    """A tool's arguments are wrong; the message is what the model sees (as a tool error, never the run's end)."""


def _pick(images: list[Any], image: int | None) -> tuple[int, Any]:
    if not images:
        raise ToolArgumentError("there is no image to act on")
    k = len(images) - 1 if image is None else image
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(images):
        raise ToolArgumentError(f"image must be an image number from 0 to {len(images) - 1}, got {image!r}")
    return k, images[k]


def _box(bbox_2d: Any, width: int, height: int, coords: str) -> tuple[int, int, int, int]:
    if not isinstance(bbox_2d, (list, tuple)) or len(bbox_2d) != 4:
        raise ToolArgumentError("bbox_2d must be a list of four numbers [x1, y1, x2, y2]")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox_2d):
        raise ToolArgumentError("bbox_2d must be a list of four numbers [x1, y1, x2, y2]")
    x1, y1, x2, y2 = (float(v) for v in bbox_2d)
    if coords == "normalised":
        x1, x2, y1, y2 = x1 * width, x2 * width, y1 * height, y2 * height
    if x2 <= x1 or y2 <= y1:
        raise ToolArgumentError("bbox_2d must have x2 > x1 and y2 > y1")
    # clamped to the image, so a box that runs off an edge still gives what lies inside it
    left, top = max(0, round(x1)), max(0, round(y1))
    right, bottom = min(width, round(x2)), min(height, round(y2))
    if right - left < MIN_CROP_SIDE or bottom - top < MIN_CROP_SIDE:
        raise ToolArgumentError(
            f"the region inside the image is {max(0, right - left)}x{max(0, bottom - top)} px; a zoom needs at "
            f"least {MIN_CROP_SIDE} px a side (the image is {width}x{height})"
        )
    return left, top, right, bottom


def fit_long_side(image: Any, max_side: int | None) -> Any:
    """``image`` scaled down (never up) so its long side is at most ``max_side`` pixels; as is without a limit."""
    if max_side is None or max(image.size) <= max_side:
        return image
    scale = max_side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def image_zoom_in(
    bbox_2d: list[float],
    image: int | None = None,
    label: str | None = None,
    *,
    images: list[Any],
    coords: str = "pixel",
    max_side: int | None = None,
) -> ToolResult:
    """Zoom in on a region of an image: returns the region cropped out at full resolution, as a new image.

    Args:
        bbox_2d: The region as [x1, y1, x2, y2], in the pixel coordinates of the image (x to the right, y down).
        image: Which image to crop: 0 is the first image of the conversation, then every earlier tool image in
            order; default the last one.
        label: An optional name for what the region shows.
    """
    k, source = _pick(images, image)
    left, top, right, bottom = _box(bbox_2d, source.width, source.height, coords)
    crop = fit_long_side(source.convert("RGB").crop((left, top, right, bottom)), max_side)
    text = f"Zoomed in on [{left}, {top}, {right}, {bottom}] of image {k}" + (f" ({label})" if label else "") + "."
    return ToolResult(text, [ToolImage(crop, {"image": k, "bbox_2d": [left, top, right, bottom]})])


def image_rotate(angle: int, image: int | None = None, *, images: list[Any], max_side: int | None = None) -> ToolResult:
    """Rotate an image counter-clockwise by 90, 180 or 270 degrees: returns the rotated image.

    Args:
        angle: The rotation in degrees, counter-clockwise: 90, 180 or 270.
        image: Which image to rotate: 0 is the first image of the conversation, then every earlier tool image in
            order; default the last one.
    """
    if isinstance(angle, bool) or angle not in (90, 180, 270):
        raise ToolArgumentError(f"angle must be 90, 180 or 270, got {angle!r}")
    k, source = _pick(images, image)
    turned = fit_long_side(source.convert("RGB").rotate(angle, expand=True), max_side)
    box = [0, 0, source.width, source.height]
    return ToolResult(f"Image {k} rotated by {angle} degrees.", [ToolImage(turned, {"image": k, "bbox_2d": box})])


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"image_zoom_in": image_zoom_in, "image_rotate": image_rotate}
