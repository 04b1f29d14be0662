"""Prompt encoding for samples with 0..k images each: chat template, processor, text-only truncation.

Each prompt is encoded on its own, so one row's images or length never change another's tokens; the encoded
prompts are then left-padded and their pixel tensors joined by :func:`training.batching.batch.collate`.
Truncation drops only text: an image's span (its vision tokens and the separators between its tile rows) is
never cut, since the processor's pixel inputs would no longer match the image slots left in the ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..data.errors import RowError
from ..data.rows import Sample
from ..models.families import Family
from ..templates import TemplateLimit
from ..templates import install as install_template_bounds
from .layouts import Pixels, pixel_key


class PromptTooLongError(RowError):
    pass


@dataclass
class EncodedPrompt:
    row: int
    input_ids: list[int]
    pixels: Pixels  # this sample's images in the family layout; {} without images
    num_images: int
    num_image_tokens: int  # every vision token of the prompt (image pads and their markers)
    truncated_tokens: int = 0  # text tokens removed to fit max_prompt_length
    image_key: str | None = None  # content hash of ``pixels`` (see training.batching.vision); None without images


def vision_token_ids(tokenizer: Any, family: Family) -> set[int]:
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in family.vision_tokens if t in vocab}


def image_span_mask(ids: Sequence[int], vision: set[int], separators: set[int]) -> list[bool]:
    """Which positions belong to an image's span: every vision token, and every separator token (the ``\n``
    between an Idefics3/SmolVLM image's tile rows) that lies between two vision tokens with nothing but
    vision and separator tokens around it. Text next to an image is not part of its span."""
    keep = [t in vision for t in ids]
    last_vision = None
    for i, t in enumerate(ids):
        if t in vision:
            if last_vision is not None and all(ids[j] in separators for j in range(last_vision + 1, i)):
                for j in range(last_vision + 1, i):
                    keep[j] = True
            last_vision = i
        elif t not in separators:
            last_vision = None
    return keep


def truncate_text_only(
    ids: Sequence[int], protected: Sequence[bool], max_length: int, row: int
) -> tuple[list[int], int]:
    """Drop the oldest unprotected tokens until ``ids`` fits ``max_length``; never drop a protected position
    (``protected[i]``: token ``i`` is part of an image's span, see :func:`image_span_mask`).

    Returns the kept ids and how many were dropped. Raises :class:`PromptTooLongError` when the image spans
    alone exceed the limit.
    """
    if len(protected) != len(ids):
        raise ValueError(f"{len(ids)} ids but {len(protected)} protection flags")
    excess = len(ids) - max_length
    if excess <= 0:
        return list(ids), 0
    n_protected = sum(protected)
    if n_protected > max_length:
        raise PromptTooLongError(
            row,
            f"its images alone take {n_protected} vision tokens, more than max_prompt_length={max_length}: "
            "raise max_prompt_length, use fewer or smaller images, or lower the processor's max_pixels",
        )
    kept, dropped = [], 0
    for t, keep in zip(ids, protected, strict=True):
        if dropped < excess and not keep:
            dropped += 1
            continue
        kept.append(t)
    return kept, dropped


def separator_token_ids(tokenizer: Any) -> set[int]:
    """Tokens that are only line breaks (and other whitespace): what separates tile rows inside an image."""
    out = set()
    for token, index in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        if text and not text.strip() and "\n" in text:
            out.add(index)
    return out


class PromptEncoder:
    """Turns a :class:`Sample` into an :class:`EncodedPrompt` for one model's processor."""

    def __init__(self, processor: Any, family: Family, max_prompt_length: int | None = None):
        install_template_bounds()
        self.processor = processor
        self.family = family
        self.max_prompt_length = max_prompt_length
        self.protected = vision_token_ids(processor.tokenizer, family)
        self.separators = separator_token_ids(processor.tokenizer)
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(family.image_token)
        # a run with tools: their JSON schemas, which a chat template with tool support shows the model (Qwen's
        # system turn); None renders prompts exactly as without tools
        self.tools: list[dict[str, Any]] | None = None

    def render(self, sample: Sample) -> str:
        """The row's prompt through the model's chat template, rendered within Collage's bounds
        (:mod:`training.templates`): a template past them makes the row unusable, saying so."""
        extra = {"tools": self.tools} if self.tools else {}
        try:
            return self.processor.apply_chat_template(
                sample.prompt, add_generation_prompt=True, tokenize=False, **extra
            )
        except TemplateLimit as exc:
            raise RowError(sample.row, str(exc)) from exc

    def processor_pixels(self, enc: Any, row: int, num_images: int) -> Pixels:
        """The pixel inputs of one processor output for one sample, in the family layout."""
        pixels: Pixels = {}
        for key in self.family.pixel_keys:
            if key in enc:
                value = enc[key]
                # batch-padded processors add a batch axis; per sample we keep the images only
                pixels[key] = value[0] if value.dim() > 0 and self.family.layout == "batch_padded" else value
        if not pixels:
            raise RowError(row, f"the processor returned no pixel inputs for {num_images} images")
        return pixels

    def encode_segment(self, text: str, images: Sequence[Any], row: int) -> tuple[list[int], Pixels]:
        """The ids and pixels of a piece of a conversation that follows a prompt (a tool turn and the next
        generation prompt, rendered text with one image placeholder per image): the processor expands each image's
        placeholder into that family's image tokens, tiles and separators for the *new* images, and adds no special
        tokens (no second BOS in the middle of a conversation)."""
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt", "add_special_tokens": False}
        if images:
            kwargs["images"] = [list(images)]
        try:
            enc = self.processor(**kwargs)
        except ValueError as exc:
            raise RowError(row, f"the processor rejected a tool turn: {exc}") from exc
        ids = enc["input_ids"][0].tolist()
        pixels = self.processor_pixels(enc, row, len(images)) if images else {}
        return ids, pixels

    def encode(self, sample: Sample) -> EncodedPrompt:
        text = self.render(sample)
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if sample.images:
            kwargs["images"] = [list(sample.images)]
        try:
            enc = self.processor(**kwargs)
        except ValueError as exc:
            raise RowError(sample.row, f"the processor rejected the row: {exc}") from exc
        ids = enc["input_ids"][0].tolist()
        pixels: Pixels = self.processor_pixels(enc, sample.row, len(sample.images)) if sample.images else {}
        n_image_tokens = sum(1 for t in ids if t == self.image_token_id)
        if sample.images and n_image_tokens == 0:
            raise RowError(sample.row, "the processor produced no image tokens for the row's images")
        span = image_span_mask(ids, self.protected, self.separators)
        n_vision = sum(span)
        dropped = 0
        if self.max_prompt_length is not None:
            ids, dropped = truncate_text_only(ids, span, self.max_prompt_length, sample.row)
        n = len(sample.images)
        return EncodedPrompt(sample.row, ids, pixels, n, n_vision, dropped, pixel_key(pixels, n))
