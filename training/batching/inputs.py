"""Model inputs for samples with 0..k images each: one code path for generation and for the loss forward.

Each prompt is encoded on its own (chat template, processor, text-only truncation), then prompts are
left-padded and their pixel tensors joined by :mod:`training.batching.layouts`. Generation takes the prompt
part; the loss forward takes the same prompt part with completions appended, so both pad identically and
token-type ids cannot drift between the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils.checkpoint

from ..data.rows import RowError, Sample
from ..models.families import GRID, Family
from .layouts import Pixels, join_pixels, pixel_key, select_pixels, slice_pixels


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
        self.processor = processor
        self.family = family
        self.max_prompt_length = max_prompt_length
        self.protected = vision_token_ids(processor.tokenizer, family)
        self.separators = separator_token_ids(processor.tokenizer)
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(family.image_token)

    def render(self, sample: Sample) -> str:
        return self.processor.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=False)

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
        pixels: Pixels = {}
        if sample.images:
            for key in self.family.pixel_keys:
                if key in enc:
                    value = enc[key]
                    # batch-padded processors add a batch axis; per sample we keep the images only
                    pixels[key] = value[0] if value.dim() > 0 and self.family.layout == "batch_padded" else value
            if not pixels:
                raise RowError(sample.row, f"the processor returned no pixel inputs for {len(sample.images)} images")
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

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length :]

    def _take(self, index: torch.Tensor | slice, pixels: Pixels, samples: Sequence[int]):
        keys = getattr(self, "image_keys", [])  # absent from a batch pickled by an older version
        return replace(
            self,
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            completion_mask=self.completion_mask[index],
            pixels=pixels,
            num_images=[self.num_images[i] for i in samples],
            rows=[self.rows[i] for i in samples],
            image_keys=[keys[i] for i in samples] if keys else [],
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
) -> ModelBatch:
    """Left-pad prompts, right-pad completions, join pixels.

    Completion tokens that are vision tokens (a model can generate ``<|image_pad|>``) are replaced by padding
    and masked out of the loss: fed back as they are, they would be taken for image slots.
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
            bad = torch.as_tensor([t in protected for t in completion], dtype=torch.bool)
            comp[bad] = pad_id
            input_ids[i, p_len : p_len + len(comp)] = comp
            attention[i, p_len : p_len + len(comp)] = 1
            completion_mask[i, : len(comp)] = (~bad).long()
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


def _extra_inputs(ids: torch.Tensor, batch: ModelBatch, family: Family, image_token_id: int) -> dict[str, Any]:
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
        **_extra_inputs(batch.input_ids, batch, family, image_token_id),
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
        **_extra_inputs(ids, batch, family, image_token_id),
    }
    if family.layout == GRID:
        kwargs["mm_token_type_ids"] = (ids == image_token_id).long()
    return kwargs


def _completion_logits(model: Any, batch: ModelBatch, family: Family, image_token_id: int) -> torch.Tensor:
    """Logits that predict each completion token, ``(B, C, V)``: the full-logits path, kept as the reference
    that the chunked path (``completion_logprobs_and_entropy``) is tested against."""
    c_len = batch.input_ids.shape[1] - batch.prompt_length
    kwargs = forward_kwargs(batch, family, image_token_id)
    return model(**kwargs, logits_to_keep=c_len + 1).logits[:, :-1, :]


LOGPROB_CHUNK = 256  # completion tokens whose (chunk, V) fp32 logits exist at a time in the chunked path


def base_model(model: Any) -> Any:
    """The ``*ForConditionalGeneration`` under DDP/accelerate (``.module``) and PEFT (``get_base_model``)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _lm_head_slot(model: Any) -> tuple[Any, str, torch.nn.Module]:
    """``(owner, attribute, head)``: where the model keeps the module that turns hidden states into logits."""
    base = base_model(model)
    head = base.get_output_embeddings()
    for name, child in base.named_children():
        if child is head:
            return base, name, head
    raise TypeError(f"{type(base).__name__}: no output embedding module among its children")


def _completion_hidden(
    model: Any,
    batch: ModelBatch,
    family: Family,
    image_token_id: int,
    vision: Callable[[ModelBatch], Any] | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Final hidden states that predict each completion token, ``(B, C, H)``, and the LM head.

    The model's own forward runs (through any DDP/PEFT wrapper, so gradient sync and adapters still apply) with
    its LM head swapped for the identity for the duration of the call: every family's
    ``*ForConditionalGeneration.forward`` computes ``lm_head(slice_logits_to_keep(last_hidden_state))``, so
    ``.logits`` comes back as the kept hidden states and no ``(B, C, V)`` tensor is ever built.

    ``vision``: gives a batch's vision features when they are already computed (:mod:`training.batching.vision`).
    ``share_prompts``: run each distinct prompt once for all its rows (:mod:`training.batching.prefix`).
    """
    from .prefix import prompt_groups, shared_prompt_hidden

    owner, name, head = _lm_head_slot(model)
    c_len = batch.input_ids.shape[1] - batch.prompt_length
    groups = prompt_groups(batch) if share_prompts and c_len > 0 else None
    setattr(owner, name, torch.nn.Identity())
    try:
        if groups is not None and len(groups[0]) < batch.batch_size:
            hidden = shared_prompt_hidden(model, batch, family, image_token_id, groups, vision)
        else:
            kwargs = forward_kwargs(batch, family, image_token_id, vision(batch) if vision else None)
            hidden = model(**kwargs, logits_to_keep=c_len + 1).logits[:, :-1, :]
    finally:
        setattr(owner, name, head)
    return hidden, head


