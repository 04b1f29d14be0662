"""The base of every error Collage reports to a person (CLI, API, run page) as a plain message.

Such an error's text says what is wrong and, where it can, how to fix it; anything else that escapes is a bug
and keeps its traceback. ``exit_code`` is what ``collage`` exits with when the error ends a command.
"""

from __future__ import annotations


class CollageError(Exception):
    exit_code = 2  # bad input or set-up; 1 is kept for "ran, then failed"


class MissingExtraError(CollageError):
    """A command needs an optional part of Collage that is not installed (``pip install 'collage-rl[X]'``)."""

    def __init__(self, extra: str, what: str, missing: str):
        self.extra = extra
        super().__init__(
            f"{what} needs the {extra!r} extra ({missing} is not installed): pip install 'collage-rl[{extra}]'"
        )
