"""Small arithmetic on logged metrics, shared by the trainer and its collaborators: a tensor or number as a float,
NaN as a missing value, and the mean of several micro-batches' or generation batches' metrics."""

from __future__ import annotations

import math
from typing import Any


def to_float(x: Any) -> float:
    """A 0-d tensor (or anything with ``.item()``) or a plain number, as a Python float."""
    return float(x.item()) if hasattr(x, "item") else float(x)


def float_or_none(x: Any) -> float | None:
    """:func:`to_float`, with NaN (a value that does not exist, e.g. the std of a one-row group) as None."""
    v = to_float(x)
    return None if math.isnan(v) else v


def mean_dicts(items: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the dicts that have it, NaNs left out; NaN when a key has no value."""
    keys = {k for d in items for k in d}
    out = {}
    for k in keys:
        values = [d[k] for d in items if k in d and not math.isnan(d[k])]
        out[k] = sum(values) / len(values) if values else math.nan
    return out
