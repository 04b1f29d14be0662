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


# inputs with one entry per prompt token: cut with the prompt for the prefill
_PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


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
) -> Completions:
    """Sample ``num_generations`` completions for each of the distinct prompts of ``batch`` (collated prompts
    without completions, on the model's device); returns them prompt-major (prompt ``i``'s completions are
    ``i*G .. i*G+G-1``).

    Each prompt and its images are prefilled once and the KV cache forked to its ``G`` completions (see
    :func:`_prefill`); ``encoder_outputs``: the prompts' vision features when already computed.
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
        out = model.generate(
            **text_only,
            cache=cache,
            **sampling.generate_kwargs(),
            max_new_tokens=max_completion_length,
            pad_token_id=pad,
            eos_token_id=sorted(stop),
            # vision tokens are never generated: fed back, they would be taken for image slots
            suppress_tokens=sorted(protected) or None,
            use_cache=True,
        )
    finally:
        model.train(was_training)
    ids, truncated = [], []
    for row in out[:, batch.prompt_length :].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), None)
        if cut is None:
            # no EOS: everything generated counts; trailing pads only come after an EOS, so none here
            ids.append(row[:max_completion_length])
            truncated.append(True)
        else:
            ids.append(row[: cut + 1])
            truncated.append(False)
    return Completions(ids, truncated)


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
