"""Per-bucket min/max rollups of metrics, and the downsampling that reads them.

Every metric write updates, for each bucket width, the bucket holding its step (a conditional upsert keeps
the extremes). A rewrite of a step with another value, or the removal of steps (a resumed run), recomputes
the buckets it touches from the raw values, so the rollups always equal what the raw points would give.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import and_, case, delete, or_, select
from sqlmodel import Session, col

from collage.app.models import table_of

from ..models import Metric, MetricRollup
from .sql import dialect_insert

WIDTHS = (16, 256)


def _upsert_stmt(session: Session):
    stmt = dialect_insert(session, table_of(MetricRollup))
    table = table_of(MetricRollup)
    lower = stmt.excluded.min_value < table.c.min_value
    higher = stmt.excluded.max_value > table.c.max_value
    return stmt.on_conflict_do_update(
        index_elements=["run_id", "key", "width", "bucket"],
        set_={
            "min_value": case((lower, stmt.excluded.min_value), else_=table.c.min_value),
            "min_step": case((lower, stmt.excluded.min_step), else_=table.c.min_step),
            "max_value": case((higher, stmt.excluded.max_value), else_=table.c.max_value),
            "max_step": case((higher, stmt.excluded.max_step), else_=table.c.max_step),
        },
    )


def add_points(session: Session, run_id: str, step: int, values: dict[str, float]) -> None:
    """Fold new points (no earlier value at this step) into the rollups."""
    rows = [
        {"run_id": run_id, "key": key, "width": w, "bucket": step // w, "min_step": step, "min_value": value,
         "max_step": step, "max_value": value}
        for key, value in values.items()
        for w in WIDTHS
    ]  # fmt: skip
    if rows:
        session.execute(_upsert_stmt(session), rows)


def _fold(best: dict, slot: Any, step: int, value: float) -> None:
    """Fold one point into ``best[slot]`` = ``[min_step, min_value, max_step, max_value]`` (the earliest step
    wins ties): the one min/max rule of the rollups, their rebuilds and the downsampling."""
    entry = best.get(slot)
    if entry is None:
        best[slot] = [step, value, step, value]
        return
    if value < entry[1] or (value == entry[1] and step < entry[0]):
        entry[0], entry[1] = step, value
    if value > entry[3] or (value == entry[3] and step < entry[2]):
        entry[2], entry[3] = step, value


def _fold_and_insert(
    session: Session, run_id: str, points: Iterable[tuple[str, int, float]], widths: Sequence[int]
) -> None:
    """Each (key, width, bucket)'s min and max point of ``points``, inserted as rollups."""
    best: dict[tuple[str, int, int], list] = {}
    for key, step, value in points:
        for w in widths:
            _fold(best, (key, w, step // w), step, value)
    rows = [{"run_id": run_id, "key": k, "width": w, "bucket": b, "min_step": e[0], "min_value": e[1],
             "max_step": e[2], "max_value": e[3]} for (k, w, b), e in best.items()]  # fmt: skip
    for start in range(0, len(rows), 5000):
        session.execute(table_of(MetricRollup).insert(), rows[start : start + 5000])


def recompute(session: Session, run_id: str, keys: Iterable[str], steps: Iterable[int]) -> None:
    """Rebuild, from the raw values, the buckets of ``keys`` that hold any of ``steps``."""
    keys, steps = list(keys), list(steps)
    if not keys or not steps:
        return
    for w in WIDTHS:
        buckets = sorted({s // w for s in steps})
        session.execute(
            delete(MetricRollup).where(
                col(MetricRollup.run_id) == run_id, col(MetricRollup.key).in_(keys), col(MetricRollup.width) == w,
                col(MetricRollup.bucket).in_(buckets),
            )
        )  # fmt: skip
        ranges = or_(*(and_(col(Metric.step) >= b * w, col(Metric.step) < (b + 1) * w) for b in buckets))
        points = session.execute(
            select(col(Metric.key), col(Metric.step), col(Metric.value)).where(
                col(Metric.run_id) == run_id, col(Metric.key).in_(keys), col(Metric.value).is_not(None), ranges
            )
        )
        _fold_and_insert(session, run_id, points, [w])


def rebuild(session: Session, run_id: str) -> None:
    """Recompute all of a run's rollups from its raw points (after a bulk load that bypassed the writer)."""
    session.execute(delete(MetricRollup).where(col(MetricRollup.run_id) == run_id))
    points = session.execute(
        select(col(Metric.key), col(Metric.step), col(Metric.value)).where(
            col(Metric.run_id) == run_id, col(Metric.value).is_not(None)
        )
    )
    _fold_and_insert(session, run_id, points, WIDTHS)


def truncate(session: Session, run_id: str, after_step: int) -> None:
    """Drop every point after ``after_step`` (a run resumed from that checkpoint), rollups included."""
    keys = list(
        session.scalars(
            select(col(Metric.key)).where(col(Metric.run_id) == run_id, col(Metric.step) > after_step).distinct()
        )
    )
    session.execute(delete(Metric).where(col(Metric.run_id) == run_id, col(Metric.step) > after_step))
    for w in WIDTHS:
        session.execute(delete(MetricRollup).where(col(MetricRollup.run_id) == run_id, col(MetricRollup.width) == w,
                                                   col(MetricRollup.bucket) > after_step // w))  # fmt: skip
    recompute(session, run_id, keys, [after_step])


def downsample(
    session: Session, run_id: str, spans: dict[str, tuple[int, int]], max_points: int
) -> dict[str, list[list[float | None]]]:
    """Min and max point per bucket of steps for each key (``spans``: key -> (first, last) step in range), in
    step order, at most ``max_points`` per key, the last point always included."""
    wanted = max(1, (max_points - 1) // 2)
    out: dict[str, list[list[float | None]]] = {}
    by_width: dict[int, list[str]] = {}
    for key, (lo, hi) in spans.items():
        target = (hi - lo + 1) / wanted  # steps per output bucket
        # the coarsest rollup that still resolves an output bucket; below the finest one, its buckets are the
        # output (fewer points than allowed, but never a read of every raw point)
        width = max((w for w in WIDTHS if w <= target), default=WIDTHS[0])
        by_width.setdefault(width, []).append(key)
    for width, keys in by_width.items():
        points: dict[str, list[tuple[int, float, int, float]]] = {k: [] for k in keys}
        lo_bucket = min(spans[k][0] for k in keys) // width
        hi_bucket = max(spans[k][1] for k in keys) // width
        rows = session.execute(
            select(col(MetricRollup.key), col(MetricRollup.min_step), col(MetricRollup.min_value), col(MetricRollup.max_step),
                   col(MetricRollup.max_value)).where(
                col(MetricRollup.run_id) == run_id, col(MetricRollup.key).in_(keys), col(MetricRollup.width) == width,
                col(MetricRollup.bucket).between(lo_bucket, hi_bucket),
            )
        ).all()  # fmt: skip
        for key, min_step, min_value, max_step, max_value in rows:
            points[key].append((min_step, min_value, max_step, max_value))
        for key in keys:
            out[key] = _merge(points[key], *spans[key], wanted)
    return out


def _merge(parts: Sequence[tuple[int, float, int, float]], lo: int, hi: int, wanted: int) -> list[list[float | None]]:
    """Fold fine buckets into ``wanted`` output buckets over [lo, hi], keeping each one's min and max point
    (the earliest on ties)."""
    span = hi - lo + 1
    best: dict[int, list] = {}
    for min_step, min_value, max_step, max_value in parts:
        for step, value in ((min_step, min_value), (max_step, max_value)):
            if lo <= step <= hi:
                _fold(best, (step - lo) * wanted // span, step, value)
    points: list[list[float | None]] = []
    for b in sorted(best):
        s1, v1, s2, v2 = best[b]
        if s1 == s2:
            points.append([s1, v1])
        else:
            points.extend([[s1, v1], [s2, v2]] if s1 < s2 else [[s2, v2], [s1, v1]])
    return points
