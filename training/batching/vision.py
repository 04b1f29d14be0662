"""Each distinct sample's vision features once per generation batch, reused by every forward that can.

A generation batch repeats each prompt ``num_generations`` times, and the same rows go through generation, the
old-policy and reference log-prob passes and one or more training forwards. Left to itself the model encodes every
image of every row in every one of them. :class:`VisionFeatures` keeps the vision encoder's output per sample,
keyed by the content hash of that sample's pixel inputs (:func:`~training.batching.layouts.pixel_key`), and hands a batch's forward the joined
outputs through the model's own ``mm_encoder_outputs`` argument, so the tower runs once per distinct sample.

The unit is a sample's whole image set rather than a single image: every family's encoder output can be joined
per sample (it is concatenated along its first axis in sample order), while splitting it per image would need
each family's internal feature layout (anyres packing, tiles, deepstack levels). Two rows that hold the very same
images with the same processing share one entry; an image that appears in two different rows is encoded for each.

Entries are encoded without gradients and in eval mode (each module's own mode restored afterwards), whatever mode
the policy is in: the generation, old-policy and reference passes that take them are no-grad passes, and dropout on
the vision side (LoRA dropout on a trainable tower, attention dropout) must neither perturb their features nor draw
from the global random stream, which would change the completions sampled next. Only a training forward runs the
tower in train mode, and it never takes cached features.

Scopes say which weights produced an entry: with the vision side frozen every pass may share one scope, since the
policy's, the old policy's and the reference's towers are the same function. With a trainable tower the generation
and old-policy passes (same weights, before any optimizer step) share ``policy``, the reference has its own, and a
training forward never takes cached features: it must run the tower with gradients.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.families import Family
from .batch import model_pixels
from .forward import base_model
from .layouts import Pixels, join_pixels, split_pixels

SHARED = "shared"
POLICY = "policy"
REFERENCE = "reference"


def _join(values: list[Any]) -> Any:
    """Per-sample encoder outputs joined in sample order: tensors along their first axis, per-image tuples
    concatenated."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values, dim=0)
    return tuple(item for value in values for item in value)


def join_encoder_outputs(outputs: list[Any]) -> Any:
    """One ``mm_encoder_outputs["image"]`` for a batch from its samples' outputs, in order. The forwards read
    ``pooler_output`` (and Qwen3-VL ``deepstack_features``, one entry per deepstack level, each per image)."""
    first = outputs[0]
    joined: dict[str, Any] = {"pooler_output": _join([o.pooler_output for o in outputs])}
    levels = getattr(first, "deepstack_features", None)
    if levels is not None:
        joined["deepstack_features"] = [
            _join([o.deepstack_features[level] for o in outputs]) for level in range(len(levels))
        ]
    return type(first)(**joined)


def _model_inner(model: Any) -> Any:
    """The module that owns ``get_image_features`` (the ``*Model`` under ``*ForConditionalGeneration``), through
    DDP (``.module``) and PEFT (``get_base_model``) wrappers."""
    base = base_model(model)
    inner = getattr(base, "model", base)
    if not hasattr(inner, "get_image_features"):
        raise TypeError(f"{type(model).__name__}: no get_image_features to encode images with")
    return inner


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` and every module under it in eval mode (no dropout: deterministic, no random draws), each put back
    in its own previous mode afterwards (parts of a model may be in different modes)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@dataclass
class VisionFeatures:
    """Encoder outputs per (scope, sample key), for one generation batch; :meth:`clear` starts the next."""

    family: Family
    entries: dict[tuple[str, str], Any] = field(default_factory=dict)
    images_encoded: int = 0  # images the tower encoded through this cache since the last clear

    def clear(self) -> None:
        self.entries.clear()
        self.images_encoded = 0

    def encoder_outputs(self, model: Any, batch: Any, scope: str) -> Any | None:
        """``mm_encoder_outputs["image"]`` for ``batch`` (a :class:`~training.batching.batch.ModelBatch`),
        encoding only the samples not yet seen in ``scope``; ``None`` when the batch has no images. Samples without
        a content key (a batch restored from an older checkpoint) are encoded the same way, for this call only."""
        if not batch.pixels:
            return None
        keys = list(getattr(batch, "image_keys", None) or [])
        if len(keys) != batch.batch_size:
            keys = [None] * batch.batch_size
        with_images = [s for s in range(batch.batch_size) if batch.num_images[s]]
        unkept: dict[int, Any] = {}
        missing = [s for s in with_images if keys[s] is None or (scope, keys[s]) not in self.entries]
        if missing:
            per_sample = split_pixels(self.family.layout, batch.pixels, batch.num_images)
            inner = _model_inner(model)
            with torch.no_grad(), eval_mode(inner):
                for s in missing:
                    if keys[s] is not None and (scope, keys[s]) in self.entries:  # the same sample twice here
                        continue
                    out = self._encode(inner, per_sample[s], batch.num_images[s])
                    if keys[s] is None:
                        unkept[s] = out
                    else:
                        self.entries[(scope, keys[s])] = out
                    self.images_encoded += batch.num_images[s]
        outputs = [unkept[s] if keys[s] is None else self.entries[(scope, keys[s])] for s in with_images]
        return join_encoder_outputs(outputs) if outputs else None

    def _encode(self, inner: Any, pixels: Pixels, num_images: int) -> Any:
        # per-sample pixels (a tiled family's slots with their tile counts) -> the model's form for one sample
        sample = model_pixels(join_pixels(self.family.layout, [pixels]))
        if "batch_num_images" in self.family.extra_inputs:
            device = next(iter(sample.values())).device
            sample["batch_num_images"] = torch.tensor([num_images], dtype=torch.long, device=device)
        accepted = inspect.signature(inner.get_image_features).parameters
        kwargs = {k: v for k, v in sample.items() if k in accepted}
        return inner.get_image_features(**kwargs, return_dict=True)
