"""Sample completions for a batch of encoded prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .batching.inputs import EncodedPrompt, collate, generation_kwargs
from .models.families import Family


@dataclass
class Completions:
    ids: list[list[int]]  # up to and including EOS when there is one
    truncated: list[bool]  # no EOS within max_completion_length


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


@torch.no_grad()
def generate(
    model: Any,
    prompts: list[EncodedPrompt],
    family: Family,
    tokenizer: Any,
    image_token_id: int,
    protected: set[int],
    max_completion_length: int,
    temperature: float,
) -> Completions:
    """Sample one completion per prompt (prompts already repeated per generation)."""
    pad = tokenizer.pad_token_id
    batch = collate(prompts, family, pad)
    stop = eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            **generation_kwargs(batch, family, image_token_id),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
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
# (the policy model, the encoded prompts already repeated per generation, the family, tokenizer, image-token id,
# the vision tokens it must never emit, max_completion_length, temperature) and returns `Completions`: the
# completion ids up to and including EOS and whether each was truncated. A vLLM backend would hold a colocated
# engine, load the policy's weights into it after every optimizer step, and pass each prompt with its images as
# multi-modal data; it is not shipped: it needs a GPU to build and to measure.
BACKENDS = {"hf": generate}


def backend(name: str):
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"train.generation_backend: unknown backend {name!r} (known: {', '.join(BACKENDS)})") from None
