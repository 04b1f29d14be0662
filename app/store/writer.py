"""The write side of the run store, used by the API and by workers.

Every method is one transaction. ``append_samples`` writes a whole step (rows, their images, the links) at
once and replaces what an earlier delivery of the same step wrote, so retries never duplicate rows;
``append_metrics`` upserts, so re-writing a step's metrics is idempotent too.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.models import table_of

from ..db import session_scope
from ..models import (
    ENDED,
    Checkpoint,
    Event,
    Image,
    Metric,
    MetricRollup,
    Run,
    RunStatus,
    RunTag,
    Sample,
    SampleImage,
    utcnow,
)  # fmt: skip
from . import rollups
from .images import image_info, write_image
from .sql import dialect_insert

NULL_REWARD = -1e300  # reward_sort of unscorable rows: below any real reward


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def _clean(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


@dataclass
class ImageIn:
    png: bytes
    sha256: str | None = None


@dataclass
class SampleIn:
    """A rollout row as the writer takes it (the trainer's ``RolloutRow`` fits by attribute names)."""

    group: int
    index: int
    prompt: Any
    completion: str
    images: Sequence[ImageIn]
    rewards: Mapping[str, float | None]
    reward: float | None
    advantage: float
    completion_length: int
    truncated: bool
    group_mean: float | None = None
    group_std: float | None = None
    dataset_row: int | None = None


def prompt_text(prompt: Any) -> str:
    """Plain text of a prompt, for search."""
    if isinstance(prompt, str):
        return prompt
    parts = []
    for message in prompt or []:
        content = message.get("content", "") if isinstance(message, dict) else ""
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return " ".join(parts)


class StoreWriter:
    def __init__(self, engine: Engine, artifacts: Path):
        self.engine = engine
        self.artifacts = Path(artifacts)

    # ----------------------------------------------------------------- runs
    def create_run(self, config: Mapping[str, Any], parent_id: str | None = None, run_id: str | None = None) -> Run:
        run = Run(
            id=run_id or new_run_id(),
            name=config["name"],
            algorithm=config["algorithm"],
            config=dict(config),
            status=RunStatus.QUEUED,
            step=0,
            max_steps=config["train"]["max_steps"],
            model_path=config["model"]["path"],
            dataset_source=config["dataset"]["source"],
            parent_id=parent_id,
        )
        with session_scope(self.engine) as session:
            session.add(run)
            session.flush()
            for tag in dict.fromkeys(config.get("tags") or []):
                session.add(RunTag(run_id=run.id, tag=tag))
            session.add(Event(run_id=run.id, level="info", message="queued"))
        return run

    def set_status(
        self,
        run_id: str,
        status: RunStatus,
        error: str | None = None,
        worker: str | None = None,
        message: str | None = None,
    ) -> None:
        now = utcnow()
        values: dict[str, Any] = {"status": status, "updated_at": now}
        if status == RunStatus.RUNNING:
            values["started_at"] = now
            values["heartbeat_at"] = now
        if status in ENDED:
            values["finished_at"] = now
        if error is not None:
            values["error"] = error
        with session_scope(self.engine) as session:
            session.execute(update(Run).where(col(Run.id) == run_id).values(**values))
            level = "error" if status == RunStatus.FAILED else "info"
            session.add(Event(run_id=run_id, level=level, message=message or f"status: {status}"))

    def set_progress(self, run_id: str, step: int) -> None:
        """The training process reached ``step`` (a beat of its heartbeat too)."""
        now = utcnow()
        with session_scope(self.engine) as session:
            session.execute(
                update(Run).where(col(Run.id) == run_id).values(step=step, updated_at=now, heartbeat_at=now)
            )

    def begin_attempt(self, run_id: str, resumed_from_step: int, max_steps: int) -> None:
        """A training process starts (or resumes) the run at ``resumed_from_step``: whatever an earlier attempt
        wrote after that step is removed, so this attempt rewrites it (metrics, rollups, rows, checkpoints)."""
        with session_scope(self.engine) as session:
            ids = select(col(Sample.id)).where(col(Sample.run_id) == run_id, col(Sample.step) > resumed_from_step)
            session.execute(delete(SampleImage).where(col(SampleImage.sample_id).in_(ids)))
            session.execute(delete(Sample).where(col(Sample.run_id) == run_id, col(Sample.step) > resumed_from_step))
            rollups.truncate(session, run_id, resumed_from_step)
            session.execute(
                delete(Checkpoint).where(col(Checkpoint.run_id) == run_id, col(Checkpoint.step) > resumed_from_step)
            )
            session.execute(
                update(Run).where(col(Run.id) == run_id).values(step=resumed_from_step, max_steps=max_steps)
            )

    def run_status(self, run_id: str) -> str | None:
        """The run's status now (``None``: the run was deleted)."""
        with Session(self.engine) as session:
            return session.execute(select(col(Run.status)).where(col(Run.id) == run_id)).scalar_one_or_none()

    def heartbeat(self, run_id: str) -> None:
        with session_scope(self.engine) as session:
            session.execute(update(Run).where(col(Run.id) == run_id).values(heartbeat_at=utcnow()))

    # --------------------------------------------------------------- events
    def add_event(self, run_id: str, level: str, message: str) -> None:
        with session_scope(self.engine) as session:
            session.add(Event(run_id=run_id, level=level, message=message))
            if level == "warning":
                session.execute(update(Run).where(col(Run.id) == run_id).values(warning_count=Run.warning_count + 1))

    # -------------------------------------------------------------- metrics
    def append_metrics(self, run_id: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Upsert one step's metrics and fold them into the per-bucket rollups, in one transaction."""
        values = {k: _clean(v) for k, v in metrics.items()}
        if not values:
            return
        rows = [{"run_id": run_id, "key": k, "step": step, "value": v} for k, v in values.items()]
        with session_scope(self.engine) as session:
            before = dict(
                session.execute(
                    select(col(Metric.key), col(Metric.value)).where(
                        col(Metric.run_id) == run_id, col(Metric.step) == step, col(Metric.key).in_(list(values))
                    )
                ).all()
            )
            stmt = dialect_insert(session, table_of(Metric))
            stmt = stmt.on_conflict_do_update(
                index_elements=["run_id", "key", "step"], set_={"value": stmt.excluded.value}
            )
            session.execute(stmt, rows)
            # a rewrite with another value may remove a bucket's extreme: rebuild those buckets from the raw points
            changed = [k for k, v in values.items() if k in before and before[k] != v]
            fresh = {k: v for k, v in values.items() if k not in before and v is not None}
            rollups.add_points(session, run_id, step, fresh)
            rollups.recompute(session, run_id, changed, [step])

    # -------------------------------------------------------------- samples
    def append_samples(self, run_id: str, step: int, rows: Iterable[Any]) -> int:
        """Write one step's rollout rows with their images in one transaction; returns the row count."""
        rows = list(rows)
        images: dict[str, tuple[bytes, str]] = {}
        per_row: list[list[str]] = []
        for row in rows:
            shas = []
            for image in row.images:
                sha, rel = write_image(self.artifacts, image.png, getattr(image, "sha256", None))
                images.setdefault(sha, (image.png, rel))
                shas.append(sha)
            per_row.append(shas)
        image_rows = []
        for sha, (png, rel) in images.items():
            width, height, fmt = image_info(png)
            image_rows.append(
                {"sha256": sha, "width": width, "height": height, "format": fmt, "size_bytes": len(png), "path": rel,
                 "created_at": utcnow()}
            )  # fmt: skip
        sample_rows = []
        for row, shas in zip(rows, per_row, strict=True):
            reward = _clean(row.reward)
            std = _clean(row.group_std)
            sample_rows.append(
                {
                    "run_id": run_id,
                    "step": step,
                    "group": int(row.group),
                    "index": int(row.index),
                    "prompt": row.prompt,
                    "prompt_text": prompt_text(row.prompt),
                    "completion": row.completion,
                    "rewards": {k: _clean(v) for k, v in row.rewards.items()},
                    "reward": reward,
                    "reward_sort": NULL_REWARD if reward is None else reward,
                    "advantage": _clean(row.advantage) or 0.0,
                    "completion_length": int(row.completion_length),
                    "truncated": bool(row.truncated),
                    "num_images": len(shas),
                    "group_mean": _clean(row.group_mean),
                    "group_std": std,
                    "zero_std": std is not None and abs(std) < 1e-8,
                    "dataset_row": getattr(row, "dataset_row", getattr(row, "row", None)),
                }
            )
        with session_scope(self.engine) as session:
            if image_rows:
                stmt = dialect_insert(session, table_of(Image)).on_conflict_do_nothing(index_elements=["sha256"])
                session.execute(stmt, image_rows)
            # a redelivered step replaces what the earlier delivery wrote
            session.execute(delete(Sample).where(col(Sample.run_id) == run_id, col(Sample.step) == step))
            if sample_rows:
                result = session.execute(
                    insert(table_of(Sample)).returning(table_of(Sample).c.id, sort_by_parameter_order=True), sample_rows
                )
                ids = [r[0] for r in result]
                links = [
                    {"sample_id": sid, "position": pos, "sha256": sha}
                    for sid, shas in zip(ids, per_row, strict=True)
                    for pos, sha in enumerate(shas)
                ]
                if links:
                    session.execute(insert(table_of(SampleImage)), links)
        return len(sample_rows)

    # ---------------------------------------------------------- checkpoints
    def add_checkpoint(self, run_id: str, step: int, path: str) -> None:
        with session_scope(self.engine) as session:
            stmt = dialect_insert(session, table_of(Checkpoint)).on_conflict_do_update(
                index_elements=["run_id", "step"], set_={"path": path}
            )
            session.execute(stmt, [{"run_id": run_id, "step": step, "path": path, "created_at": utcnow()}])

    def delete_run(self, run_id: str) -> None:
        with session_scope(self.engine) as session:
            # children first: SQLite enforces the cascades, but deleting explicitly keeps it one fast statement each
            sample_ids = select(col(Sample.id)).where(col(Sample.run_id) == run_id)
            session.execute(delete(SampleImage).where(col(SampleImage.sample_id).in_(sample_ids)))
            for table in (Sample, Metric, MetricRollup, Event, Checkpoint, RunTag):
                session.execute(delete(table).where(col(table.run_id) == run_id))
            session.execute(update(Run).where(col(Run.parent_id) == run_id).values(parent_id=None))
            session.execute(delete(Run).where(col(Run.id) == run_id))
