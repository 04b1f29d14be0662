"""The rollout table: filtered, sorted, paginated samples, and exports of samples or metrics."""

from __future__ import annotations

import csv
import io
import json
import tempfile
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy.engine import Engine

from ..auth import UNAUTHORIZED, require_token
from ..deps import CursorKeyDep, EngineDep, ExportSlotsDep, SessionDep, SettingsDep, StreamSessionDep
from ..schemas import SamplePage, ValidationErrorOut
from ..store import queries
from ..store.image_index import image_sizes
from .common import get_run_or_404, sample_out
from .downloads import SlotStream, hold_export_slot

INT_MAX = 2**31 - 1  # steps and counts are 32-bit integers in the store

Split = Literal["train", "eval"]

router = APIRouter(tags=["samples"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)


def sample_filters(
    step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    min_step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    max_step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    min_reward: Annotated[
        float | None, Query(allow_inf_nan=False, description="the total reward, or reward_name's value, at least")
    ] = None,
    max_reward: Annotated[
        float | None, Query(allow_inf_nan=False, description="the total reward, or reward_name's value, at most")
    ] = None,
    reward_name: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=200,
            description="a reward function of the run's config: min_reward and max_reward bound its value instead "
            "of the total (rows it could not score never match)",
        ),
    ] = None,
    dataset_row: Annotated[
        int | None, Query(ge=0, le=INT_MAX, description="the dataset row the prompt came from")
    ] = None,
    group: Annotated[int | None, Query(ge=0, le=INT_MAX, description="the prompt group (with step: one group)")] = None,
    advantage: Annotated[Literal["pos", "neg", "zero"] | None, Query()] = None,
    zero_std_groups: Annotated[
        bool | None, Query(description="true: only rows of zero-variance groups; false: none")
    ] = None,
    truncated: Annotated[bool | None, Query()] = None,
    min_images: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    max_images: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    q: Annotated[str | None, Query(max_length=200, description="text in the prompt or the completion")] = None,
    split: Annotated[
        Split,
        Query(description="train: the rollouts trained on (default); eval: the held-out evaluation rollouts"),
    ] = "train",
    min_tool_calls: Annotated[
        int | None, Query(ge=0, le=INT_MAX, description="a multi-turn rollout's tool calls, at least")
    ] = None,
    max_tool_calls: Annotated[
        int | None, Query(ge=0, le=INT_MAX, description="a multi-turn rollout's tool calls, at most")
    ] = None,
    has_tool_error: Annotated[
        bool | None, Query(description="true: only rows where a tool reported an error; false: none")
    ] = None,
    min_turns: Annotated[int | None, Query(ge=0, le=INT_MAX, description="the trajectory's turns, at least")] = None,
    max_turns: Annotated[int | None, Query(ge=0, le=INT_MAX, description="the trajectory's turns, at most")] = None,
) -> queries.SampleFilters:
    """The rollout table's filters, the same for a page of rows and for their count."""
    return queries.SampleFilters(
        step,
        min_step,
        max_step,
        min_reward,
        max_reward,
        advantage,
        zero_std_groups,
        truncated,
        min_images,
        max_images,
        q,
        reward_name,
        dataset_row,
        group,
        split,
        min_tool_calls=min_tool_calls,
        max_tool_calls=max_tool_calls,
        has_tool_error=has_tool_error,
        min_turns=min_turns,
        max_turns=max_turns,
    )


FiltersDep = Annotated[queries.SampleFilters, Depends(sample_filters)]


