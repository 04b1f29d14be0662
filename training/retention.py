"""Which checkpoints ``train.save_total_limit`` keeps and which one is the best (``metric_for_best_model``): pure
functions over ``(step, metric value)`` pairs, torch-free, so the trainer (which deletes) and the API (which marks
the best checkpoint of a run) decide alike."""

from __future__ import annotations

import math
from collections.abc import Sequence


def best_checkpoint(checkpoints: Sequence[tuple[int, float | None]], greater_is_better: bool = True) -> int | None:
    """The step of the best checkpoint by its metric (``None``/NaN: no metric, never the best); the earliest of
    equal values, as TRL keeps the first checkpoint that reached a value. ``None`` when none has a metric."""
    best: tuple[int, float] | None = None
    for step, value in sorted(checkpoints, key=lambda item: item[0]):
        if value is None or math.isnan(value):
            continue
        if best is None or (value > best[1] if greater_is_better else value < best[1]):
            best = (step, value)
    return None if best is None else best[0]


def checkpoints_to_remove(
    checkpoints: Sequence[tuple[int, float | None]], limit: int | None, greater_is_better: bool = True
) -> list[int]:
    """The steps ``train.save_total_limit`` deletes from ``checkpoints`` (``(step, metric at that step)``): all but
    the newest ``limit`` and the best by the metric (see :func:`best_checkpoint`), so at most ``limit + 1`` stay
    (the newest ``limit`` and an older best). Nothing is removed without a limit."""
    if limit is None:
        return []
    steps = sorted({step for step, _ in checkpoints})
    keep = set(steps[-limit:])
    best = best_checkpoint(checkpoints, greater_is_better)
    if best is not None:
        keep.add(best)
    return [step for step in steps if step not in keep]
