"""The generation batch: what a rollout produces, what the optimizer steps consume, and what a checkpoint keeps of
a batch that is still in use (the trainer's ``buffer``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batching.batch import ModelBatch
from .callbacks import RolloutRow


@dataclass
class GenerationBatch:
    """A scored generation batch, shuffled, ready to be cut into micro-batches."""

    batch: ModelBatch
    advantages: torch.Tensor  # (N,) local rows
    old_logps: torch.Tensor | None  # (N, C) when the policy moves between generation and use
    ref_logps: torch.Tensor | None  # (N, C) when beta > 0 (GRPO)
    num_items: torch.Tensor  # completion tokens in the global generation batch (dapo normaliser)
    metrics: dict[str, float]
    rows: list[RolloutRow]


# Checkpoints pickle the buffer under its class's qualified name, and training.checkpoint allows exactly
# ``<__module__>.GenerationBatch`` when it loads one. The class was defined in training.trainer when every existing
# checkpoint was written: it keeps that name (training.trainer re-exports it), so those checkpoints still load and
# new ones are the same bytes an older Collage reads.
GenerationBatch.__module__ = "collage.training.trainer"
