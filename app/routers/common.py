"""Helpers the routers share: run lookup, serialisation."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from sqlmodel import Session

from collage.app.store.tables import Run, Sample

from ..schemas import ImageRef, Progress, RunOut, SampleOut, TrajectoryImageRef, TrajectoryTurn
from ..store.queries import best_model_metric

API = "/api/v1"


def get_run_or_404(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id) if len(run_id) <= 32 else None
    if run is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    return run


def run_url(run_id: str) -> str:
    return f"{API}/runs/{run_id}"


def image_ref(sha: str, width: int, height: int) -> ImageRef:
    return ImageRef(
        sha256=sha,
        url=f"{API}/images/{sha}?size=full",
        thumb_url=f"{API}/images/{sha}?size=thumb",
        width=width,
        height=height,
    )


def trajectory_out(turns: list[dict[str, Any]] | None) -> list[TrajectoryTurn]:
    """A stored trajectory (its images by hash, with their sizes) as the API's turns, each image with its URLs."""
    out = []
    for turn in turns or []:
        images = [
            TrajectoryImageRef(
                **image_ref(im["sha256"], im["width"], im["height"]).model_dump(), source=im.get("source")
            )
            for im in turn.get("images") or []
        ]
        out.append(TrajectoryTurn(role=turn["role"], text=turn["text"], tool_call=turn.get("tool_call"), images=images,
                                  error=turn.get("error")))  # fmt: skip
    return out


def run_out(
    run: Run,
    tags: list[str],
    latest_reward: float | None = None,
    with_config: bool = False,
    creators: dict[int, str] | None = None,
) -> RunOut:
    return RunOut(
        id=run.id,
        name=run.name,
        algorithm=run.algorithm,
        status=run.status,
        tags=tags,
        model=run.model_path,
        dataset=run.dataset_source,
        progress=Progress(step=run.step, max_steps=run.max_steps),
        created_at=run.created_at,
        started_at=run.started_at,
        finished_at=run.finished_at,
        updated_at=run.updated_at,
        heartbeat_at=run.heartbeat_at,
        error=run.error,
        warning_count=run.warning_count,
        attempt=run.attempt,
        worker=run.worker,
        parent_id=run.parent_id,
        created_by=(creators or {}).get(run.created_by) if run.created_by is not None else None,
        latest_reward=latest_reward,
        seconds_per_step=run.seconds_per_step,
        url=run_url(run.id),
        config=run.config if with_config else None,
        notes=run.notes,
    )


def sample_out(sample: Sample, shas: list[str], sizes: dict[str, tuple[int, int]]) -> SampleOut:
    return SampleOut(
        id=sample.id,
        run_id=sample.run_id,
        step=sample.step,
        group=sample.group,
        index=sample.index,
        prompt=sample.prompt,
        completion=sample.completion,
        images=[image_ref(sha, *sizes.get(sha, (0, 0))) for sha in shas],
        rewards=sample.rewards,
        reward=sample.reward,
        advantage=sample.advantage,
        completion_length=sample.completion_length,
        truncated=sample.truncated,
        num_images=sample.num_images,
        group_mean=sample.group_mean,
        group_std=sample.group_std,
        zero_std=sample.zero_std,
        dataset_row=sample.dataset_row,
        split=sample.split,
        columns=sample.columns or {},
        trajectory=trajectory_out(sample.trajectory),
        tool_calls=sample.tool_calls,
        tool_errors=sample.tool_errors,
        turns=sample.turns,
    )


def set_best_model_metric(out: RunOut, ranked: dict[str, tuple[str, float | None, float | None]], run: Run) -> None:
    """The run's best-model metric on its answer (``ranked``: :func:`queries.best_model_metrics` of its page),
    named even before its first value: the runs table shows which metric is coming."""
    metric = best_model_metric(run.config)
    out.eval_metric = metric[0] if metric else None
    _, out.eval_metric_value, out.best_eval_metric = ranked.get(run.id, (None, None, None))
