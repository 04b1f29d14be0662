"""The loss forward with each distinct prompt computed once: a group's G completions share one prompt.

In a generation batch every prompt (with its images) is followed by ``num_generations`` different completions, and
a micro-batch holds several rows of the same group. A row-by-row forward recomputes the shared prompt once per row,
although it is by far the longer part (a few images are hundreds of tokens; a completion is tens). Here the
distinct prompts run once, with gradients when enabled; their KV cache is gathered to the rows (an index, so
autograd sums every row's gradient back into its prompt), and the completions run on top of it. The hidden states
that predict each completion token are the last prompt position's and the completion positions' but the last,
exactly those of the row-by-row forward.

Positions follow the attention mask as in :func:`~training.batching.forward.forward_kwargs`. Qwen-VL's 3-D
positions: the prompt forward computes them (and, per prompt, their offset from plain positions, ``rope_deltas``);
a completion token's three components are its plain position plus that offset, as Qwen-VL's own decoding does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..models.families import GRID, Family
from .batch import ModelBatch
from .forward import base_model, extra_inputs, forward_kwargs

VisionSource = Callable[[ModelBatch], Any]  # a batch -> its images' encoder outputs (or None: the model encodes)


def prompt_key(ids: list[int], mask: list[int], image_key: str | None) -> tuple:
    """What makes a prompt distinct: its real tokens at their places (the ids where the attention mask is 1, padding
    blanked) and its images' content key. Equal padded ids are not enough: a row whose first real token happens to
    be the pad id looks, padded, like a shorter row with one more pad; the two differ in what they attend to and in
    their positions, so sharing one prompt forward (run with the first row's mask) would be wrong for the other."""
    return tuple(t if m else None for t, m in zip(ids, mask, strict=True)), image_key


def prompt_groups(batch: ModelBatch) -> tuple[list[int], list[int]] | None:
    """``(first row of each distinct prompt, each row's distinct-prompt index)``, prompts told apart by
    :func:`prompt_key`; ``None`` when rows with images carry no content key (a batch restored from an older
    checkpoint), since equal token ids alone would not prove equal images."""
    keys = getattr(batch, "image_keys", None) or [None] * batch.batch_size
    if batch.pixels and any(k is None and n for k, n in zip(keys, batch.num_images, strict=True)):
        return None
    p = batch.prompt_length
    ids, mask = batch.input_ids[:, :p].tolist(), batch.attention_mask[:, :p].tolist()
    seen: dict[tuple, int] = {}
    firsts: list[int] = []
    inverse: list[int] = []
    for row, (row_ids, row_mask, key) in enumerate(zip(ids, mask, keys, strict=True)):
        ident = prompt_key(row_ids, row_mask, key)
        if ident not in seen:
            seen[ident] = len(firsts)
            firsts.append(row)
        inverse.append(seen[ident])
    return firsts, inverse


def _prompts_only(batch: ModelBatch, rows: list[int], layout: str) -> ModelBatch:
    picked = batch.select(rows, layout)
    p = batch.prompt_length
    return replace(
        picked,
        input_ids=picked.input_ids[:, :p],
        attention_mask=picked.attention_mask[:, :p],
        completion_mask=picked.completion_mask[:, :0],
    )


def shared_prompt_hidden(
    model: Any,
    batch: ModelBatch,
    family: Family,
    image_token_id: int,
    groups: tuple[list[int], list[int]],
    vision: VisionSource | None = None,
) -> torch.Tensor:
    """Final hidden states that predict each completion token, ``(B, C, H)``, with each distinct prompt run once.
    ``model`` must return hidden states as ``.logits`` (its LM head swapped for the identity by the caller)."""
    from transformers import DynamicCache

    firsts, inverse = groups
    p, c = batch.prompt_length, batch.input_ids.shape[1] - batch.prompt_length
    device = batch.input_ids.device
    prompts = _prompts_only(batch, firsts, family.layout)
    kwargs = forward_kwargs(prompts, family, image_token_id, vision(prompts) if vision else None)
    inner: Any = getattr(base_model(model), "model", None)
    if hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None  # set by the prompt forward when it computes 3-D positions; never a stale one
    cache = DynamicCache(config=base_model(model).config)
    last = model(**kwargs, cache=cache, use_cache=True, logits_to_keep=1).logits  # (U, 1, H)
    index = torch.as_tensor(inverse, dtype=torch.long, device=device)
    first = last.index_select(0, index)
    if c <= 1:
        return first[:, :c]
    cache.batch_select_indices(index)
    ids = batch.input_ids[:, p : p + c - 1]
    mask = batch.attention_mask[:, : p + c - 1]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, p:]
    if family.layout == GRID:
        deltas = getattr(inner, "rope_deltas", None)
        if deltas is not None and prompts.pixels:
            positions = positions + deltas.to(device).index_select(0, index)
        positions = positions.unsqueeze(0).expand(3, -1, -1)
    text_only = replace(batch, pixels={})  # the completions carry no image inputs
    extra = extra_inputs(ids, text_only, family, image_token_id)
    rest = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, **extra)
    return torch.cat([first, rest.logits], dim=1)
