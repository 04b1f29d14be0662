"""The web tier's errors, under :class:`~collage.training.infra.errors.CollageError` (docs/errors.md has the tree)."""

from __future__ import annotations

from collage.training.infra.errors import CollageError


class WebError(CollageError):
    """The web app, its store or its API client refuses, or cannot do, what was asked; the message says why."""


class PlatformError(CollageError):
    """The platform's own machinery failed: a child process it runs (the dataset process, a worker's playground
    process) ended before it answered; the message says how."""
