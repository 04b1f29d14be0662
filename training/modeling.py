"""Prepare the policy for training: dtype, frozen vision tower, LoRA, gradient checkpointing, reference model."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from .config import ModelSettings

# Name components that belong to the vision side (tower + projector) in the families Collage supports.
# the vision tower and everything that only carries image features into the language model (projectors, the
# learned row-break embedding of anyres LLaVA-NeXT/OneVision): frozen together by `freeze_vision`
VISION_PARTS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector", "image_newline")
LANGUAGE_PARTS = ("language_model", "text_model")


# Parameters a family's forward never uses: LLaVA reads the vision tower's hidden states, not its output after
# the final layer norm. Left trainable they would get no gradient, and DDP fails on parameters without one.
UNUSED_BY_DESIGN = {
    "llava": ("vision_tower.post_layernorm.",),
    "llava_next": ("vision_tower.post_layernorm.",),
    "llava_onevision": ("vision_tower.post_layernorm.",),
}


def is_vision_param(name: str) -> bool:
    return any(part in VISION_PARTS for part in name.split("."))


def apply_lora(model: Any, settings: ModelSettings) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = settings.lora
    assert lora is not None
    names = "|".join(re.escape(m) for m in lora.target_modules)
    if settings.freeze_vision:
        # adapters on the language model only: a frozen vision tower must not grow trainable adapters
        pattern = rf".*(?:{'|'.join(LANGUAGE_PARTS)})\..*(?:{names})$"
    else:
        pattern = rf".*(?:{names})$"
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=pattern, bias="none")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise ValueError(f"model.lora.target_modules: {exc}") from exc


def prepare_policy(model: Any, settings: ModelSettings, gradient_checkpointing: bool) -> Any:
    """Freeze what must not train and wrap with LoRA; returns the (possibly wrapped) model."""
    unused = UNUSED_BY_DESIGN.get(model.config.model_type, ())
    for name, param in model.named_parameters():
        if (settings.freeze_vision and is_vision_param(name)) or any(u in name for u in unused):
            param.requires_grad_(False)
    if settings.lora is not None:
        model = apply_lora(model, settings)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.lora is not None:
            model.enable_input_require_grads()
        model.config.use_cache = False
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("model: nothing to train (every parameter is frozen)")
    return model


def reference_model(model: Any, uses_lora: bool) -> Any | None:
    """The frozen reference for the KL term. With LoRA the base model with adapters disabled serves, so no
    copy is made (``None``); without LoRA a frozen copy of the initial policy."""
    if uses_lora:
        return None
    ref = copy.deepcopy(model)
    ref.eval()
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref


def trainable_vision_params(model: Any) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.requires_grad and is_vision_param(n)]
