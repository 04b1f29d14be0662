"""A batch of encoded prompts (and completions): one code path for generation and for the loss forward.

Prompts are left-padded and their pixel tensors joined by :mod:`training.batching.layouts`. Generation takes the
prompt part; the loss forward takes the same prompt part with completions appended, so both pad identically and
token-type ids cannot drift between the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..models.families import Family
from .encoding import EncodedPrompt
from .layouts import Pixels, join_pixels, select_pixels, slice_pixels


@dataclass
class ModelBatch:
    """Left-padded prompts (+ right-padded completions) and the joined pixel inputs of a batch."""

    input_ids: torch.Tensor  # (B, P + C)
    attention_mask: torch.Tensor  # (B, P + C)
    prompt_length: int  # P: every prompt is left-padded to this length
    completion_mask: torch.Tensor  # (B, C) 1 where a completion token counts in the loss
    pixels: Pixels
    num_images: list[int]
    rows: list[int] = field(default_factory=list)
    image_keys: list[str | None] = field(default_factory=list)  # per sample: its EncodedPrompt.image_key
    # per sample: how many of its images lie in its completion (a multi-turn rollout's tool images); a batch with
    # any is never run prompt-shared (training.batching.prefix runs completions as text)
    tool_images: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length :]

    def _take(self, index: torch.Tensor | slice, pixels: Pixels, samples: Sequence[int]):
        keys = getattr(self, "image_keys", [])  # absent from a batch pickled by an older version
        tools = getattr(self, "tool_images", [])
        return replace(
            self,
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            completion_mask=self.completion_mask[index],
            pixels=pixels,
            num_images=[self.num_images[i] for i in samples],
            rows=[self.rows[i] for i in samples],
            image_keys=[keys[i] for i in samples] if keys else [],
            tool_images=[tools[i] for i in samples] if tools else [],
        )

    def trimmed(self) -> ModelBatch:
        """The batch without the columns that are padding in every row (leading prompt columns, trailing
        completion columns): a micro-batch cut from a generation batch is otherwise padded to the longest prompt
        and completion of the whole generation batch. Positions follow the attention mask, so they do not move."""
        att = self.attention_mask
        p = self.prompt_length
        prompt_real = att[:, :p].bool().any(dim=0)
        lead = int(prompt_real.long().argmax()) if bool(prompt_real.any()) else p
        tail = att[:, p:].bool().any(dim=0) | self.completion_mask.bool().any(dim=0)
        c = int(tail.nonzero().max()) + 1 if bool(tail.any()) else 0
        if lead == 0 and c == att.shape[1] - p:
            return self
        return replace(
            self,
            input_ids=self.input_ids[:, lead : p + c],
            attention_mask=att[:, lead : p + c],
            prompt_length=p - lead,
            completion_mask=self.completion_mask[:, :c],
        )

    def slice(self, start: int, end: int, layout: str) -> ModelBatch:
        """The contiguous micro-batch ``[start, end)``, each sample's pixels with it."""
        pixels = slice_pixels(layout, self.pixels, self.num_images, start, end)
        return self._take(slice(start, end), pixels, range(start, end))

    def select(self, order: Sequence[int], layout: str) -> ModelBatch:
        """Samples in a new order (a shuffle, or a subset)."""
        pixels = select_pixels(layout, self.pixels, self.num_images, order)
        index = torch.as_tensor(list(order), dtype=torch.long)
        return self._take(index, pixels, order)


