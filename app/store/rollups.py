"""Per-bucket min/max rollups of metrics, and the downsampling that reads them.

Every metric write updates, for each bucket width, the bucket holding its step (a conditional upsert keeps
the extremes). A rewrite of a step with another value, or the removal of steps (a resumed run), recomputes
the buckets it touches from the raw values, so the rollups always equal what the raw points would give.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from sqlalchemy import Executable, LargeBinary, and_, case, delete, func, literal, or_, select
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, col

from collage.app.store.tables import Metric, MetricRollup, table_of

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


# A series of points as two arrays, steps (int64) and values (float64, NaN where the store holds null): a chart of
# a long run is tens of thousands of points, and a Python object for each was most of the metrics route's time.
Series = tuple[np.ndarray, np.ndarray]


def plain_rows(session: Session, stmt: Executable) -> Sequence[Any]:
    """Every row of ``stmt`` as the driver's own tuples. SQLAlchemy Core compiles and runs it and wraps the errors
    of its execution, but builds no Row object per row (for the thousands of rows of a chart they cost as much as
    the read itself); the columns read this way are ints, floats, strings and bytes, which no type converts."""
    result = session.connection().execute(stmt)
    try:
        return result.cursor.fetchall()
    except result.dialect.loaded_dbapi.Error as exc:  # as Core would have raised it
        raise DBAPIError.instance(result.context.statement, None, exc, result.dialect.loaded_dbapi.Error) from exc
    finally:
        result.close()


def as_points(series: Series) -> list[list[float | None]]:
    """``[[step, value], ...]``, with ``None`` for a missing value (NaN; an infinity too, as in the JSON)."""
    steps, values = series
    # value - value: 0.0 for a finite value, NaN (truthy) for NaN and the infinities
    pairs = zip(steps.tolist(), values.tolist(), strict=True)
    return [[step, None if value - value else value] for step, value in pairs]


def downsample(
    session: Session, run_id: str, spans: dict[str, tuple[int, int]], max_points: int
) -> dict[str, list[list[float | None]]]:
    """:func:`downsample_series`, as lists of ``[step, value]``."""
    return {key: as_points(series) for key, series in downsample_series(session, run_id, spans, max_points).items()}


def downsample_series(
    session: Session, run_id: str, spans: dict[str, tuple[int, int]], max_points: int
) -> dict[str, Series]:
    """Min and max point per bucket of steps for each key (``spans``: key -> (first, last) step in range), in
    step order, at most ``max_points`` per key (the caller adds the last point)."""
    wanted = max(1, (max_points - 1) // 2)
    out: dict[str, Series] = {}
    by_width: dict[int, list[str]] = {}
    for key, (lo, hi) in spans.items():
        target = (hi - lo + 1) / wanted  # steps per output bucket
        # the coarsest rollup that still resolves an output bucket; below the finest one, its buckets are the
        # output (fewer points than allowed, but never a read of every raw point)
        width = max((w for w in WIDTHS if w <= target), default=WIDTHS[0])
        by_width.setdefault(width, []).append(key)
    for width, keys in by_width.items():
        buckets = (min(spans[k][0] for k in keys) // width, max(spans[k][1] for k in keys) // width)
        of_key, step, value = _read_buckets(session, run_id, keys, width, buckets)
        out.update(_merge(of_key, step, value, keys, [spans[k] for k in keys], wanted))
    return out


Points = tuple[np.ndarray, np.ndarray, np.ndarray]  # (index of the key, step, value) of each point


def _read_buckets(session: Session, run_id: str, keys: Sequence[str], width: int, buckets: tuple[int, int]) -> Points:
    """The rollups of ``keys`` at ``width`` in the range of buckets, as points: each bucket's min, then its max."""
    rollup = table_of(MetricRollup).c
    where = (rollup.run_id == run_id, rollup.key.in_(keys), rollup.width == width, rollup.bucket.between(*buckets))
    index = {key: i for i, key in enumerate(keys)}
    if session.get_bind().dialect.name == "postgresql":
        return _read_packed(session, where, index)
    rows = plain_rows(
        session, select(rollup.key, rollup.min_step, rollup.min_value, rollup.max_step, rollup.max_value).where(*where)
    )
    if not rows:
        return _points([], [], [], [], [])
    names, min_steps, min_values, max_steps, max_values = zip(*rows, strict=True)
    return _points(
        np.fromiter(map(index.__getitem__, names), np.int64, len(names)), min_steps, min_values, max_steps, max_values
    )


