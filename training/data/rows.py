"""One dataset row: its prompt normalised to a conversation and its images decoded and checked.

Every problem is a :class:`RowError` that names the row and says what is wrong, so ``collage data check`` and
the trainer report the same thing in the same words.
"""

from __future__ import annotations

import hashlib
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from collage.training.infra.images import (
    FileMissing,
    ImageRefused,
    ReadBudget,
    as_processor_sees,
    decode_raster,
    image_file,
    read_image_file,
)

from .errors import RowError
from .mapping import RowMapping

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ImageSource:
    """Where a decoded image came from: the SHA-256 of the bytes it was decoded from and, when those bytes are
    already a PNG, the bytes themselves, so rollout rows can reference the image without re-encoding it."""

    sha256: str
    png: bytes | None  # the original bytes when they are a PNG the model sees unchanged, else None
    format: str | None = None
    # what was done to make it what the processor takes (RGB, upright): "P with transparency composited onto white"
    changes: tuple[str, ...] = ()


_SOURCE_ATTR = "_collage_source"


def image_source(image: Any) -> ImageSource | None:
    """The :class:`ImageSource` :func:`open_image` attached to ``image``, or None (an image made in memory)."""
    source = getattr(image, _SOURCE_ATTR, None)
    return source if isinstance(source, ImageSource) else None


@dataclass
class Sample:
    """A usable row: a conversation with one ``{"type": "image"}`` part per image, images in that order."""

    row: int
    prompt: list[dict[str, Any]]
    images: list[Image.Image]
    columns: dict[str, Any] = field(default_factory=dict)  # every other column, passed on to reward functions

    @property
    def num_images(self) -> int:
        return len(self.images)


@dataclass
class RawRow:
    """A row as stored, before images are opened. ``base_dir`` resolves relative image paths; ``roots`` (resolved)
    confine them, None leaves them unconfined (the loader sets both). ``mapping`` (a
    :class:`~training.data.mapping.RowMapping`; None: TRL's column names) says where the prompt, images and answer
    are. ``problem``: why the stored row could not even be read (a malformed JSONL line): it is a bad row."""

    row: int
    data: dict[str, Any]
    base_dir: Path | None = None
    roots: tuple[Path, ...] | None = None
    mapping: Any = None
    problem: str | None = None

    def _mapped(self) -> Any:
        if self.problem is not None:
            raise RowError(self.row, self.problem)
        return (self.mapping or RowMapping()).apply(self.row, self.data)

    def image_refs(self) -> list[Any]:
        return self._mapped().image_refs

    def to_sample(self, budget: ReadBudget | None = None) -> Sample:
        """The usable row, or :class:`RowError`; ``budget`` bounds what a preview reads (None: no bound)."""
        mapped = self._mapped()
        refs = mapped.image_refs
        images = [open_image(self.row, i, ref, self.base_dir, self.roots, budget) for i, ref in enumerate(refs)]
        prompt = normalise_prompt(self.row, mapped.prompt, len(images))
        return Sample(row=self.row, prompt=prompt, images=images, columns=mapped.columns)


def count_placeholders(prompt: list[dict[str, Any]]) -> int:
    return sum(
        1
        for message in prompt
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in ("image", "image_url")
    )