def collate(
    prompts: Sequence[EncodedPrompt],
    family: Family,
    pad_id: int,
    completions: Sequence[Sequence[int]] | None = None,
    protected: set[int] | None = None,
    generated: Sequence[Sequence[int]] | None = None,
    tool_images: Sequence[int] | None = None,
) -> ModelBatch:
    """Left-pad prompts, right-pad completions, join pixels.

    Completion tokens that are vision tokens (a model can generate ``<|image_pad|>``) are replaced by padding
    and masked out of the loss: fed back as they are, they would be taken for image slots.

    ``generated`` (multi-turn rollouts): per completion, 1 where the model generated the token and 0 where the
    template or a tool put it there; only generated tokens count in the loss (TRL's ``tool_mask``), and only they
    are checked for vision tokens: a tool turn's image tokens are real image slots, its images (``tool_images``
    of them per sample, the last of the sample's images) in the prompt's pixels.
    """
    p_len = max(len(p.input_ids) for p in prompts)
    completions = completions if completions is not None else [[] for _ in prompts]
    if len(completions) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    c_len = max((len(c) for c in completions), default=0)
    protected = protected or set()
    batch = len(prompts)
    input_ids = torch.full((batch, p_len + c_len), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, p_len + c_len), dtype=torch.long)
    completion_mask = torch.zeros((batch, c_len), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        n = len(prompt.input_ids)
        input_ids[i, p_len - n : p_len] = torch.as_tensor(prompt.input_ids)
        attention[i, p_len - n : p_len] = 1
        if completion:
            comp = torch.as_tensor(list(completion), dtype=torch.long)
            own = torch.ones(len(comp), dtype=torch.bool)
            if generated is not None:
                if len(generated[i]) != len(comp):
                    raise ValueError(f"completion {i}: {len(comp)} tokens but {len(generated[i])} generated flags")
                own = torch.as_tensor(list(generated[i]), dtype=torch.bool)
            bad = torch.as_tensor([t in protected for t in completion], dtype=torch.bool) & own
            comp[bad] = pad_id
            input_ids[i, p_len : p_len + len(comp)] = comp
            attention[i, p_len : p_len + len(comp)] = 1
            completion_mask[i, : len(comp)] = (own & ~bad).long()
    per_sample = [_tiles_in_image_slots(p.pixels, p.num_images) for p in prompts] if family.tiled else None
    pixels = join_pixels(family.layout, per_sample or [p.pixels for p in prompts])
    return ModelBatch(
        input_ids=input_ids,
        attention_mask=attention,
        prompt_length=p_len,
        completion_mask=completion_mask,
        pixels=pixels,
        num_images=[p.num_images for p in prompts],
        rows=[p.row for p in prompts],
        image_keys=[p.image_key for p in prompts],
        tool_images=list(tool_images) if tool_images is not None else [],
    )


TILE_COUNTS = "collage_tile_counts"  # not a model input: forward_kwargs / generation_kwargs turn it back into tiles


def _tiles_in_image_slots(pixels: Pixels, num_images: int) -> Pixels:
    """A tiled family's per-sample pixels, one slot per image, so the image_indexed split stays per sample.

    InternVL (dynamic tiling) and Gemma 3 (pan-and-scan crops) return ``pixel_values`` as ``(tiles, 3, H, W)``: a
    variable number of tiles per image, so cutting it by image counts would hand one sample's tiles to another.
    The sample's tiles, in order, are dealt into ``num_images`` slots of ``ceil(tiles / num_images)`` (zero-padded;
    ``TILE_COUNTS`` says how many of a slot are real) and :func:`model_pixels` concatenates them back. Slots are
    a carrier, not images: the model only needs every tile once, in order.
    """
    if not pixels:
        return {}
    tiles = pixels["pixel_values"]
    total = tiles.shape[0]
    if num_images < 1 or total < num_images:
        raise ValueError(f"{total} tiles for {num_images} images: every image has at least one tile")
    width = -(-total // num_images)
    counts = [max(0, min(width, total - i * width)) for i in range(num_images)]
    slots = tiles.new_zeros((num_images, width, *tiles.shape[1:]))
    for i, n in enumerate(counts):
        slots[i, :n] = tiles[i * width : i * width + n]
    out = {k: v for k, v in pixels.items() if k != "pixel_values"}
    out["pixel_values"] = slots
    out[TILE_COUNTS] = torch.tensor(counts, dtype=torch.long)
    return out


def model_pixels(pixels: Pixels) -> Pixels:
    """The batch pixels as the model takes them (a tiled family's slots concatenated back into tiles)."""
    if TILE_COUNTS not in pixels:
        return dict(pixels)
    out = {k: v for k, v in pixels.items() if k != TILE_COUNTS}
    slots = pixels["pixel_values"]
    out["pixel_values"] = torch.cat([slots[i, :n] for i, n in enumerate(pixels[TILE_COUNTS].tolist())])
    return out
