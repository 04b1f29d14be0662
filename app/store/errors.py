"""The store's errors, under :class:`~collage.training.infra.errors.CollageError` (docs/errors.md has the tree): the web
tier, the command line and the workers raise them alike, so they are not the web tier's."""

from __future__ import annotations

from collage.training.infra.errors import CollageError


class StoreError(CollageError):
    """The run store refuses, or cannot do, what was asked (a stale attempt, a cursor it never gave, a checkpoint it
    does not have, an upload it cannot keep); the message says why."""
