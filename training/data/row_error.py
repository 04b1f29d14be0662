"""The error of one dataset row: what every reader of rows (the mapping, the row itself, the loader, the check)
raises and reports, in a module of its own so that none of them imports another to name it."""

from __future__ import annotations

from ..errors import InputError


class RowError(InputError):
    """A problem with one dataset row; ``row`` is its 0-based index in the split."""

    def __init__(self, row: int, message: str):
        super().__init__(f"row {row}: {message}")
        self.row = row
        self.message = message
