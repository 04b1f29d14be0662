"""How a :class:`~training.batching.batch.ModelBatch` goes into the model: the keyword arguments of the loss
forward and of ``generate``, built from the padded batch so positions and family inputs cannot drift from the
padding, and the model itself found under its DDP/accelerate and PEFT wrappers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.families import GRID, Family
from .batch import ModelBatch, model_pixels


def extra_inputs(ids: torch.Tensor, batch: ModelBatch, family: Family, image_token_id: int) -> dict[str, Any]:
    """Family-specific model inputs, built from the final (padded) ids so they cannot drift from the padding."""
    extra: dict[str, Any] = {}
    if "token_type_ids" in family.extra_inputs:
        # Gemma 3: image soft tokens attend to each other bidirectionally, found through token_type_ids == 1
        extra["token_type_ids"] = (ids == image_token_id).long()
    if "batch_num_images" in family.extra_inputs and batch.pixels:
        # LLaVA-OneVision: anyres patches for single-image samples, the base view only for multi-image ones
        extra["batch_num_images"] = torch.tensor(batch.num_images, dtype=torch.long, device=ids.device)
    return extra


def _vision_inputs(batch: ModelBatch, encoder_outputs: Any | None) -> dict[str, Any]:
    """The batch's image inputs: its pixels, or with ``encoder_outputs`` (the vision encoder's output for exactly
    these samples, see :mod:`training.batching.vision`) those instead of the pixel tensors, so the tower does not
    run again. What the forward needs besides the features (Qwen-VL's ``image_grid_thw`` for its 3-D positions,
    LLaVA-NeXT's ``image_sizes``) stays."""
    pixels = model_pixels(batch.pixels)
    if encoder_outputs is None or not pixels:
        return pixels
    kept = {k: v for k, v in pixels.items() if k not in ("pixel_values", "pixel_attention_mask")}
    return {**kept, "mm_encoder_outputs": {"image": encoder_outputs}}


def forward_kwargs(
    batch: ModelBatch, family: Family, image_token_id: int, encoder_outputs: Any | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``model(**kwargs)`` on this batch (``encoder_outputs``: its images' features, already
    computed).

    Position ids must follow the attention mask, not the raw index, or left padding shifts every position.
    Qwen-VL computes its 3-D positions from ``mm_token_type_ids`` and the mask itself, when there are images;
    for every other case we pass ``cumsum(mask) - 1``.
    """
    kwargs: dict[str, Any] = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        **_vision_inputs(batch, encoder_outputs),
        **extra_inputs(batch.input_ids, batch, family, image_token_id),
    }
    if family.layout == GRID:
        kwargs["mm_token_type_ids"] = (batch.input_ids == image_token_id).long()
        if batch.pixels:
            return kwargs
    positions = batch.attention_mask.long().cumsum(-1) - 1
    kwargs["position_ids"] = positions.clamp(min=0)
    return kwargs


def generation_kwargs(
    batch: ModelBatch, family: Family, image_token_id: int, encoder_outputs: Any | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``model.generate`` (or a prefill forward) on the prompt part of ``batch``.

    ``generate`` derives positions from the attention mask itself (left padding included), so no position ids.
    """
    prompt = slice(0, batch.prompt_length)
    ids = batch.input_ids[:, prompt]
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": batch.attention_mask[:, prompt],
        **_vision_inputs(batch, encoder_outputs),
        **extra_inputs(ids, batch, family, image_token_id),
    }
    if family.layout == GRID:
        kwargs["mm_token_type_ids"] = (ids == image_token_id).long()
    return kwargs


def base_model(model: Any) -> Any:
    """The ``*ForConditionalGeneration`` under DDP/accelerate (``.module``) and PEFT (``get_base_model``)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model
