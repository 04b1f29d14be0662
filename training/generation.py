"""Sample completions for a batch of distinct prompts, each prefilled once and forked to its group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .batching.batch import ModelBatch
from .batching.forward import base_model, generation_kwargs
from .models.families import GRID, Family


@dataclass
class Completions:
    ids: list[list[int]]  # up to and including EOS when there is one
    truncated: list[bool]  # no EOS within max_completion_length
    # what a later turn continues from (multi-turn rollouts, asked for with ``keep_cache``); None otherwise
    state: Continuation | None = None


@dataclass
class Continuation:
    """The KV cache a multi-turn rollout's next turn continues from, row by row as the completions came.

    ``ids``: every column the cache holds (prompt padding, the prompt, each turn, and the padding after a row's
    EOS while longer rows went on), ``mask``: 1 on the real tokens of each row, 0 on that padding, so a later turn
    attends to a row's real tokens only and takes its positions from their count. ``pending``: per row, the
    tokens of its last turn the cache does not hold yet (``generate`` never feeds the last token it samples).
    ``rope_deltas`` (Qwen-VL): per row, its next 3-D position minus its count of real tokens."""

    cache: Any
    ids: torch.Tensor
    mask: torch.Tensor
    pending: list[list[int]]
    rope_deltas: torch.Tensor | None


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled (TRL's names and meanings): plain temperature sampling unless ``top_p`` < 1,
    ``top_k`` > 0, ``min_p`` or ``repetition_penalty`` != 1 is set. ``greedy``: no sampling at all, the most likely
    token each step (held-out evaluation with one completion per prompt); only ``repetition_penalty`` still applies,
    and nothing is drawn from the random stream."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    greedy: bool = False

    def generate_kwargs(self) -> dict[str, Any]:
        """The arguments of transformers' ``generate`` that say how tokens are chosen."""
        if self.greedy:  # the warpers are unset, so transformers neither applies nor warns about them
            return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None, "min_p": None,
                    "repetition_penalty": self.repetition_penalty}  # fmt: skip
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}  # fmt: skip


def _repeat(value: Any, times: int) -> Any:
    return value.repeat_interleave(times, dim=0) if isinstance(value, torch.Tensor) else value


