"""The read side of the run store: filtered, sorted, keyset-paginated queries backed by indexes."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, literal, or_, select, tuple_
from sqlmodel import Session

from ..models import Event, Metric, Run, RunTag, Sample, SampleImage

PAGE_MAX = 500


class BadCursor(ValueError):
    pass


def encode_cursor(values: Sequence[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(values)).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, size: int) -> list[Any]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = json.loads(base64.urlsafe_b64decode(padded.encode()).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadCursor("cursor is not one this API returned") from exc
    if not isinstance(values, list) or len(values) != size:
        raise BadCursor("cursor is not one this API returned")
    return values


# ------------------------------------------------------------------------------------------------ runs


def latest_metric(session: Session, run_ids: Sequence[str], key: str) -> dict[str, float | None]:
    if not run_ids:
        return {}
    last = (
        select(Metric.run_id, func.max(Metric.step).label("step"))
        .where(Metric.run_id.in_(run_ids), Metric.key == key)
        .group_by(Metric.run_id)
        .subquery()
    )
    rows = session.execute(
        select(Metric.run_id, Metric.value).join(
            last, and_(Metric.run_id == last.c.run_id, Metric.step == last.c.step, Metric.key == key)
        )
    )
    return {run_id: value for run_id, value in rows}


def list_runs(
    session: Session,
    status: str | None = None,
    tag: str | None = None,
    algorithm: str | None = None,
    q: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> tuple[list[Run], str | None]:
    """Newest first."""
    stmt = select(Run)
    if status:
        stmt = stmt.where(Run.status == status)
    if algorithm:
        stmt = stmt.where(Run.algorithm == algorithm)
    if tag:
        stmt = stmt.where(Run.id.in_(select(RunTag.run_id).where(RunTag.tag == tag)))
    if q:
        like = f"%{_escape_like(q)}%"
        stmt = stmt.where(or_(Run.name.ilike(like, escape="\\"), Run.id == q))
    if cursor:
        created, run_id = decode_cursor(cursor, 2)
        from datetime import datetime

        try:
            created_at = datetime.fromisoformat(created)
        except (TypeError, ValueError) as exc:
            raise BadCursor("cursor is not one this API returned") from exc
        stmt = stmt.where(
            tuple_(Run.created_at, Run.id) < tuple_(literal(created_at, Run.created_at.type), literal(run_id))
        )
    stmt = stmt.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit + 1)
    runs = list(session.scalars(stmt))
    next_cursor = None
    if len(runs) > limit:
        runs = runs[:limit]
        last = runs[-1]
        next_cursor = encode_cursor([last.created_at.isoformat(), last.id])
    return runs, next_cursor


def run_tags(session: Session, run_ids: Sequence[str]) -> dict[str, list[str]]:
    tags: dict[str, list[str]] = {r: [] for r in run_ids}
    if run_ids:
        for run_id, tag in session.execute(
            select(RunTag.run_id, RunTag.tag).where(RunTag.run_id.in_(run_ids)).order_by(RunTag.tag)
        ):
            tags[run_id].append(tag)
    return tags


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


# --------------------------------------------------------------------------------------------- samples

SORTS = {
    "step": Sample.step,
    "reward": Sample.reward_sort,
    "advantage": Sample.advantage,
    "completion_length": Sample.completion_length,
    "group": Sample.group,
    "num_images": Sample.num_images,
    "id": Sample.id,
}


@dataclass
class SampleFilters:
    step: int | None = None
    min_step: int | None = None
    max_step: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    advantage: str | None = None  # pos | neg | zero
    zero_std_groups: bool | None = None
    truncated: bool | None = None
    min_images: int | None = None
    max_images: int | None = None
    q: str | None = None


def parse_sort(sort: str) -> tuple[str, bool]:
    descending = sort.startswith("-")
    name = sort.lstrip("-+")
    if name not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(sorted(SORTS))} (prefix - for descending), got {sort!r}")
    return name, descending


def _apply_filters(stmt, f: SampleFilters):
    if f.step is not None:
        stmt = stmt.where(Sample.step == f.step)
    if f.min_step is not None:
        stmt = stmt.where(Sample.step >= f.min_step)
    if f.max_step is not None:
        stmt = stmt.where(Sample.step <= f.max_step)
    if f.min_reward is not None:
        stmt = stmt.where(Sample.reward >= f.min_reward)
    if f.max_reward is not None:
        stmt = stmt.where(Sample.reward <= f.max_reward)
    if f.advantage == "pos":
        stmt = stmt.where(Sample.advantage > 0)
    elif f.advantage == "neg":
        stmt = stmt.where(Sample.advantage < 0)
    elif f.advantage == "zero":
        stmt = stmt.where(Sample.advantage == 0)
    if f.zero_std_groups is not None:
        stmt = stmt.where(Sample.zero_std == f.zero_std_groups)
    if f.truncated is not None:
        stmt = stmt.where(Sample.truncated == f.truncated)
    if f.min_images is not None:
        stmt = stmt.where(Sample.num_images >= f.min_images)
    if f.max_images is not None:
        stmt = stmt.where(Sample.num_images <= f.max_images)
    if f.q:
        like = f"%{_escape_like(f.q)}%"
        stmt = stmt.where(or_(Sample.completion.ilike(like, escape="\\"), Sample.prompt_text.ilike(like, escape="\\")))
    return stmt


def query_samples(
    session: Session,
    run_id: str,
    filters: SampleFilters,
    sort: str = "step",
    cursor: str | None = None,
    limit: int = 50,
) -> tuple[list[Sample], dict[int, list[str]], str | None]:
    """A page of samples, their image hashes in order, and the cursor of the next page."""
    name, descending = parse_sort(sort)
    column = SORTS[name]
    stmt = _apply_filters(select(Sample).where(Sample.run_id == run_id), filters)
    if cursor:
        value, last_id = decode_cursor(cursor, 2)
        if not isinstance(last_id, int) or not isinstance(value, (int, float)):
            raise BadCursor("cursor is not one this API returned")
        key = tuple_(column, Sample.id)
        bound = tuple_(literal(value, column.type), literal(last_id, Sample.id.type))
        stmt = stmt.where(key < bound if descending else key > bound)
    if descending:
        stmt = stmt.order_by(column.desc(), Sample.id.desc())
    else:
        stmt = stmt.order_by(column.asc(), Sample.id.asc())
    rows = list(session.scalars(stmt.limit(limit + 1)))
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        last = rows[-1]
        next_cursor = encode_cursor([getattr(last, column.key), last.id])
    return rows, image_shas(session, [r.id for r in rows]), next_cursor


def image_shas(session: Session, sample_ids: Sequence[int]) -> dict[int, list[str]]:
    """Each sample's image hashes, in prompt order."""
    images: dict[int, list[str]] = {sample_id: [] for sample_id in sample_ids}
    if sample_ids:
        links = session.execute(
            select(SampleImage.sample_id, SampleImage.sha256)
            .where(SampleImage.sample_id.in_(list(sample_ids)))
            .order_by(SampleImage.sample_id, SampleImage.position)
        )
        for sample_id, sha in links:
            images[sample_id].append(sha)
    return images