@router.get("/runs/{run_id}/samples", response_model=SamplePage, responses={404: {"description": "no such run"}})
def list_samples(
    run_id: str,
    session: SessionDep,
    key: CursorKeyDep,
    filters: FiltersDep,
    sort: Annotated[
        str,
        Query(
            pattern=r"^[-+]?(step|reward|advantage|completion_length|group|num_images|tool_calls|tool_errors|turns|id"
            r"|reward\.[^\x00-\x1f]{1,200})$",
            description="column, prefix - for descending: step, reward, advantage, completion_length, group, "
            "num_images, tool_calls, tool_errors, turns, id, or reward.<function> (one reward function of the run's "
            "config; unscorable rows lowest)",
        ),
    ] = "step",
    cursor: Annotated[str | None, Query(max_length=500)] = None,
    limit: Annotated[int, Query(ge=1, le=queries.PAGE_MAX)] = 50,
) -> SamplePage:
    run = get_run_or_404(session, run_id)
    check_reward_names(run.config, sort, filters.reward_name)
    try:
        rows, images, next_cursor = queries.query_samples(session, run_id, filters, sort, cursor, limit, key=key)
    except queries.BadCursor as exc:
        raise HTTPException(400, str(exc)) from exc
    sizes = image_sizes(session, {sha for shas in images.values() for sha in shas})
    items = [sample_out(r, images[queries.row_id(r)], sizes) for r in rows]
    return SamplePage(items=items, next_cursor=next_cursor)


class SampleCount(BaseModel):
    count: int = Field(description="rollout rows matching the filters, counted up to `cap`")
    capped: bool = Field(description="true: more rows than `cap` match (the count stopped there)")
    cap: int


@router.get(
    "/runs/{run_id}/samples/count",
    response_model=SampleCount,
    responses={404: {"description": "no such run"}, 422: {"model": ValidationErrorOut, "description": "a bad filter"}},
)
def count_samples(
    run_id: str,
    session: SessionDep,
    filters: FiltersDep,
) -> SampleCount:
    """How many rollout rows match the same filters as `GET /runs/{id}/samples` (its total, for "100 of 2,345
    rows"), counted up to 100,000: beyond that `capped` is true and `count` is the cap."""
    run = get_run_or_404(session, run_id)
    check_reward_names(run.config, "step", filters.reward_name)
    count, capped = queries.count_samples(session, run_id, filters)
    return SampleCount(count=count, capped=capped, cap=queries.COUNT_CAP)


def check_reward_names(config: dict | None, sort: str, reward_name: str | None) -> None:
    """A 422 naming the parameter when ``sort=reward.<name>`` or ``reward_name`` is not a reward of the run."""
    known = queries.reward_names(config)
    listed = ", ".join(known) if known else "none"
    errors = []
    name = sort.lstrip("-+")
    if name.startswith(queries.REWARD_SORT_PREFIX) and name[len(queries.REWARD_SORT_PREFIX) :] not in known:
        errors.append({"path": "query.sort", "message": f"no reward function {name[7:]!r} in this run (its rewards: "
                       f"{listed}): sort by reward.<function> with one of them"})  # fmt: skip
    if reward_name is not None and reward_name not in known:
        errors.append({"path": "query.reward_name", "message": f"no reward function {reward_name!r} in this run "
                       f"(its rewards: {listed})"})  # fmt: skip
    if errors:
        raise HTTPException(422, errors)


SAMPLE_COLUMNS = [
    "run_id", "step", "group", "index", "prompt", "completion", "images", "rewards", "reward", "advantage",
    "completion_length", "truncated", "num_images", "group_mean", "group_std", "zero_std", "dataset_row", "columns",
    "split", "trajectory", "tool_calls", "tool_errors", "turns",
]  # fmt: skip


def _sample_records(engine: Engine, run_id: str, split: str):
    for row, shas in queries.iter_samples(engine, run_id, split):  # a short session per batch
        yield {
            "run_id": row.run_id,
            "step": row.step,
            "group": row.group,
            "index": row.index,
            "prompt": row.prompt,
            "completion": row.completion,
            "images": shas,
            "rewards": row.rewards,
            "reward": row.reward,
            "advantage": row.advantage,
            "completion_length": row.completion_length,
            "truncated": row.truncated,
            "num_images": row.num_images,
            "group_mean": row.group_mean,
            "group_std": row.group_std,
            "zero_std": row.zero_std,
            "dataset_row": row.dataset_row,
            "columns": row.columns or {},  # the dataset row's scalar columns (JSON text in CSV and Parquet)
            "split": row.split,
            # a multi-turn rollout's turns, images by SHA-256 as above (JSON text in CSV and Parquet); [] without tools
            "trajectory": row.trajectory or [],
            "tool_calls": row.tool_calls,
            "tool_errors": row.tool_errors,
            "turns": row.turns,
        }


