"""The web tier's errors, under :class:`~collage.training.infra.errors.CollageError` (docs/errors.md has the tree)."""

from __future__ import annotations

from collage.training.infra.errors import CollageError


class WebError(CollageError):
    """The web app, its store or its API client refuses, or cannot do, what was asked; the message says why."""
