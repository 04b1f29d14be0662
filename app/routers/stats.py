"""Statistics over the rollout table: per-step histograms (completion length, reward, advantage, images)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel, Field

from ..auth import UNAUTHORIZED, require_token
from ..deps import SessionDep
from ..schemas import ErrorOut, ValidationErrorOut
from ..store import queries
from .common import get_run_or_404

INT_MAX = 2**31 - 1  # steps are 32-bit integers in the store
BINS_MAX = 200

router = APIRouter(tags=["stats"], dependencies=[Depends(require_token)], responses=UNAUTHORIZED)

HistogramField = Literal["completion_length", "reward", "advantage", "num_images"]
# integer columns get bins of whole units (edges on integers); the others equal-width bins between min and max
INTEGER_FIELDS = {"completion_length", "num_images"}


class Histogram(BaseModel):
    run_id: str
    field: str
    split: str = Field(description="train or eval: whose rollout rows were counted")
    step: int | None = Field(description="the step counted (the latest step with rollout rows if none was asked)")
    steps: list[int] = Field(description="every step of the run that has rollout rows of this split, ascending")
    edges: list[float] = Field(
        description="bin edges, len(counts) + 1; bin i is [edges[i], edges[i+1]), the last one closed"
    )
    counts: list[int]
    total: int = Field(description="rollout rows at this step")
    missing: int = Field(description="rows without a value (an unscorable reward): in total, in no bin")
    min: float | None
    max: float | None
    mean: float | None


def _bad(path: str, message: str) -> HTTPException:
    return HTTPException(422, [{"path": path, "message": message}])


def bin_values(values: list[float], bins: int, integer: bool) -> tuple[list[float], list[int]]:
    """Edges and counts of ``values`` in at most ``bins`` bins. Integer data gets bins of a whole number of units
    with integer edges (``[3, 4)`` holds the 3s), so a narrow range never shows empty fractional bins; a constant
    gets one bin around it."""
    if not values:
        return [], []
    lo, hi = min(values), max(values)
    if integer:
        start, span = math.floor(lo), math.floor(hi) - math.floor(lo) + 1
        unit = max(1, math.ceil(span / bins))  # whole units per bin
        n = math.ceil(span / unit)
        edges = [float(start + i * unit) for i in range(n + 1)]
        counts = [0] * n
        for v in values:
            counts[min(n - 1, int((math.floor(v) - start) // unit))] += 1
        return edges, counts
    if lo == hi:
        half = max(abs(lo) * 0.1, 0.5)
        return [lo - half, hi + half], [len(values)]
    width = (hi - lo) / bins
    edges = [lo + i * width for i in range(bins)] + [hi]
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    return edges, counts


@router.get(
    "/runs/{run_id}/histogram",
    response_model=Histogram,
    responses={
        404: {"model": ErrorOut, "description": "no such run"},
        422: {"model": ValidationErrorOut, "description": "a bad parameter, or a step without rollout rows"},
    },
)
def histogram(
    run_id: str,
    session: SessionDep,
    field: Annotated[
        HistogramField, Query(description="the rollout column: completion_length, reward, advantage or num_images")
    ] = "completion_length",
    step: Annotated[
        int | None, Query(ge=0, le=INT_MAX, description="the training step; the latest with rollout rows if absent")
    ] = None,
    bins: Annotated[
        int, Query(ge=1, le=BINS_MAX, description="number of bins (integer columns: at most this many, whole units)")
    ] = 20,
    split: Annotated[
        Literal["train", "eval"],
        Query(description="train: the rollouts trained on (default); eval: the held-out evaluation rollouts"),
    ] = "train",
) -> Histogram:
    """A histogram of one rollout column at one step, with the steps that have rollout rows (for a step picker),
    of one split: training rollouts, or evaluation rollouts (their steps are the evaluated steps)."""
    get_run_or_404(session, run_id)
    steps = queries.sample_steps(session, run_id, split)
    if step is None:
        if not steps:
            return Histogram(
                run_id=run_id, field=field, split=split, step=None, steps=[], edges=[], counts=[], total=0, missing=0,
                min=None, max=None, mean=None,
            )  # fmt: skip
        step = steps[-1]
    elif step not in steps:
        have = f"steps with rows: {steps[0]}..{steps[-1]} ({len(steps)} steps)" if steps else "the run has none yet"
        raise _bad("query.step", f"no rollout rows at step {step} ({have})")
    raw = queries.sample_values(session, run_id, split, field, step)
    values = [float(v) for v in raw if v is not None and math.isfinite(v)]
    edges, counts = bin_values(values, bins, field in INTEGER_FIELDS)
    return Histogram(
        run_id=run_id,
        field=field,
        split=split,
        step=step,
        steps=steps,
        edges=edges,
        counts=counts,
        total=len(raw),
        missing=len(raw) - len(values),
        min=min(values) if values else None,
        max=max(values) if values else None,
        mean=sum(values) / len(values) if values else None,
    )