def iter_samples(session: Session, run_id: str, batch: int = 1000):
    """Every sample of a run in (step, id) order with its image hashes, streamed in batches."""
    last = (-1, -1)
    while True:
        stmt = (
            select(Sample)
            .where(Sample.run_id == run_id, tuple_(Sample.step, Sample.id) > tuple_(literal(last[0]), literal(last[1])))
            .order_by(Sample.step, Sample.id)
            .limit(batch)
        )
        rows = list(session.scalars(stmt))
        if not rows:
            return
        images = image_shas(session, [r.id for r in rows])
        yield from ((row, images[row.id]) for row in rows)
        last = (rows[-1].step, rows[-1].id)


# --------------------------------------------------------------------------------------------- metrics


def metric_keys(session: Session, run_id: str) -> list[str]:
    return list(session.scalars(select(Metric.key).where(Metric.run_id == run_id).distinct().order_by(Metric.key)))


def query_metrics(
    session: Session,
    run_id: str,
    keys: Sequence[str] | None,
    from_step: int | None,
    to_step: int | None,
    max_points: int | None,
) -> dict[str, list[list[float | None]]]:
    """``{key: [[step, value], ...]}``. Above ``max_points`` per key, each bucket of steps keeps its minimum
    and its maximum (in step order), so spikes survive; the last point is always kept."""
    keys = list(keys) if keys else metric_keys(session, run_id)
    out: dict[str, list[list[float | None]]] = {k: [] for k in keys}
    if not keys:
        return out
    where = [Metric.run_id == run_id, Metric.key.in_(keys)]
    if from_step is not None:
        where.append(Metric.step >= from_step)
    if to_step is not None:
        where.append(Metric.step <= to_step)
    if max_points is None:  # every point (the export's view)
        for key, step, value in session.execute(
            select(Metric.key, Metric.step, Metric.value).where(*where).order_by(Metric.key, Metric.step)
        ):
            out[key].append([step, value])
        return out
    # each key's first and last step in range: two index seeks per key, instead of counting every point
    stats = []
    for key in keys:
        bounded = select(Metric.step).where(*where[:1], Metric.key == key, *where[2:])
        lo = session.execute(bounded.order_by(Metric.step.asc()).limit(1)).scalar()
        if lo is None:
            continue
        hi = session.execute(bounded.order_by(Metric.step.desc()).limit(1)).scalar()
        stats.append((key, hi - lo + 1, lo, hi))  # steps spanned: the point count of a series logged every step
    small = [k for k, n, _, _ in stats if n <= max_points]
    large = {k: (lo, hi) for k, n, lo, hi in stats if n > max_points}
    if small:
        rows = session.execute(
            select(Metric.key, Metric.step, Metric.value)
            .where(*where[:1], Metric.key.in_(small), *where[2:])
            .order_by(Metric.key, Metric.step)
        )
        for key, step, value in rows:
            out[key].append([step, value])
    if large:
        from .rollups import downsample

        out.update(downsample(session, run_id, large, max_points))
        # the last point always stays, even when it is neither a minimum nor a maximum (or is NaN)
        lasts = session.execute(
            select(Metric.key, Metric.step, Metric.value).where(
                Metric.run_id == run_id, tuple_(Metric.key, Metric.step).in_([(k, hi) for k, (_, hi) in large.items()])
            )
        )
        for key, step, value in lasts:
            if not out[key] or out[key][-1][0] != step:
                out[key].append([step, value])
    return out


# ---------------------------------------------------------------------------------------------- events


def query_events(session: Session, run_id: str, after: int | None, limit: int, level: str | None = None) -> list[Event]:
    stmt = select(Event).where(Event.run_id == run_id)
    if after is not None:
        stmt = stmt.where(Event.id > after)
    if level:
        stmt = stmt.where(Event.level == level)
    return list(session.scalars(stmt.order_by(Event.id).limit(limit)))
