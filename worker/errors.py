"""The worker tier's errors, under :class:`~collage.training.infra.errors.CollageError` (docs/errors.md has the tree)."""

from __future__ import annotations

from collage.training.infra.errors import CollageError


class WorkerError(CollageError, RuntimeError):
    """A worker could not do a job it took: the job's message says why (its own log keeps the detail)."""
