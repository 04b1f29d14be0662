"""Dataset values as a preview shows them: plain JSON, bounded in depth and in size.

A row's columns are the dataset author's, of any shape: a column nested 900 levels deep, a 100 MB string or a
list of a million items must still give a preview (and a JSON answer a browser can read), not a serialisation
error. :func:`bounded` keeps the first :data:`MAX_DEPTH` levels, the first :data:`MAX_ITEMS` items of a list or
object, the first :data:`MAX_TEXT` characters of a string and at most ``budget`` characters in all; what it cuts
is replaced by a text marker that starts with the cut part's JSON text and says what was left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import islice
from typing import Any

MAX_DEPTH = 8  # a conversation (messages, parts, text) is 4 levels deep: previews show it whole
MAX_ITEMS = 50
MAX_TEXT = 2000
ROW_BUDGET = 32_000  # characters of one row's prompt and columns together
MARKER_TEXT = 120  # characters of a cut part's JSON text kept in its marker


@dataclass
class Budget:
    chars: int = ROW_BUDGET


def bounded(value: Any, budget: Budget | None = None, depth: int = 0) -> Any:
    """``value`` as JSON-safe Python (dicts with string keys, lists, strings, finite numbers, bools, None), cut to
    the bounds above; ``budget`` is shared by every value of one row."""
    budget = budget if budget is not None else Budget()
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        budget.chars -= 8
        return value if abs(value) < 2**63 else str(value)  # beyond what JSON readers keep exactly
    if isinstance(value, float):
        budget.chars -= 8
        return value if math.isfinite(value) else str(value)  # NaN/Infinity are not JSON
    if isinstance(value, (bytes, bytearray, memoryview)):
        budget.chars -= 16
        return f"<{len(value)} bytes>"
    if isinstance(value, str):
        return _text(value, budget)
    if isinstance(value, (list, tuple, dict)):
        if depth >= MAX_DEPTH:
            return marker(value, f"nested deeper than {MAX_DEPTH} levels", budget)
        if isinstance(value, dict):
            return _object(value, budget, depth)
        return _array(value, budget, depth)
    return _text(f"<{type(value).__name__}>", budget)


def _text(value: str, budget: Budget) -> str:
    keep = max(0, min(MAX_TEXT, budget.chars))
    budget.chars -= min(len(value), keep) + 2
    if len(value) <= keep:
        return value
    return f"{value[:keep]}… ({len(value) - keep} more characters)"


def _array(value: list | tuple, budget: Budget, depth: int) -> list[Any]:
    out: list[Any] = []
    for k, item in enumerate(value):
        if k >= MAX_ITEMS or budget.chars <= 0:
            out.append(f"… ({len(value) - k} more items)")
            break
        out.append(bounded(item, budget, depth + 1))
    return out


def _object(value: dict, budget: Budget, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, (key, item) in enumerate(value.items()):
        if k >= MAX_ITEMS or budget.chars <= 0:
            out["…"] = f"{len(value) - k} more keys"
            break
        name = _text(key if isinstance(key, str) else str(key), budget)
        out[name] = bounded(item, budget, depth + 1)
    return out


def marker(value: Any, why: str, budget: Budget | None = None) -> str:
    """A cut value as text: the start of its JSON text, then what was left out. Never encodes more than it keeps
    (a 900-level value is not walked to its end)."""
    encoder = json.JSONEncoder(default=lambda o: f"<{type(o).__name__}>", check_circular=False)
    pieces = islice(encoder.iterencode(value), MARKER_TEXT)  # the pure-Python encoder: lazy, piece by piece
    start = "".join(pieces)[:MARKER_TEXT]
    if budget is not None:
        budget.chars -= len(start) + len(why) + 8
    return f"{start}… ({why})"
