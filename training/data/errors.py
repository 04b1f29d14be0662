"""The data side's errors: a bad row (:class:`RowError`), what every reader of rows (the mapping, the row itself, the
loader, the check) raises and reports, and an unusable dataset (:class:`DatasetError`); in a module of their own so
that none of those readers imports another to name them."""

from __future__ import annotations

from collage.training.infra.errors import InputError


class RowError(InputError):
    """A problem with one dataset row; ``row`` is its 0-based index in the split."""

    def __init__(self, row: int, message: str):
        super().__init__(f"row {row}: {message}")
        self.row = row
        self.message = message


class DatasetError(InputError):
    """The dataset cannot be used; ``errors`` lists every bad row when that is the reason."""

    def __init__(self, message: str, errors: list[RowError] | None = None):
        self.errors = errors or []
        if self.errors:
            shown = "\n".join(f"  {e}" for e in self.errors[:20])
            more = f"\n  ... and {len(self.errors) - 20} more" if len(self.errors) > 20 else ""
            message = f"{message}\n{shown}{more}"
        super().__init__(message)