# a bucket as PostgreSQL's binary send functions write it (int4send, float8send: big-endian)
_PACKED = np.dtype([("min_step", ">i4"), ("min_value", ">f8"), ("max_step", ">i4"), ("max_value", ">f8")])


def _read_packed(session: Session, where: tuple[Any, ...], index: dict[str, int]) -> Points:
    """PostgreSQL packs each key's buckets into one bytea, which numpy reads as it is: a row per key rather than
    one per bucket (psycopg's handling of each row cost more than the query), and the exact values."""
    rollup = table_of(MetricRollup).c
    packed = func.string_agg(
        func.int4send(rollup.min_step).op("||")(func.float8send(rollup.min_value))
        .op("||")(func.int4send(rollup.max_step)).op("||")(func.float8send(rollup.max_value)),
        literal(b"", LargeBinary),
    )  # fmt: skip
    parts = [
        (index[key], np.frombuffer(blob, _PACKED))
        for key, blob in plain_rows(session, select(rollup.key, packed).where(*where).group_by(rollup.key))
    ]
    if not parts:
        return _points([], [], [], [], [])
    rows = np.concatenate([part for _, part in parts])
    of_key = np.repeat([i for i, _ in parts], [len(part) for _, part in parts])
    return _points(of_key, rows["min_step"], rows["min_value"], rows["max_step"], rows["max_value"])


def _points(of_key: Any, min_steps: Any, min_values: Any, max_steps: Any, max_values: Any) -> Points:
    """Each bucket's min point, then each one's max point."""
    of_key = np.asarray(of_key, dtype=np.int64)
    step = np.concatenate((np.asarray(min_steps, dtype=np.int64), np.asarray(max_steps, dtype=np.int64)))
    value = np.concatenate((np.asarray(min_values, dtype=np.float64), np.asarray(max_values, dtype=np.float64)))
    return np.concatenate((of_key, of_key)), step, value


def _merge(
    of_key: np.ndarray,
    step: np.ndarray,
    value: np.ndarray,
    keys: Sequence[str],
    spans: Sequence[tuple[int, int]],
    wanted: int,
) -> dict[str, Series]:
    """Fold points (the min and max points of fine buckets; ``of_key`` indexes ``keys``) into ``wanted`` output
    buckets per key over its span [lo, hi], keeping each output bucket's min and max point (the earliest on ties,
    as :func:`_fold`), in step order; vectorised."""
    empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    lo = np.array([span[0] for span in spans], dtype=np.int64)[of_key]
    hi = np.array([span[1] for span in spans], dtype=np.int64)[of_key]
    inside = (step >= lo) & (step <= hi)
    if not inside.any():
        return dict.fromkeys(keys, empty)
    # key by key, in step order (steps are 32-bit): an output bucket is then a run of consecutive points
    order = np.argsort((of_key[inside] << 32) + step[inside] + 2**31)
    of_key, step, value = of_key[inside][order], step[inside][order], value[inside][order]
    lo, hi = lo[inside][order], hi[inside][order]
    slot = of_key * wanted + (step - lo) * wanted // (hi - lo + 1)  # output bucket, numbered across keys
    new = np.r_[True, slot[1:] != slot[:-1]]
    starts, bucket_of = np.flatnonzero(new), np.cumsum(new) - 1
    position = np.arange(len(step))
    last = len(step)
    # each bucket's first (earliest) point holding its lowest value, and its first holding its highest
    low = np.minimum.reduceat(np.where(value == np.minimum.reduceat(value, starts)[bucket_of], position, last), starts)
    high = np.minimum.reduceat(np.where(value == np.maximum.reduceat(value, starts)[bucket_of], position, last), starts)
    pairs = np.stack((np.minimum(low, high), np.maximum(low, high)), axis=1)  # in step order
    keep = np.ones(pairs.shape, dtype=bool)
    keep[:, 1] = pairs[:, 0] != pairs[:, 1]  # the min and the max are one point
    chosen = pairs[keep]
    steps, values = step[chosen], value[chosen]
    bounds = np.searchsorted(of_key[chosen], np.arange(len(keys) + 1)).tolist()
    return {key: (steps[bounds[i] : bounds[i + 1]], values[bounds[i] : bounds[i + 1]]) for i, key in enumerate(keys)}
