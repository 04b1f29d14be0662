"""A run's lifecycle states (stored as their string values in ``runs.status``)."""

from __future__ import annotations

from enum import Enum


class RunStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"  # cancel requested: the training checkpoints, then stops
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:  # f-strings and messages show the stored value on every Python
        return self.value

    @property
    def ended(self) -> bool:
        return self in ENDED


ENDED = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})
ACTIVE = frozenset({RunStatus.RUNNING, RunStatus.CANCELLING})  # a training process may be alive


class JobKind(str, Enum):
    """What a job (``jobs`` table) does; its status is a :class:`RunStatus` (queued, running, cancelling, and the
    three ends)."""

    EXPORT = "export"  # a checkpoint as a plain transformers folder (collage export), then a download
    GENERATE = "generate"  # the playground: completions of one or two models for a prompt and its images

    def __str__(self) -> str:
        return self.value
