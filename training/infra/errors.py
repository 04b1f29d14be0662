"""The base of every error Collage reports to a person (CLI, API, run page) as a plain message.

Such an error's text says what is wrong and, where it can, how to fix it; anything else that escapes is a bug
and keeps its traceback. ``exit_code`` is what ``collage`` exits with when the error ends a command.
"""

from __future__ import annotations


class CollageError(Exception):
    exit_code = 2  # bad input or set-up; 1 is kept for "ran, then failed"


class InputError(CollageError, ValueError):
    """What was given cannot be used (a config key, a dataset, a row, an image, a model, a reward's name, a checkpoint
    file, an export request): fixed by changing the input. A ``ValueError`` too, for callers that catch those."""


class RunError(CollageError, RuntimeError):
    """Something that started failed (a training run, a reward function, loading a processor, a full disk): the
    input was accepted; the message says what happened while it ran."""


class MissingExtraError(CollageError):
    """A command needs an optional part of Collage that is not installed (``pip install 'collage-rl[X]'``)."""

    def __init__(self, extra: str, what: str, missing: str):
        self.extra = extra
        super().__init__(
            f"{what} needs the {extra!r} extra ({missing} is not installed): pip install 'collage-rl[{extra}]'"
        )