def normalise_prompt(row: int, prompt: Any, num_images: int) -> list[dict[str, Any]]:
    """A conversation whose content is always a list of parts.

    A plain string with N images becomes one user turn with N image placeholders before the text. A
    conversation must already hold exactly one placeholder per image: guessing where images go would silently
    change what the model sees.
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]}]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise RowError(
            row,
            "prompt is not conversational: expected a string or a non-empty list of {role, content} messages, "
            f"got {type(prompt).__name__}",
        )
    messages = []
    for m, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RowError(row, f"prompt is not conversational: message {m} is not a {{role, content}} object")
        if message["role"] not in ROLES:
            raise RowError(
                row,
                f"prompt is not conversational: message {m} has role {reprlib.repr(message['role'])}, not one of {ROLES}",
            )
        messages.append({"role": message["role"], "content": _normalise_content(row, m, message["content"])})
    found = count_placeholders(messages)
    if found != num_images:
        raise RowError(row, f"prompt has {found} image placeholder(s) but the row has {num_images} image(s)")
    return messages


def _normalise_content(row: int, m: int, content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, (list, tuple)):
        raise RowError(row, f"prompt is not conversational: message {m} content must be a string or a list of parts")
    parts = []
    for p, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "image_url"):
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise RowError(
                row,
                f"prompt is not conversational: message {m} part {p} must be {{type: text, text}} or {{type: image}}",
            )
    return parts


def open_image(
    row: int,
    index: int,
    ref: Any,
    base_dir: Path | None,
    roots: Sequence[Path] | None = None,
    budget: ReadBudget | None = None,
) -> Image.Image:
    """Decode image ``index`` of a row from a path, bytes, a ``{path, bytes}`` dict or a PIL image.

    A path is confined to ``roots`` (resolved already, see :func:`training.images.resolve_roots`; None:
    unconfined) before anything looks at the file, and only raster formats are decoded (:mod:`training.images`).
    ``budget`` bounds what a preview reads; running out raises :class:`~training.images.BudgetExhausted`."""
    what = f"image {index}"
    if isinstance(ref, Image.Image):
        image, _ = as_processor_sees(ref)
    else:
        if budget is not None:
            budget.take_image()
        if isinstance(ref, dict):
            data, path = ref.get("bytes"), ref.get("path")
        elif isinstance(ref, (bytes, bytearray)):
            data, path = bytes(ref), None
        elif isinstance(ref, str):
            data, path = None, ref
        else:
            raise RowError(row, f"{what} is a {type(ref).__name__}: expected a path, bytes or {{path, bytes}}")
        if data is not None and not isinstance(data, (bytes, bytearray)):
            raise RowError(row, f"{what} 'bytes' is a {type(data).__name__}, not bytes")
        if data is None and path is not None and not isinstance(path, str):
            raise RowError(row, f"{what} 'path' is a {type(path).__name__}, not a string")
        if data is None and not path:
            raise RowError(row, f"{what} is empty: no path and no bytes")
        try:
            if data is None:
                assert path is not None  # checked above: a path or bytes
                file = image_file(path, base_dir, roots)  # confined first: nothing below runs for an outside path
                shown = _shown(path, base_dir)
                try:
                    data = read_image_file(file, confined=roots is not None, budget=budget)
                except FileMissing as exc:
                    raise RowError(row, f"{what} file not found: {shown}") from exc
                what = f"{what} ({shown})"
            elif budget is not None:
                budget.take_bytes(len(data))
            image = decode_raster(bytes(data), budget)
        except ImageRefused as exc:
            raise RowError(row, f"{what} {exc}") from exc
        fmt = image.format
        if image.width == 0 or image.height == 0:
            raise RowError(row, f"{what} has zero size ({image.width}x{image.height})")
        try:
            image, changes = as_processor_sees(image)
        except (OSError, ValueError) as exc:  # a mode Pillow cannot convert
            raise RowError(row, f"{what} cannot be converted to RGB ({exc})") from exc
        # hashed once here, from the bytes already in memory: rollout rows reference this hash (and, for a PNG the
        # model sees as it is, these bytes) instead of re-encoding the decoded image at every step; a converted
        # image is encoded as the model sees it, once, by the rollout writer
        png = bytes(data) if fmt == "PNG" and not changes else None
        source = ImageSource(hashlib.sha256(data).hexdigest(), png, fmt, tuple(changes))
        setattr(image, _SOURCE_ATTR, source)
    if image.width == 0 or image.height == 0:
        raise RowError(row, f"{what} has zero size ({image.width}x{image.height})")
    return image


def _shown(path: str, base_dir: Path | None) -> Path | str:
    """How a row error names an image file: as the row's folder and the row name it (never a resolved link
    target, which the row's author may not know)."""
    return base_dir / path if base_dir is not None and not Path(path).is_absolute() else path
