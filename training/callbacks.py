"""How the trainer reports to the outside world without knowing who listens.

The command line plugs in an output folder and a progress bar; the worker plugs in the run store and
cancellation. ``training/`` never imports either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RolloutImage:
    sha256: str
    png: bytes  # PNG bytes, written once per distinct image by whoever stores them
    width: int
    height: int


@dataclass
class RolloutRow:
    """One completion of the rollout table (contract: a rollout row), with its images by content hash."""

    step: int
    group: int
    index: int
    prompt: Any
    completion: str
    images: list[RolloutImage]
    rewards: dict[str, float | None]
    reward: float | None
    advantage: float
    completion_length: int
    truncated: bool
    row: int  # dataset row
    group_mean: float | None = None
    group_std: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "group": self.group,
            "index": self.index,
            "prompt": self.prompt,
            "completion": self.completion,
            "images": [{"sha256": im.sha256, "width": im.width, "height": im.height} for im in self.images],
            "rewards": self.rewards,
            "reward": self.reward,
            "advantage": self.advantage,
            "completion_length": self.completion_length,
            "truncated": self.truncated,
            "dataset_row": self.row,
            "group_mean": self.group_mean,
            "group_std": self.group_std,
        }


class Callback:
    """Override what you need; every method is optional."""

    def on_start(self, config: Any, resumed_from_step: int) -> None: ...

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_samples(self, step: int, rows: Sequence[RolloutRow]) -> None: ...

    def on_event(self, level: str, message: str) -> None: ...

    def on_progress(self, step: int, max_steps: int, seconds_per_step: float | None) -> None: ...

    def on_checkpoint(self, step: int, path: str) -> None: ...

    def should_stop(self) -> bool:
        """Polled once per step; True makes the trainer save a checkpoint and stop (cancellation)."""
        return False

    def on_end(self, status: str, error: str | None = None) -> None: ...


class CallbackList(Callback):
    def __init__(self, callbacks: Sequence[Callback] = ()):
        self.callbacks = list(callbacks)

    def on_start(self, config, resumed_from_step):
        for cb in self.callbacks:
            cb.on_start(config, resumed_from_step)

    def on_metrics(self, step, metrics):
        for cb in self.callbacks:
            cb.on_metrics(step, metrics)

    def on_samples(self, step, rows):
        for cb in self.callbacks:
            cb.on_samples(step, rows)

    def on_event(self, level, message):
        for cb in self.callbacks:
            cb.on_event(level, message)

    def on_progress(self, step, max_steps, seconds_per_step):
        for cb in self.callbacks:
            cb.on_progress(step, max_steps, seconds_per_step)

    def on_checkpoint(self, step, path):
        for cb in self.callbacks:
            cb.on_checkpoint(step, path)

    def should_stop(self) -> bool:
        return any(cb.should_stop() for cb in self.callbacks)

    def on_end(self, status, error=None):
        for cb in self.callbacks:
            cb.on_end(status, error)
