"""Per-token log-probabilities (and entropies) of completion tokens under the policy, for the loss forward.

The model's own forward runs with its LM head swapped for the identity, so it returns the final hidden states
instead of ``(B, C, V)`` logits; those go through the head ``LOGPROB_CHUNK`` tokens at a time. Each distinct prompt
can run once for all its rows (:mod:`training.batching.prefix`), and already computed vision features can stand in
for the pixels (:mod:`training.batching.vision`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from ..models.families import Family
from .batch import ModelBatch
from .forward import base_model, forward_kwargs
from .prefix import prompt_groups, shared_prompt_hidden


def _completion_logits(model: Any, batch: ModelBatch, family: Family, image_token_id: int) -> torch.Tensor:
    """Logits that predict each completion token, ``(B, C, V)``: the full-logits path, kept as the reference
    that the chunked path (``completion_logprobs_and_entropy``) is tested against."""
    c_len = batch.input_ids.shape[1] - batch.prompt_length
    kwargs = forward_kwargs(batch, family, image_token_id)
    return model(**kwargs, logits_to_keep=c_len + 1).logits[:, :-1, :]


LOGPROB_CHUNK = 256  # completion tokens whose (chunk, V) fp32 logits exist at a time in the chunked path


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
    owner, name, head = _lm_head_slot(model)
    c_len = batch.input_ids.shape[1] - batch.prompt_length
    # a multi-turn rollout's completion holds tool images: its prompt is not shareable (prefix runs completions as text)
    shareable = share_prompts and c_len > 0 and not any(getattr(batch, "tool_images", None) or [])
    groups = prompt_groups(batch) if shareable else None
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
