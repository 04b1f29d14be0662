"""The read side of the run store: filtered, sorted, keyset-paginated queries backed by indexes."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any, TypeVar

import numpy as np
import orjson
from sqlalchemy import Float, and_, func, literal, literal_column, or_, select, text, tuple_, type_coerce
from sqlalchemy.engine import Engine
from sqlalchemy.sql import ColumnElement, Select
from sqlmodel import Session, col

from collage.app.store.errors import StoreError
from collage.app.store.tables import Event, Metric, Run, RunTag, Sample, SampleImage, table_of

from .rollups import Series, as_points, downsample_series, plain_rows

PAGE_MAX = 500
INT64 = 2**63  # ids and integer sort values of a cursor lie in the store's 64-bit range


class BadCursor(StoreError, ValueError):
    pass


NOT_OURS = "cursor is not one this API returned (or it was altered): request the first page again without it"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode((text + "=" * (-len(text) % 4)).encode())


def _mac(key: bytes, payload: bytes) -> bytes:
    # a 128-bit tag: forging one is out of reach, and the cursor stays short
    return hmac.new(key, b"collage-cursor\x00" + payload, hashlib.sha256).digest()[:16]


def encode_cursor(values: Sequence[Any], key: bytes, scope: Sequence[str]) -> str:
    """An opaque, signed cursor: the keyset ``values`` and the ``scope`` (listing, run, sort order) they belong
    to, so a cursor is refused anywhere but where it was made."""
    payload = json.dumps([list(scope), list(values)], separators=(",", ":")).encode()
    return f"{_b64(payload)}.{_b64(_mac(key, payload))}"


def decode_cursor(cursor: str, key: bytes, scope: Sequence[str], size: int) -> list[Any]:
    """The keyset values of a cursor made by :func:`encode_cursor` for ``scope``; :class:`BadCursor` otherwise."""
    body, _, tag = cursor.partition(".")
    try:
        payload, mac = _unb64(body), _unb64(tag)
    except (ValueError, binascii.Error) as exc:
        raise BadCursor(NOT_OURS) from exc
    if not hmac.compare_digest(mac, _mac(key, payload)):
        raise BadCursor(NOT_OURS)
    try:
        made_for, values = json.loads(payload)
    except (ValueError, TypeError) as exc:  # signed by us, so only an older cursor format lands here
        raise BadCursor(NOT_OURS) from exc
    if made_for != list(scope):
        raise BadCursor(f"cursor was made for {_describe(made_for)}, not for {_describe(scope)}: request the first "
                        "page again without it")  # fmt: skip
    if not isinstance(values, list) or len(values) != size:
        raise BadCursor(NOT_OURS)
    return values


def _describe(scope: Any) -> str:
    if isinstance(scope, list) and len(scope) == 4 and scope[0] == "samples":
        rows = "eval samples" if scope[3] == "eval" else "samples"  # training rows: the samples, as ever
        return f"the {rows} of run {scope[1]} sorted by {scope[2]}"
    return "the run list" if scope == ["runs"] else "another listing"


def _int_in_range(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -INT64 <= value < INT64


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return _int_in_range(value) or (isinstance(value, float) and math.isfinite(value))


# ------------------------------------------------------------------------------------------------ runs


def latest_metric(session: Session, run_ids: Sequence[str], key: str) -> dict[str, float | None]:
    if not run_ids:
        return {}
    last = (
        select(col(Metric.run_id), func.max(col(Metric.step)).label("step"))
        .where(col(Metric.run_id).in_(run_ids), col(Metric.key) == key)
        .group_by(col(Metric.run_id))
        .subquery()
    )
    rows = session.execute(
        select(col(Metric.run_id), col(Metric.value)).join(
            last, and_(col(Metric.run_id) == last.c.run_id, col(Metric.step) == last.c.step, col(Metric.key) == key)
        )
    )
    return {run_id: value for run_id, value in rows}


EVAL_REWARD = "eval/reward"


def eval_reward_greater_is_better(config: dict[str, Any] | None) -> bool:
    """Whether a run's best ``eval/reward`` is its highest (else its lowest). A reward is maximised, so the
    highest, unless the run ranks its checkpoints by ``eval/reward`` itself (``train.metric_for_best_model``)
    with ``train.greater_is_better: false``: then "best" means what its checkpoints' ``best`` means.
    ``greater_is_better`` set for another metric says nothing about the reward."""
    train = (config or {}).get("train") or {}
    return not (train.get("metric_for_best_model") == EVAL_REWARD and train.get("greater_is_better") is False)


def best_model_metric(config: dict[str, Any] | None) -> tuple[str, bool] | None:
    """The held-out metric a run picks its best checkpoint by (``train.metric_for_best_model`` when it is an
    ``eval/`` key) and whether higher is better (``train.greater_is_better``; unset: yes unless the name ends in
    ``loss``, as the trainer decides); None for a run that ranks by no evaluation metric."""
    train = (config or {}).get("train") or {}
    key = train.get("metric_for_best_model")
    if not isinstance(key, str) or not key.startswith("eval/"):
        return None
    greater = train.get("greater_is_better")
    return key, (not key.endswith("loss")) if greater is None else bool(greater)


def best_model_metrics(session: Session, runs: Sequence[Run]) -> dict[str, tuple[str, float | None, float | None]]:
    """``{run_id: (key, latest, best)}`` of each run's best-model metric (:func:`best_model_metric`) for a page of
    runs: one grouped query per distinct key. Runs without such a metric are absent; so are runs that have not
    logged it yet."""
    ranked = {r.id: metric for r in runs if (metric := best_model_metric(r.config)) is not None}
    out: dict[str, tuple[str, float | None, float | None]] = {}
    for key in {metric[0] for metric in ranked.values()}:
        ids = [run_id for run_id, metric in ranked.items() if metric[0] == key]
        for run_id, (latest, high, low) in _latest_and_range(session, ids, key).items():
            out[run_id] = (key, latest, high if ranked[run_id][1] else low)
    return out


def _latest_and_range(session: Session, ids: Sequence[str], key: str) -> dict[str, tuple[float | None, ...]]:
    """``{run_id: (latest, highest, lowest)}`` of metric ``key`` for the runs ``ids``, in one grouped query (the
    metrics' primary key (run_id, key, step) serves it: a range per run). A value logged as NaN is stored as null
    and counts for neither bound."""
    if not ids:
        return {}
    summary = (
        select(
            col(Metric.run_id),
            func.max(col(Metric.step)).label("step"),
            func.max(col(Metric.value)).label("high"),
            func.min(col(Metric.value)).label("low"),
        )
        .where(col(Metric.run_id).in_(list(ids)), col(Metric.key) == key)
        .group_by(col(Metric.run_id))
        .subquery()
    )
    rows = session.execute(
        select(summary.c.run_id, col(Metric.value), summary.c.high, summary.c.low).join(
            Metric,
            and_(col(Metric.run_id) == summary.c.run_id, col(Metric.key) == key, col(Metric.step) == summary.c.step),
        )
    )
    return {run_id: (latest, high, low) for run_id, latest, high, low in rows}


def eval_rewards(session: Session, runs: Sequence[Run]) -> dict[str, tuple[float | None, float | None]]:
    """``{run_id: (latest, best)}`` of ``eval/reward`` (the weighted sum of the reward functions on held-out rows)
    for a page of runs, in one grouped query. Runs without the metric are absent."""
    greater = {r.id: eval_reward_greater_is_better(r.config) for r in runs}
    found = _latest_and_range(session, [r.id for r in runs], EVAL_REWARD)
    return {run_id: (latest, high if greater[run_id] else low) for run_id, (latest, high, low) in found.items()}


def list_runs(
    session: Session,
    status: str | None = None,
    tag: str | None = None,
    algorithm: str | None = None,
    q: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
    *,
    key: bytes,
) -> tuple[list[Run], str | None]:
    """Newest first; ``key`` signs and checks the cursors."""
    stmt = select(Run)
    if status:
        stmt = stmt.where(col(Run.status) == status)
    if algorithm:
        stmt = stmt.where(col(Run.algorithm) == algorithm)
    if tag:
        stmt = stmt.where(col(Run.id).in_(select(col(RunTag.run_id)).where(col(RunTag.tag) == tag)))
    if q:
        like = f"%{_escape_like(q)}%"
        stmt = stmt.where(or_(col(Run.name).ilike(like, escape="\\"), col(Run.id) == q))
    if cursor:
        created, run_id = decode_cursor(cursor, key, ["runs"], 2)
        try:
            created_at = datetime.fromisoformat(created)
        except (TypeError, ValueError) as exc:
            raise BadCursor(NOT_OURS) from exc
        if not isinstance(run_id, str) or len(run_id) > 32:
            raise BadCursor(NOT_OURS)
        stmt = stmt.where(
            tuple_(col(Run.created_at), col(Run.id))
            < tuple_(literal(created_at, table_of(Run).c.created_at.type), literal(run_id))
        )
    stmt = stmt.order_by(col(Run.created_at).desc(), col(Run.id).desc()).limit(limit + 1)
    runs = list(session.scalars(stmt))
    next_cursor = None
    if len(runs) > limit:
        runs = runs[:limit]
        last = runs[-1]
        next_cursor = encode_cursor([last.created_at.isoformat(), last.id], key, ["runs"])
    return runs, next_cursor


def run_tags(session: Session, run_ids: Sequence[str]) -> dict[str, list[str]]:
    tags: dict[str, list[str]] = {r: [] for r in run_ids}
    if run_ids:
        for run_id, tag in session.execute(
            select(col(RunTag.run_id), col(RunTag.tag)).where(col(RunTag.run_id).in_(run_ids)).order_by(col(RunTag.tag))
        ):
            tags[run_id].append(tag)
    return tags


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


# --------------------------------------------------------------------------------------------- samples

NULL_SORT = -1e300  # where unscorable rows (reward NULL) sort: below any real reward, as ``Sample.reward_sort``
REWARD_SORT_PREFIX = "reward."  # sort=reward.<name>: by one reward function's value

SORTS = {
    "step": col(Sample.step),
    "reward": col(Sample.reward_sort),
    "advantage": col(Sample.advantage),
    "completion_length": col(Sample.completion_length),
    "group": col(Sample.group),
    "num_images": col(Sample.num_images),
    "tool_calls": col(Sample.tool_calls),
    "tool_errors": col(Sample.tool_errors),
    "turns": col(Sample.turns),
    "id": col(Sample.id),
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
    reward_name: str | None = None  # min_reward / max_reward bound this reward function's value, not the total
    dataset_row: int | None = None
    group: int | None = None
    split: str = "train"  # train | eval: training rollouts, or held-out evaluation rollouts (never both at once)
    # a multi-turn rollout's trajectory: its tool calls, whether a tool reported an error, its turns
    min_tool_calls: int | None = None
    max_tool_calls: int | None = None
    has_tool_error: bool | None = None
    min_turns: int | None = None
    max_turns: int | None = None


SPLITS = ("train", "eval")
EVAL_LIKELIHOOD = 0.01  # the share of a run's rollout rows SQLite's planner assumes are eval rows


def reward_names(config: dict[str, Any] | None) -> list[str]:
    """The names a run's reward functions log under (``rewards`` of its samples, ``rewards/<name>/...`` metrics),
    from its config, as the trainer names them: a built-in by its name, ``package.module:function`` by the
    function, a reward model checkpoint by its folder's name."""
    names = []
    for reward in (config or {}).get("rewards") or []:
        name = str(reward.get("name", "")) if isinstance(reward, dict) else ""
        module, colon, attr = name.partition(":")
        if colon and "/" not in module and "\\" not in module and not module.startswith("~"):
            name = attr
        elif "/" in name:
            name = PurePosixPath(name.rstrip("/")).name
        if name and name not in names:
            names.append(name)
    return names


def parse_sort(sort: str) -> tuple[str, bool]:
    """``(name, descending)``; ``name`` is a column of :data:`SORTS` or ``reward.<function>``."""
    descending = sort.startswith("-")
    name = sort.lstrip("-+")
    if name not in SORTS and not (name.startswith(REWARD_SORT_PREFIX) and len(name) > len(REWARD_SORT_PREFIX)):
        raise ValueError(
            f"sort must be one of {', '.join(sorted(SORTS))} or reward.<function> (prefix - for descending), "
            f"got {sort!r}"
        )
    return name, descending


def reward_value(name: str, dialect: str):
    """One reward function's value of a row, as an SQL float (NULL when unscorable or absent). ``rewards`` is
    JSON: ``->>`` on PostgreSQL; on SQLite the key is matched through ``json_each``, since a JSON path cannot
    name every key (quotes, backslashes, non-ASCII letters)."""
    if dialect == "sqlite":
        each = func.json_each(Sample.rewards).table_valued("key", "value")
        return type_coerce(select(each.c.value).where(each.c.key == name).scalar_subquery(), Float())
    return Sample.rewards[name].as_float()


def sort_column(name: str, dialect: str):
    """The non-null expression a sort orders and pages by."""
    if name.startswith(REWARD_SORT_PREFIX):
        return func.coalesce(reward_value(name[len(REWARD_SORT_PREFIX) :], dialect), literal(NULL_SORT, Float()))
    return SORTS[name]


def split_is(split: str, dialect: str) -> ColumnElement[bool]:
    """The rows of one split. An eval query should read its rows through ``ix_samples_split`` (run_id, split,
    step, id): PostgreSQL's per-value statistics know eval rows are a small part of a run's rows and choose it;
    SQLite's statistics hold one average row count per (run, split), blind to that, and would walk a sort's index
    (``ix_samples_reward``, ...) through the run's training rows to fill a page of eval rows. ``likelihood()``
    (a no-op at run time) tells SQLite's planner how rare the term is, so it takes the split index."""
    if split not in SPLITS:  # the routes validate it: another value here is a programming error, not "no rows"
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    term = col(Sample.split) == split
    if dialect == "sqlite" and split == "eval":
        return func.likelihood(term, literal_column(repr(EVAL_LIKELIHOOD), Float()))  # a constant, not a parameter
    return term


_Select = TypeVar("_Select", bound=Select)


def _apply_filters(stmt: _Select, f: SampleFilters, dialect: str) -> _Select:
    stmt = stmt.where(split_is(f.split, dialect))
    if f.step is not None:
        stmt = stmt.where(col(Sample.step) == f.step)
    if f.group is not None:
        stmt = stmt.where(col(Sample.group) == f.group)
    if f.dataset_row is not None:
        stmt = stmt.where(col(Sample.dataset_row) == f.dataset_row)
    if f.min_step is not None:
        stmt = stmt.where(col(Sample.step) >= f.min_step)
    if f.max_step is not None:
        stmt = stmt.where(col(Sample.step) <= f.max_step)
    bounded = col(Sample.reward) if f.reward_name is None else reward_value(f.reward_name, dialect)
    if f.min_reward is not None:
        stmt = stmt.where(bounded >= f.min_reward)
    if f.max_reward is not None:
        stmt = stmt.where(bounded <= f.max_reward)
    if f.advantage == "pos":
        stmt = stmt.where(col(Sample.advantage) > 0)
    elif f.advantage == "neg":
        stmt = stmt.where(col(Sample.advantage) < 0)
    elif f.advantage == "zero":
        stmt = stmt.where(col(Sample.advantage) == 0)
    if f.zero_std_groups is not None:
        stmt = stmt.where(col(Sample.zero_std) == f.zero_std_groups)
    if f.truncated is not None:
        stmt = stmt.where(col(Sample.truncated) == f.truncated)
    if f.min_images is not None:
        stmt = stmt.where(col(Sample.num_images) >= f.min_images)
    if f.max_images is not None:
        stmt = stmt.where(col(Sample.num_images) <= f.max_images)
    if f.min_tool_calls is not None:
        stmt = stmt.where(col(Sample.tool_calls) >= f.min_tool_calls)
    if f.max_tool_calls is not None:
        stmt = stmt.where(col(Sample.tool_calls) <= f.max_tool_calls)
    if f.has_tool_error is True:
        stmt = stmt.where(col(Sample.tool_errors) > 0)
    elif f.has_tool_error is False:
        stmt = stmt.where(col(Sample.tool_errors) == 0)
    if f.min_turns is not None:
        stmt = stmt.where(col(Sample.turns) >= f.min_turns)
    if f.max_turns is not None:
        stmt = stmt.where(col(Sample.turns) <= f.max_turns)
    if f.q:
        like = f"%{_escape_like(f.q)}%"
        stmt = stmt.where(
            or_(col(Sample.completion).ilike(like, escape="\\"), col(Sample.prompt_text).ilike(like, escape="\\"))
        )
    return stmt


def query_samples(
    session: Session,
    run_id: str,
    filters: SampleFilters,
    sort: str = "step",
    cursor: str | None = None,
    limit: int = 50,
    *,
    key: bytes,
) -> tuple[list[Sample], dict[int, list[str]], str | None]:
    """A page of samples, their image hashes in order, and the cursor of the next page (signed with ``key``,
    valid only for this run, split and sort order)."""
    name, descending = parse_sort(sort)
    dialect = session.get_bind().dialect.name
    column = sort_column(name, dialect)
    scope = ["samples", run_id, f"-{name}" if descending else name, filters.split]
    stmt = select(Sample, column.label("sort_value")).where(col(Sample.run_id) == run_id)
    stmt = _apply_filters(stmt, filters, dialect)
    if cursor:
        value, last_id = decode_cursor(cursor, key, scope, 2)
        is_float = name in ("reward", "advantage") or name.startswith(REWARD_SORT_PREFIX)
        if not _int_in_range(last_id) or not (_finite_number(value) if is_float else _int_in_range(value)):
            raise BadCursor(NOT_OURS)
        keyset = tuple_(column, col(Sample.id))
        id_type = table_of(Sample).c.id.type
        bound = tuple_(literal(float(value) if is_float else value, column.type), literal(last_id, id_type))
        stmt = stmt.where(keyset < bound if descending else keyset > bound)
    if descending:
        stmt = stmt.order_by(column.desc(), col(Sample.id).desc())
    else:
        stmt = stmt.order_by(column.asc(), col(Sample.id).asc())
    found = session.execute(stmt.limit(limit + 1)).all()
    rows = [r[0] for r in found]
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        # the sort value as the database computed it, so the next page starts exactly after this row
        next_cursor = encode_cursor([found[limit - 1][1], rows[-1].id], key, scope)
    return rows, image_shas(session, [row_id(r) for r in rows]), next_cursor


COUNT_CAP = 100_000  # a count stops here: "more than 100,000 rows" is all a reader needs, and it stays cheap


def count_samples(session: Session, run_id: str, filters: SampleFilters, cap: int = COUNT_CAP) -> tuple[int, bool]:
    """``(rows, capped)``: how many samples of the run match ``filters``, counting at most ``cap`` (``capped``:
    there are more). The count reads an index-ordered LIMIT, so its cost is bounded by ``cap`` rows whatever the
    run's size."""
    dialect = session.get_bind().dialect.name
    matching = select(col(Sample.id)).where(col(Sample.run_id) == run_id)
    matching = _apply_filters(matching, filters, dialect).limit(cap + 1)
    found = session.execute(select(func.count()).select_from(matching.subquery())).scalar_one()
    return min(found, cap), found > cap


def row_id(sample: Sample) -> int:
    """A stored sample's id (set once the row is written; the model types it ``int | None`` for new rows)."""
    assert sample.id is not None
    return sample.id


def image_shas(session: Session, sample_ids: Sequence[int]) -> dict[int, list[str]]:
    """Each sample's image hashes, in prompt order."""
    images: dict[int, list[str]] = {sample_id: [] for sample_id in sample_ids}
    if sample_ids:
        links = session.execute(
            select(col(SampleImage.sample_id), col(SampleImage.sha256))
            .where(col(SampleImage.sample_id).in_(list(sample_ids)))
            .order_by(col(SampleImage.sample_id), col(SampleImage.position))
        )
        for sample_id, sha in links:
            images[sample_id].append(sha)
    return images


def iter_samples(
    engine: Engine, run_id: str, split: str = "train", batch: int = 1000
) -> Iterator[tuple[Sample, list[str]]]:
    """Every sample of a run's ``split`` in (step, id) order with its image hashes, streamed in batches (the
    index ``ix_samples_split`` serves the order). Each batch is read in its own short session, closed before its
    rows are handed out: a slow download holds no connection."""
    last = (-1, -1)
    while True:
        stmt = (
            select(Sample)
            .where(
                col(Sample.run_id) == run_id,
                split_is(split, engine.dialect.name),
                tuple_(col(Sample.step), col(Sample.id)) > tuple_(literal(last[0]), literal(last[1])),
            )
            .order_by(col(Sample.step), col(Sample.id))
            .limit(batch)
        )
        with Session(engine) as session:
            rows = list(session.scalars(stmt))
            images = image_shas(session, [row_id(r) for r in rows])
        if not rows:
            return
        yield from ((row, images[row_id(row)]) for row in rows)
        last = (rows[-1].step, row_id(rows[-1]))


# ------------------------------------------------------------------------------------ per-step statistics
HISTOGRAM_COLUMNS = {
    "completion_length": col(Sample.completion_length),
    "reward": col(Sample.reward),
    "advantage": col(Sample.advantage),
    "num_images": col(Sample.num_images),
}


def _of_split(session: Session, run_id: str, split: str) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    return col(Sample.run_id) == run_id, split_is(split, session.get_bind().dialect.name)


def sample_steps(session: Session, run_id: str, split: str) -> list[int]:
    """Every step of the run that has rollout rows of ``split``, ascending."""
    stmt = select(col(Sample.step)).where(*_of_split(session, run_id, split)).distinct().order_by(col(Sample.step))
    return list(session.execute(stmt).scalars().all())


def sample_values(session: Session, run_id: str, split: str, field: str, step: int) -> list[Any]:
    """The values of one rollout column (a key of HISTOGRAM_COLUMNS) in the rows of ``split`` at ``step``, None
    for a row without one."""
    column = HISTOGRAM_COLUMNS[field]
    stmt = select(column).where(*_of_split(session, run_id, split), col(Sample.step) == step)
    return list(session.execute(stmt).scalars().all())


# --------------------------------------------------------------------------------------------- metrics


def iter_metrics(engine: Engine, run_id: str, batch: int = 5000) -> Iterator[tuple[int, str, float | None]]:
    """Every ``(step, key, value)`` of a run in (step, key) order, streamed in batches, each read in its own short
    session closed before its values are handed out: a slow download holds no connection."""
    last = (-1, "")
    while True:
        with Session(engine) as session:
            rows = session.execute(
                select(col(Metric.step), col(Metric.key), col(Metric.value))
                .where(col(Metric.run_id) == run_id)
                .where((col(Metric.step) > last[0]) | ((col(Metric.step) == last[0]) & (col(Metric.key) > last[1])))
                .order_by(col(Metric.step), col(Metric.key))
                .limit(batch)
            ).all()
        if not rows:
            return
        yield from ((step, key, value) for step, key, value in rows)
        last = (rows[-1][0], rows[-1][1])


def metric_keys(session: Session, run_id: str) -> list[str]:
    """The run's metric names, in order: a loose index scan, one seek on the primary key (run_id, key, step) per
    name, instead of a DISTINCT over every point of the run."""
    return list(session.connection().execute(_METRIC_KEYS, {"run": run_id}).scalars())


_METRIC_KEYS = text(
    "WITH RECURSIVE names(key) AS ("
    " SELECT min(key) FROM metrics WHERE run_id = :run"
    " UNION ALL"
    " SELECT (SELECT min(key) FROM metrics WHERE run_id = :run AND key > names.key) FROM names"
    " WHERE names.key IS NOT NULL"
    ") SELECT key FROM names WHERE key IS NOT NULL ORDER BY key"
)
SPAN_KEYS = 500  # keys per statement of metric_spans


def metric_spans(
    session: Session, run_id: str, keys: Sequence[str], from_step: int | None, to_step: int | None
) -> dict[str, tuple[int, int, float | None]]:
    """``{key: (first step, last step, last value)}`` within the range, for the keys with a point there: a few
    index seeks per key on the primary key (run_id, key, step), in one statement."""
    within = (" AND step >= :from_step" if from_step is not None else "") + (
        " AND step <= :to_step" if to_step is not None else ""
    )
    spans: dict[str, tuple[int, int, float | None]] = {}
    for start in range(0, len(keys), SPAN_KEYS):
        chunk = keys[start : start + SPAN_KEYS]
        names = ", ".join(f"(:k{i})" for i in range(len(chunk)))
        statement = text(
            f"WITH names(key) AS (VALUES {names}), spans AS (SELECT names.key AS key,"
            f" (SELECT min(step) FROM metrics WHERE run_id = :run AND key = names.key{within}) AS lo,"
            f" (SELECT max(step) FROM metrics WHERE run_id = :run AND key = names.key{within}) AS hi FROM names)"
            " SELECT key, lo, hi, (SELECT value FROM metrics WHERE run_id = :run AND key = spans.key AND step = spans.hi)"
            " FROM spans WHERE lo IS NOT NULL"
        )
        params: dict[str, Any] = {"run": run_id, "from_step": from_step, "to_step": to_step}
        params.update((f"k{i}", key) for i, key in enumerate(chunk))
        spans.update((key, (lo, hi, last)) for key, lo, hi, last in session.connection().execute(statement, params))
    return spans


def _every_point(
    session: Session, run_id: str, keys: Sequence[str], from_step: int | None, to_step: int | None
) -> dict[str, Series]:
    """Each of ``keys``' points in range, in step order (keys without any are absent)."""
    where = [col(Metric.run_id) == run_id, col(Metric.key).in_(keys)]
    if from_step is not None:
        where.append(col(Metric.step) >= from_step)
    if to_step is not None:
        where.append(col(Metric.step) <= to_step)
    stmt = select(col(Metric.key), col(Metric.step), col(Metric.value)).where(*where)
    rows = plain_rows(session, stmt.order_by(col(Metric.key), col(Metric.step)))
    if not rows:
        return {}
    names, steps, values = zip(*rows, strict=True)
    index = {key: i for i, key in enumerate(keys)}
    of_key = np.fromiter(map(index.__getitem__, names), np.int64, len(names))
    step = np.array(steps, dtype=np.int64)
    value = np.array(values, dtype=np.float64)  # None (a NaN or an infinity logged) becomes NaN
    bounds = [0, *(np.flatnonzero(of_key[1:] != of_key[:-1]) + 1).tolist(), len(names)]  # a key's points are a run
    return {names[a]: (step[a:b], value[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)}


def metric_series(
    session: Session,
    run_id: str,
    keys: Sequence[str] | None,
    from_step: int | None,
    to_step: int | None,
    max_points: int | None,
) -> dict[str, Series]:
    """``{key: (steps, values)}`` (see :data:`~.rollups.Series`). Above ``max_points`` per key, each bucket of
    steps keeps its minimum and its maximum (in step order), so spikes survive; the last point is always kept.

    Reads go through SQLAlchemy Core on the session's connection, not the ORM's ``Session.execute``, whose
    handling of each row cost more than the database for the thousands of rows of a long run."""
    keys = list(dict.fromkeys(keys)) if keys else metric_keys(session, run_id)
    empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    out: dict[str, Series] = dict.fromkeys(keys, empty)
    if not keys:
        return out
    if max_points is None:  # every point (the export's view)
        out.update(_every_point(session, run_id, keys, from_step, to_step))
        return out
    spans = metric_spans(session, run_id, keys, from_step, to_step)
    # steps spanned: the point count of a series logged every step
    small = [k for k, (lo, hi, _) in spans.items() if hi - lo + 1 <= max_points]
    large = {k: (lo, hi) for k, (lo, hi, _) in spans.items() if hi - lo + 1 > max_points}
    if small:
        out.update(_every_point(session, run_id, small, from_step, to_step))
    if large:
        for key, (steps, values) in downsample_series(session, run_id, large, max_points).items():
            # the last point always stays, even when it is neither a minimum nor a maximum (or is NaN)
            hi, last = large[key][1], spans[key][2]
            if not len(steps) or steps[-1] != hi:
                steps, values = np.append(steps, hi), np.append(values, np.nan if last is None else last)
            out[key] = steps, values
    return out


def query_metrics(
    session: Session,
    run_id: str,
    keys: Sequence[str] | None,
    from_step: int | None,
    to_step: int | None,
    max_points: int | None,
) -> dict[str, list[list[float | None]]]:
    """``{key: [[step, value], ...]}``: :func:`metric_series` as lists (``None`` for a missing value)."""
    return {
        key: as_points(series)
        for key, series in metric_series(session, run_id, keys, from_step, to_step, max_points).items()
    }


def metrics_json(
    session: Session,
    run_id: str,
    keys: Sequence[str] | None,
    from_step: int | None,
    to_step: int | None,
    max_points: int | None,
) -> bytes:
    """:func:`query_metrics` as JSON, written by orjson straight from the arrays: no Python object per point."""
    series = metric_series(session, run_id, keys, from_step, to_step, max_points)
    return orjson.dumps({key: orjson.Fragment(series_json(*s)) for key, s in series.items()})


def series_json(steps: np.ndarray, values: np.ndarray) -> bytes:
    """``[[step, value], ...]`` (``null`` for NaN), byte for byte what ``orjson.dumps`` writes for the lists."""
    if not len(steps):
        return b"[]"
    step_texts = orjson.dumps(steps, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",")
    value_texts = orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",")
    return b"[[" + b"],[".join(map(b",".join, zip(step_texts, value_texts, strict=True))) + b"]]"


# ---------------------------------------------------------------------------------------------- events


def query_events(session: Session, run_id: str, after: int | None, limit: int, level: str | None = None) -> list[Event]:
    stmt = select(Event).where(col(Event.run_id) == run_id)
    if after is not None:
        stmt = stmt.where(col(Event.id) > after)
    if level:
        stmt = stmt.where(col(Event.level) == level)
    return list(session.scalars(stmt.order_by(col(Event.id)).limit(limit)))
