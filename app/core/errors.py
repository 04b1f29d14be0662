"""The web tier's errors, under :class:`~collage.training.errors.CollageError` (docs/errors.md has the tree)."""

from __future__ import annotations

from collage.training.errors import CollageError


class WebError(CollageError):
    """The web app, its store or its API client refuses, or cannot do, what was asked; the message says why."""