def _chunk_logps_and_entropy(
    hidden: torch.Tensor, ids: torch.Tensor, head: Any, temperature: float, entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``ids`` and entropies for one chunk of hidden states ``(N, H)``: the same ops, in the same
    order, as the full-logits computation."""
    logp_all = torch.log_softmax(head(hidden).float() / temperature, dim=-1)
    logps = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logps, logps.new_zeros(())
    if entropy_grad:
        return logps, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        return logps, -(logp_all.exp() * logp_all).sum(-1)


def chunked_logps_and_entropy(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    head: Any,
    temperature: float = 1.0,
    entropy: bool = True,
    entropy_grad: bool = False,
    chunk_size: int = LOGPROB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logps, entropies)``, each shaped like ``ids``, from hidden states ``(*ids.shape, H)`` through ``head``,
    ``chunk_size`` tokens at a time.

    With gradients enabled each chunk runs under ``torch.utils.checkpoint`` (non-reentrant): its forward keeps
    only the chunk's hidden states, and backward recomputes the chunk's logits, so at most one chunk's
    ``(chunk_size, V)`` fp32 logits (and their softmax) are alive at once, in forward and in backward.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = ids.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_ids = ids.reshape(-1)
    grad = torch.is_grad_enabled()
    logps, ents = [], []
    for lo in range(0, flat_ids.shape[0], chunk_size):
        h, t = flat_h[lo : lo + chunk_size], flat_ids[lo : lo + chunk_size]
        args = (h, t, head, temperature, entropy, entropy_grad)
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logps_and_entropy, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logps_and_entropy(*args)
        logps.append(lp)
        ents.append(ent)
    if not logps:  # no completion tokens
        empty = hidden.float().sum(-1) * 0  # (B, 0), still attached to the graph
        return empty, (empty.clone() if entropy else None)
    out = torch.cat(logps).reshape(shape)
    return out, (torch.cat(ents).reshape(shape) if entropy else None)


def completion_logprobs(
    model: Any,
    batch: ModelBatch,
    family: Family,
    image_token_id: int,
    temperature: float = 1.0,
    chunk_size: int = LOGPROB_CHUNK,
) -> torch.Tensor:
    """Per-token log-probabilities of the completion tokens, ``(B, C)``; padding positions hold garbage and
    must be masked with ``batch.completion_mask``."""
    return completion_logprobs_and_entropy(
        model, batch, family, image_token_id, temperature, entropy=False, chunk_size=chunk_size
    )[0]


def completion_logprobs_and_entropy(
    model: Any,
    batch: ModelBatch,
    family: Family,
    image_token_id: int,
    temperature: float = 1.0,
    entropy: bool = True,
    entropy_grad: bool = False,
    chunk_size: int = LOGPROB_CHUNK,
    vision: Callable[[ModelBatch], Any] | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logps, entropies)`` of the completion tokens under ``softmax(logits / temperature)``, each ``(B, C)``.

    Computed from the final hidden states, ``chunk_size`` tokens at a time through the LM head (never the whole
    ``(B, C, V)`` logits; see ``chunked_logps_and_entropy``). The log-probs carry gradients when grad is
    enabled; the entropies only with ``entropy_grad`` (the entropy bonus trains through them). ``vision`` and
    ``share_prompts``: see :func:`_completion_hidden`."""
    hidden, head = _completion_hidden(model, batch, family, image_token_id, vision, share_prompts)
    return chunked_logps_and_entropy(hidden, batch.completion_ids, head, temperature, entropy, entropy_grad, chunk_size)
