"""The error that stops a run, raised by the trainer and by the collaborators it hands parts of a run to."""

from __future__ import annotations

from collage.training.infra.errors import RunError


class TrainingError(RunError):
    """A run that cannot start or cannot go on; the message says why in the user's terms."""

    exit_code = 1