def _metric_records(engine: Engine, run_id: str):
    for step, key, value in queries.iter_metrics(engine, run_id):  # a short session per batch
        yield {"run_id": run_id, "step": step, "key": key, "value": value}


# a spreadsheet runs a cell that starts with one of these as a formula (CSV injection): OWASP's advice is to
# prefix a single quote, which spreadsheets show as text
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    if isinstance(value, dict | list):
        value = json.dumps(value)
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def _csv(records, columns):
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    yield buf.getvalue()
    for record in records:
        buf.seek(0)
        buf.truncate()
        writer.writerow({k: csv_cell(v) for k, v in record.items()})
        yield buf.getvalue()


def _jsonl(records):
    for record in records:
        yield json.dumps(record) + "\n"


def _parquet(records, what: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.SpooledTemporaryFile(max_size=64 * 2**20) as spool:
        writer = None
        batch: list[dict] = []

        def flush():
            nonlocal writer
            if not batch:
                return
            if what == "samples":
                for r in batch:  # nested JSON as text: stable columns whatever the prompts and rewards hold
                    r["prompt"] = json.dumps(r["prompt"])
                    r["rewards"] = json.dumps(r["rewards"])
                    r["columns"] = json.dumps(r["columns"])
                    r["trajectory"] = json.dumps(r["trajectory"])
            table = pa.Table.from_pylist(batch, schema=writer.schema if writer else None)
            if writer is None:
                writer = pq.ParquetWriter(spool, table.schema)
            writer.write_table(table)
            batch.clear()

        for record in records:
            batch.append(record)
            if len(batch) >= 5000:
                flush()
        flush()
        if writer is not None:
            writer.close()
        spool.seek(0)
        while chunk := spool.read(1 << 20):
            yield chunk


@router.get(
    "/runs/{run_id}/export",
    responses={
        404: {"description": "no such run"},
        422: {"model": ValidationErrorOut, "description": "a bad parameter (split with what=metrics)"},
        429: {"description": "too many exports at once; retry after the Retry-After header's seconds"},
        200: {"content": {"text/csv": {}, "application/x-ndjson": {}, "application/vnd.apache.parquet": {}}},
    },
)
def export(
    run_id: str,
    session: StreamSessionDep,  # closed when this returns: the stream reads in short sessions of its own
    engine: EngineDep,
    slots: ExportSlotsDep,
    settings: SettingsDep,
    what: Annotated[Literal["samples", "metrics"], Query()] = "samples",
    format: Annotated[Literal["csv", "jsonl", "parquet"], Query()] = "jsonl",
    split: Annotated[
        Split | None,
        Query(description="what=samples only: train (default) or eval, the held-out evaluation rollouts"),
    ] = None,
) -> StreamingResponse:
    """Download every sample of one split (images by SHA-256) or every metric of a run, streamed."""
    if split is not None and what != "samples":
        # metrics have no split (eval/* keys are metrics like the others): refused rather than ignored
        raise HTTPException(422, [{"path": "query.split", "message": "applies to what=samples only: the metrics "
                                   "export holds every key, eval/* included"}])  # fmt: skip
    split = split or "train"
    run_id = get_run_or_404(session, run_id).id
    release = hold_export_slot(slots, settings)
    try:
        records = _sample_records(engine, run_id, split) if what == "samples" else _metric_records(engine, run_id)
        columns = SAMPLE_COLUMNS if what == "samples" else ["run_id", "step", "key", "value"]
        filename = f"{run_id}-{'eval-' if split == 'eval' else ''}{what}.{format}"
        if format == "csv":
            body, media = _csv(records, columns), "text/csv"
        elif format == "jsonl":
            body, media = _jsonl(records), "application/x-ndjson"
        else:
            body, media = _parquet(records, what), "application/vnd.apache.parquet"
        return SlotStream(
            body, release, media_type=media, headers={"Content-Disposition": f'attachment; filename="{filename}"'}
        )
    except BaseException:
        release()
        raise