def _prefill(model: Any, kwargs: dict[str, Any], num_generations: int, model_positions: bool) -> Any:
    """Run every distinct prompt but its last token through the model once, and return the KV cache repeated
    ``num_generations`` times per prompt (prompt-major: prompt ``i``'s copies are rows ``i*G .. i*G+G-1``).

    The images are consumed here (their tokens all lie before the last prompt token, which is the chat template's
    assistant header), so ``generate`` continues from the cache with text only and samples exactly as it would
    have from the full prompt. Positions follow the attention mask (left padding), as ``generate`` makes them,
    unless ``model_positions``: Qwen-VL with images computes its 3-D positions itself and keeps their offsets from
    plain positions (``rope_deltas``) on the model for the decoding steps; they are repeated like the cache, and
    reset first so that a text-only batch never decodes with a previous batch's offsets.
    """
    from transformers import DynamicCache

    head = {k: (v[:, :-1] if k in _PER_TOKEN else v) for k, v in kwargs.items()}
    if not model_positions:
        head["position_ids"] = (head["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
    inner: Any = getattr(base_model(model), "model", None)
    has_deltas = hasattr(inner, "rope_deltas")
    if has_deltas:
        inner.rope_deltas = None
    cache = DynamicCache(config=model.config)
    model(**head, cache=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(num_generations)
    if has_deltas:
        deltas = inner.rope_deltas
        if deltas is None:
            deltas = torch.zeros((head["input_ids"].shape[0], 1), dtype=torch.long, device=head["input_ids"].device)
        inner.rope_deltas = deltas.repeat_interleave(num_generations, dim=0)
    return cache


def _windowed(cache: Any) -> bool:
    """Whether some layer attends over a sliding window (Gemma 3's local layers). Such a window counts columns,
    not tokens: the padding a continued turn puts between a row's cached tokens and its new ones would take room
    in it, so these models get each later turn as a fresh prompt instead."""
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def _rope_model(model: Any) -> Any | None:
    """The inner model that keeps Qwen-VL's ``rope_deltas`` between generation steps, or None."""
    inner: Any = getattr(base_model(model), "model", None)
    return inner if hasattr(inner, "rope_deltas") else None


# inputs with one entry per prompt token: cut with the prompt for the prefill
_PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def _decode(
    model: Any,
    inputs: dict[str, Any],
    cache: Any,
    sampling: Sampling,
    max_new_tokens: int,
    pad: int,
    stop: set[int],
    protected: set[int],
) -> Any:
    """``model.generate`` from a filled cache (``inputs``: the ids and mask up to now, the cached columns included)."""
    return model.generate(
        **inputs,
        cache=cache,
        **sampling.generate_kwargs(),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=sorted(stop),
        # vision tokens are never generated: fed back, they would be taken for image slots
        suppress_tokens=sorted(protected) or None,
        use_cache=True,
        # transformers keeps every rank decoding in lockstep for a sharded model (an all-reduce per token); a
        # sharded policy is gathered for the whole batch (training.sharding.gathered), so each rank stops on its own
        synced_gpus=False,
    )


@torch.no_grad()
def generate(
    model: Any,
    batch: ModelBatch,
    num_generations: int,
    family: Family,
    tokenizer: Any,
    image_token_id: int,
    protected: set[int],
    max_completion_length: int,
    sampling: Sampling,
    encoder_outputs: Any | None = None,
    keep_cache: bool = False,
) -> Completions:
    """Sample ``num_generations`` completions for each of the distinct prompts of ``batch`` (collated prompts
    without completions, on the model's device); returns them prompt-major (prompt ``i``'s completions are
    ``i*G .. i*G+G-1``).

    Each prompt and its images are prefilled once and the KV cache forked to its ``G`` completions (see
    :func:`_prefill`); ``encoder_outputs``: the prompts' vision features when already computed. ``keep_cache``:
    the completions carry the cache for a next turn (:func:`resume`).
    """
    pad = tokenizer.pad_token_id
    stop = eos_ids(model, tokenizer)
    kwargs = generation_kwargs(batch, family, image_token_id, encoder_outputs)
    was_training = model.training
    model.eval()
    try:
        model_positions = family.layout == GRID and bool(batch.pixels)
        cache = _prefill(model, kwargs, num_generations, model_positions)
        text_only = {k: _repeat(kwargs[k], num_generations) for k in ("input_ids", "attention_mask")}
        if "mm_token_type_ids" in kwargs:  # Qwen-VL reads it to tell that no new image comes after the cache
            text_only["mm_token_type_ids"] = _repeat(kwargs["mm_token_type_ids"], num_generations)
        out = _decode(model, text_only, cache, sampling, max_completion_length, pad, stop, protected)
    finally:
        model.train(was_training)
    mask = _repeat(kwargs["attention_mask"], num_generations) if keep_cache else None
    return _completions(out, batch.prompt_length, stop, max_completion_length, cache, mask, _rope_model(model))


def _completions(
    out: torch.Tensor,
    prompt_length: int,
    stop: set[int],
    max_new: int,
    cache: Any,
    prompt_mask: torch.Tensor | None,
    rope: Any | None,
) -> Completions:
    """Cut ``generate``'s output rows (``prompt_length`` columns of context, then the new tokens) at their first
    EOS; with ``prompt_mask`` (the context's attention mask) keep what a next turn continues from."""
    ids, truncated = [], []
    for row in out[:, prompt_length:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), None)
        if cut is None:
            # no EOS: everything generated counts; trailing pads only come after an EOS, so none here
            ids.append(row[:max_new])
            truncated.append(True)
        else:
            ids.append(row[: cut + 1])
            truncated.append(False)
    if prompt_mask is None or _windowed(cache):
        return Completions(ids, truncated)
    held = cache.get_seq_length()  # every column but the last sampled one
    new = torch.zeros((out.shape[0], held - prompt_length), dtype=prompt_mask.dtype, device=prompt_mask.device)
    for r, row_ids in enumerate(ids):
        new[r, : min(len(row_ids), held - prompt_length)] = 1
    deltas = None if rope is None or rope.rope_deltas is None else rope.rope_deltas.clone()
    state = Continuation(
        cache,
        out[:, :held],
        torch.cat([prompt_mask, new], dim=1),
        [row_ids[held - prompt_length :] for row_ids in ids],
        deltas,
    )
    return Completions(ids, truncated, state)


@torch.no_grad()
def resume(
    model: Any,
    state: Continuation,
    rows: list[int],
    segments: ModelBatch,
    family: Family,
    tokenizer: Any,
    image_token_id: int,
    protected: set[int],
    max_new_tokens: int,
    sampling: Sampling,
    encoder_outputs: Any | None = None,
) -> Completions:
    """The next turn of the rollouts ``rows`` of ``state`` (the others have finished and leave the cache), one
    completion each, continuing from the cache: only the new tokens are run through the model.

    ``segments``: per kept row, in order, what comes after the cached columns (the row's ``pending`` tokens, then
    its tool turn and the next generation prompt) with the tool turn's images, collated as prompts (left-padded,
    on the device); ``encoder_outputs``: their images' features when already computed. The padding sits between
    the cached columns and a row's new tokens and is masked, so each row attends to its real tokens only, and
    positions are counted over those (Qwen-VL: its 3-D positions are computed for the new tokens alone, images
    included, and moved to start where the row's cached positions end; positions only ever add up, so this is
    exactly the positions of the whole conversation).
    """
    pad = tokenizer.pad_token_id
    stop = eos_ids(model, tokenizer)
    index = torch.tensor(rows, dtype=torch.long, device=state.ids.device)
    cache = state.cache
    cache.batch_select_indices(index)
    cached_ids, cached_mask = state.ids[index], state.mask[index]
    block_ids, block_mask = segments.input_ids, segments.attention_mask.to(cached_mask.dtype)
    ids = torch.cat([cached_ids, block_ids], dim=1)
    mask = torch.cat([cached_mask, block_mask], dim=1)
    head: dict[str, Any] = {"input_ids": block_ids[:, :-1], "attention_mask": mask[:, :-1]}
    vision = generation_kwargs(segments, family, image_token_id, encoder_outputs)
    head.update({k: v for k, v in vision.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")})
    if "token_type_ids" in family.extra_inputs:  # Gemma 3's bidirectional image blocks are read by position
        head["token_type_ids"] = (ids[:, :-1] == image_token_id).long()
    rope = _rope_model(model)
    if rope is not None and state.rope_deltas is not None:
        positions, rope.rope_deltas = _continued_rope(rope, state, index, cached_mask, segments, image_token_id, vision)
        head["position_ids"] = positions[..., :-1]
    else:
        head["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, cached_ids.shape[1] : -1]
    was_training = model.training
    model.eval()
    try:
        model(**head, cache=cache, use_cache=True, logits_to_keep=1)
        extra = {"mm_token_type_ids": (ids == image_token_id).long()} if family.layout == GRID else {}
        out = _decode(model, {"input_ids": ids, "attention_mask": mask, **extra}, cache, sampling, max_new_tokens,
                      pad, stop, protected)  # fmt: skip
    finally:
        model.train(was_training)
    return _completions(out, ids.shape[1], stop, max_new_tokens, cache, mask, rope)


def _continued_rope(
    rope: Any,
    state: Continuation,
    index: torch.Tensor,
    cached_mask: torch.Tensor,
    segments: ModelBatch,
    image_token_id: int,
    vision: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-VL's 3-D positions of the new tokens (3, rows, new columns) and each row's deltas after them."""
    assert state.rope_deltas is not None
    block_ids, block_mask = segments.input_ids, segments.attention_mask
    if "image_grid_thw" in vision:
        types = (block_ids == image_token_id).long()
        positions, _ = rope.get_rope_index(
            block_ids, mm_token_type_ids=types, image_grid_thw=vision["image_grid_thw"], attention_mask=block_mask
        )
    else:
        positions = ((block_mask.long().cumsum(-1) - 1).clamp(min=0)).unsqueeze(0).expand(3, -1, -1)
    start = cached_mask.long().sum(-1, keepdim=True) + state.rope_deltas[index]  # each row's next position
    positions = (positions + start.unsqueeze(0)) * block_mask.unsqueeze(0)
    real = cached_mask.long().sum(-1, keepdim=True) + block_mask.long().sum(-1, keepdim=True)
    deltas = positions.amax(dim=(0, 2)).unsqueeze(-1) + 1 - real
    return positions, deltas


# The generation-backend seam (`train.generation_backend`). A backend takes the same arguments as `generate`
# (the policy model, the collated distinct prompts on its device, num_generations, the family, tokenizer, image-token id, the
# vision tokens it must never emit, max_completion_length, the `Sampling` settings and the prompts' vision features
# when already computed) and returns `Completions`, prompt-major: the completion ids up to and including EOS and
# whether each was truncated. A vLLM backend would hold a colocated
# engine, load the policy's weights into it after every optimizer step, and pass each prompt with its images as
# multi-modal data; it is not shipped: it needs a GPU to build and to measure.
BACKENDS = {"hf": generate}


def backend(name: str):
    try:
        return BACKENDS[name]
    except KeyError as exc:
        raise ValueError(f"train.generation_backend: unknown backend {name!r} (known: {', '.join(BACKENDS)})") from exc
