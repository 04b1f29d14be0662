"""The rollout table: filtered, sorted, paginated samples, and exports of samples or metrics."""

from __future__ import annotations

import csv
import io
import json
import tempfile
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlmodel import Session

from ..auth import UNAUTHORIZED, require_token
from ..models import Image, Metric
from ..schemas import SamplePage
from ..store import queries
from .common import get_run_or_404, get_session, sample_out

INT_MAX = 2**31 - 1  # steps and counts are 32-bit integers in the store

router = APIRouter(tags=["samples"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)


def image_sizes(session: Session, shas: set[str]) -> dict[str, tuple[int, int]]:
    if not shas:
        return {}
    rows = session.execute(select(Image.sha256, Image.width, Image.height).where(Image.sha256.in_(list(shas))))
    return {sha: (w, h) for sha, w, h in rows}


@router.get("/runs/{run_id}/samples", response_model=SamplePage, responses={404: {"description": "no such run"}})
def list_samples(
    run_id: str,
    session: Annotated[Session, Depends(get_session)],
    step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    min_step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    max_step: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    advantage: Annotated[Literal["pos", "neg", "zero"] | None, Query()] = None,
    zero_std_groups: Annotated[
        bool | None, Query(description="true: only rows of zero-variance groups; false: none")
    ] = None,
    truncated: Annotated[bool | None, Query()] = None,
    min_images: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    max_images: Annotated[int | None, Query(ge=0, le=INT_MAX)] = None,
    q: Annotated[str | None, Query(max_length=200, description="text in the prompt or the completion")] = None,
    sort: Annotated[
        str,
        Query(
            pattern=r"^[-+]?(step|reward|advantage|completion_length|group|num_images|id)$",
            description="column, prefix - for descending: step, reward, advantage, completion_length, group, num_images, id",
        ),
    ] = "step",
    cursor: Annotated[str | None, Query(max_length=500)] = None,
    limit: Annotated[int, Query(ge=1, le=queries.PAGE_MAX)] = 50,
) -> SamplePage:
    get_run_or_404(session, run_id)
    filters = queries.SampleFilters(
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
    )
    try:
        rows, images, next_cursor = queries.query_samples(session, run_id, filters, sort, cursor, limit)
    except queries.BadCursor as exc:
        raise HTTPException(400, str(exc)) from exc
    sizes = image_sizes(session, {sha for shas in images.values() for sha in shas})
    return SamplePage(items=[sample_out(r, images[r.id], sizes) for r in rows], next_cursor=next_cursor)


SAMPLE_COLUMNS = [
    "run_id", "step", "group", "index", "prompt", "completion", "images", "rewards", "reward", "advantage",
    "completion_length", "truncated", "num_images", "group_mean", "group_std", "zero_std", "dataset_row",
]  # fmt: skip


def _sample_records(engine, run_id: str):
    with Session(engine) as session:
        for row, shas in queries.iter_samples(session, run_id):
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
            }


def _metric_records(engine, run_id: str):
    with Session(engine) as session:
        last = (-1, "")
        while True:
            rows = session.execute(
                select(Metric.step, Metric.key, Metric.value)
                .where(Metric.run_id == run_id)
                .where((Metric.step > last[0]) | ((Metric.step == last[0]) & (Metric.key > last[1])))
                .order_by(Metric.step, Metric.key)
                .limit(5000)
            ).all()
            if not rows:
                return
            for step, key, value in rows:
                yield {"run_id": run_id, "step": step, "key": key, "value": value}
            last = (rows[-1][0], rows[-1][1])


def _csv(records, columns):
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    yield buf.getvalue()
    for record in records:
        buf.seek(0)
        buf.truncate()
        writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in record.items()})
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
        200: {"content": {"text/csv": {}, "application/x-ndjson": {}, "application/vnd.apache.parquet": {}}},
    },
)
def export(
    run_id: str,
    request: Request,
    session: Annotated[Session, Depends(get_session)],
    what: Annotated[Literal["samples", "metrics"], Query()] = "samples",
    format: Annotated[Literal["csv", "jsonl", "parquet"], Query()] = "jsonl",
) -> StreamingResponse:
    """Download every sample (images by SHA-256) or every metric of a run, streamed."""
    run = get_run_or_404(session, run_id)
    engine = request.app.state.engine
    records = _sample_records(engine, run.id) if what == "samples" else _metric_records(engine, run.id)
    columns = SAMPLE_COLUMNS if what == "samples" else ["run_id", "step", "key", "value"]
    filename = f"{run.id}-{what}.{format}"
    if format == "csv":
        body, media = _csv(records, columns), "text/csv"
    elif format == "jsonl":
        body, media = _jsonl(records), "application/x-ndjson"
    else:
        body, media = _parquet(records, what), "application/vnd.apache.parquet"
    return StreamingResponse(
        body, media_type=media, headers={"Content-Disposition": f'attachment; filename="{filename}"'}
    )
