"""How every model pass over a batch computes its completion log-probs: the generation batch's old-policy and
reference passes (training.rollout), the training forward (training.optimization).

The passes share one vision-feature cache (training.batching.vision): each distinct sample's images go through the
tower once per generation batch wherever the weights allow it, and the images every pass encodes are counted for
the step's ``vision/images_encoded``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .batching.batch import ModelBatch
from .batching.logprobs import completion_logprobs_and_entropy
from .batching.vision import POLICY, REFERENCE, SHARED, VisionFeatures
from .models.families import Family
from .sharding import gathered

PassModel = Literal["policy", "reference", "train"]


def batch_to_device(batch: ModelBatch, device: Any, dtype: torch.dtype) -> ModelBatch:
    """``batch`` on the model's device, its floating-point pixels in the model's dtype (in place; returned)."""
    batch.input_ids = batch.input_ids.to(device)
    batch.attention_mask = batch.attention_mask.to(device)
    batch.completion_mask = batch.completion_mask.to(device)
    batch.pixels = {
        k: v.to(device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in batch.pixels.items()
    }
    return batch


class ForwardPasses:
    """Completion log-probs (and entropies) of a batch under a model, with the vision features that pass may reuse.

    ``vision_trainable``: whether the policy's vision side has trainable parameters (then the policy's and the
    reference's towers differ, and a training forward must encode with gradients). ``world``: the number of
    processes (a forward with gradients shares prompts only in a single process).
    """

    def __init__(
        self,
        family: Family,
        image_token_id: int,
        temperature: float,
        micro_batch_size: int,
        vision_trainable: bool,
        gradient_checkpointing: bool,
        world: int,
    ):
        self.family = family
        self.image_token_id = image_token_id
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.vision_trainable = vision_trainable
        self.gradient_checkpointing = gradient_checkpointing
        self.world = world
        # each distinct sample's vision features once per generation batch (see training.batching.vision)
        self.vision = VisionFeatures(family)
        self.images_encoded = 0  # this step's images through the vision tower (cached or with gradients)

    def scope(self, model: PassModel) -> str | None:
        """Which cached vision features a pass may use (``None``: encode with gradients, no cache). A frozen
        vision side is the same function in every pass; a trainable one differs between policy and reference and
        must run with gradients in the training forward."""
        if not self.vision_trainable:
            return SHARED
        return {"policy": POLICY, "reference": REFERENCE, "train": None}[model]

    def encoder_outputs(self, model: Any, batch: ModelBatch, scope: str | None) -> Any | None:
        if scope is None:  # a training forward with a trainable tower: the model encodes with gradients
            self.images_encoded += sum(batch.num_images)
            return None
        before = self.vision.images_encoded
        with gathered(model):  # sharded: the tower is called directly, outside the model's own forward
            out = self.vision.encoder_outputs(model, batch, scope)  # no gradients, eval mode (training.batching.vision)
        self.images_encoded += self.vision.images_encoded - before
        return out

    def share_prompts(self) -> bool:
        """Whether a loss forward runs each distinct prompt once for its group (training.batching.prefix). Not with
        gradient checkpointing (the checkpointed layers keep no KV cache to share), and with gradients only in a
        single process: DDP expects one forward per backward."""
        if self.gradient_checkpointing:
            return False
        return self.world == 1 or not torch.is_grad_enabled()

    def logps(
        self, model: Any, batch: ModelBatch, scope: str | None, entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return completion_logprobs_and_entropy(
            model,
            batch,
            self.family,
            self.image_token_id,
            self.temperature,
            entropy=entropy,
            entropy_grad=entropy_grad,
            vision=lambda part: self.encoder_outputs(model, part, scope),
            share_prompts=self.share_prompts(),
        )

    @torch.no_grad()
    def batched_logps(self, model: Any, batch: ModelBatch, scope: str | None) -> torch.Tensor:
        """A whole generation batch's log-probs, one micro-batch at a time, padded back to the batch's width."""
        size = self.micro_batch_size
        width = batch.completion_mask.shape[1]
        parts = []
        for lo in range(0, batch.batch_size, size):
            part = batch.slice(lo, min(lo + size, batch.batch_size), self.family.layout).trimmed()
            logps = self.logps(model, part, scope)[0]
            parts.append(torch.nn.functional.pad(logps, (0, width - logps.shape[1])))
        return torch.cat(parts)
