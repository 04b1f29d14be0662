"""A run's checkpoints: the list with the best one marked, one picked by step, ``best`` or ``last``, and where its
files are.

The list comes from the store's ``checkpoints`` rows (a run the server ran) or from a ``collage train`` output folder
(``checkpoints/step-N/checkpoint.json``, ``config.yaml``); both go through the same rule for ``best``: the checkpoint
whose ``metric`` (the value of ``train.metric_for_best_model`` at its step) is best by ``greater_is_better``
(TRL's default: greater unless the metric's name ends in ``loss``), ties to the earlier step, as TRL keeps
``best_model_checkpoint``. A run without ``metric_for_best_model`` has no best checkpoint.

A checkpoint's path is data (a worker wrote it into the store): :func:`checkpoint_folder` resolves it and refuses it
unless it lies under ``COLLAGE_ARTIFACTS``. Torch-free: the web node, the workers and the CLI use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import select
from sqlmodel import Session, col

from collage.app.core.trust import confined
from collage.app.store.errors import StoreError
from collage.app.store.tables import Checkpoint, Run
from collage.training.config import TrainSettings
from collage.training.infra.objectstore import ObjectMirror, ensure_local_folder
from collage.training.retention import best_checkpoint

BEST, LAST = "best", "last"
StepChoice = int | Literal["best", "last"]
INT_MAX = 2**31 - 1  # steps are 32-bit integers in the store
STEP_TEXT = re.compile(r"^(\d{1,10}|best|last)\Z")
MODEL_FOLDER = "model"  # what a download or an export moves: the weights (or adapter) and the processor
SHARDS = "shards"  # a sharded checkpoint's torch.distributed.checkpoint files (training.sharded_checkpoint)
RUNS_FOLDER = "runs"  # artifacts/runs/<run id>/attempt-<n>/checkpoints/step-<N>/ (worker/child.py run_dir)
INFO_FILE = "checkpoint.json"  # training/checkpoint.py's INFO_FILE, read here without importing torch


class CheckpointProblem(StoreError, LookupError):
    """Why no checkpoint can be given; ``status`` is the HTTP answer (404 no such step, 409 nothing to pick)."""

    status = 409


class UnknownStep(CheckpointProblem):
    status = 404


class NoCheckpoint(CheckpointProblem):
    status = 409


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    path: str
    attempt: int | None = None
    bytes: int | None = None
    created_at: datetime | None = None
    kind: str | None = None  # "adapter" | "full"; None for a checkpoint recorded before migration 0007
    metric: float | None = None
    best: bool = False


@dataclass(frozen=True)
class BestRule:
    """Which checkpoint is best: ``metric`` (None: the run has no best checkpoint), greater or smaller wins."""

    metric: str | None
    greater: bool

    @classmethod
    def of_config(cls, config: Mapping[str, Any]) -> BestRule:
        """From a run config (the store's JSON, or a parsed ``config.yaml``); the ``greater_is_better`` default is
        the config's own (``TrainSettings.best_is_greater``)."""
        train = config.get("train") if isinstance(config, Mapping) else None
        if not isinstance(train, Mapping):
            return cls(None, True)
        known = {k: v for k, v in train.items() if k in ("metric_for_best_model", "greater_is_better")}
        settings = TrainSettings.model_construct(**known)  # stored configs were validated when they were stored
        return cls(settings.metric_for_best_model, settings.best_is_greater)


def mark_best(entries: Sequence[CheckpointEntry], rule: BestRule) -> list[CheckpointEntry]:
    """The entries in step order, ``best`` set on the best one (on none without a rule or a value)."""
    ordered = sorted(entries, key=lambda e: e.step)
    winner = best_checkpoint([(e.step, e.metric) for e in ordered], rule.greater) if rule.metric else None
    return [replace(e, best=e.step == winner) for e in ordered]


def _aware(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=timezone.utc) if value is not None and value.tzinfo is None else value


def run_checkpoints(session: Session, run: Run) -> list[CheckpointEntry]:
    """The checkpoints the store records for ``run``, in step order, the best one marked."""
    rows = session.scalars(select(Checkpoint).where(col(Checkpoint.run_id) == run.id).order_by(col(Checkpoint.step)))
    entries = [
        CheckpointEntry(
            step=c.step,
            path=c.path,
            attempt=c.attempt,
            bytes=c.bytes,
            created_at=_aware(c.created_at),
            kind=c.kind,
            metric=c.metric,
        )
        for c in rows
    ]
    return mark_best(entries, BestRule.of_config(run.config))


def folder_checkpoints(out: Path) -> tuple[list[CheckpointEntry], BestRule]:
    """The checkpoints of a ``collage train`` output folder (``checkpoints/step-N/``, their ``checkpoint.json``)
    and its best rule (``config.yaml``), in step order, the best one marked."""
    import yaml

    try:
        config = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    rule = BestRule.of_config(config if isinstance(config, dict) else {})
    entries = []
    folder = out / "checkpoints"
    for child in sorted(folder.iterdir()) if folder.is_dir() else []:
        match = re.fullmatch(r"step-(\d+)", child.name)
        if not match or not (child / MODEL_FOLDER).is_dir():
            continue  # a ".tmp" folder of a checkpoint being written, or a half-deleted one
        info = _read_info(child)
        metric = info.get("metric_value")
        entries.append(
            CheckpointEntry(
                step=int(match.group(1)),
                path=str(child),
                bytes=info.get("bytes") if isinstance(info.get("bytes"), int) else None,
                created_at=datetime.fromtimestamp(child.stat().st_mtime, timezone.utc),
                kind=info.get("kind") if info.get("kind") in ("adapter", "full") else None,
                metric=float(metric) if isinstance(metric, (int, float)) and not isinstance(metric, bool) else None,
            )
        )
    return mark_best(entries, rule), rule


def _read_info(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def parse_step(text: str) -> StepChoice:
    """``N``, ``best`` or ``last``; ValueError naming what is allowed otherwise."""
    if not STEP_TEXT.match(text) or (text.isdigit() and int(text) > INT_MAX):
        raise ValueError(f"must be a step number (0..{INT_MAX}), best or last; got {text[:40]!r}")
    return text if text in (BEST, LAST) else int(text)  # type: ignore[return-value]


def describe_steps(entries: Sequence[CheckpointEntry]) -> str:
    steps = [e.step for e in entries]
    if not steps:
        return "it has none yet"
    shown = ", ".join(str(s) for s in steps[:20]) + (f", ... ({len(steps)} in all)" if len(steps) > 20 else "")
    return f"its checkpoints are at steps {shown}"


def pick(entries: Sequence[CheckpointEntry], asked: StepChoice, rule: BestRule, run: str) -> CheckpointEntry:
    """The checkpoint ``asked`` for (a step, ``best`` or ``last``) among ``entries`` (step order, best marked).

    :class:`UnknownStep` (404) for a step without a checkpoint; :class:`NoCheckpoint` (409) for ``best`` or ``last``
    of a run without checkpoints, ``best`` of a run without ``train.metric_for_best_model`` or whose checkpoints
    have no value of it yet."""
    if isinstance(asked, int):
        found = next((e for e in entries if e.step == asked), None)
        if found is None:
            raise UnknownStep(f"{run} has no checkpoint at step {asked}: {describe_steps(entries)}")
        return found
    if not entries:
        raise NoCheckpoint(
            f"{run} has no checkpoint yet (one is written every train.save_steps steps and when training ends)"
        )
    if asked == LAST:
        return entries[-1]
    if rule.metric is None:
        raise NoCheckpoint(
            f"{run} has no train.metric_for_best_model, so no checkpoint is the best: ask for a step or last "
            f"({describe_steps(entries)})"
        )
    best = next((e for e in entries if e.best), None)
    if best is None:
        raise NoCheckpoint(f"no checkpoint of {run} has a value of {rule.metric} yet: ask for a step or last")
    return best


def checkpoint_folder(path: str, artifacts: Path, run_id: str) -> Path | None:
    """The checkpoint folder ``path`` (from the store) resolved (``..``, links), or None unless it lies inside the
    run's own folder ``artifacts/runs/<run_id>/`` (where its attempts write, worker/child.py): a path a confused or
    compromised writer recorded (``/``, another run's folder, the artifacts' root) is never read.

    With object storage the path is relative to the artifacts (each host caches the bucket in its own folder): it is
    resolved under this host's ``artifacts``, and may not be on this host yet (:func:`local_checkpoint` fetches it)."""
    if not path or "\x00" in path:
        return None
    if not Path(path).is_absolute():
        path = str(Path(artifacts) / path)
    own = Path(artifacts) / RUNS_FOLDER / run_id
    folder = confined(path, [own])
    if folder is None or folder == own.expanduser().resolve():
        return None
    return folder


def local_checkpoint(folder: Path, artifacts: Path, mirror: ObjectMirror | None) -> bool:
    """Make sure the checkpoint ``folder`` (from :func:`checkpoint_folder`) is on this host: with object storage a
    host that does not have it downloads it whole from the bucket (checked against its manifest). False when it is
    neither here nor in the bucket (removed by ``train.save_total_limit``, or the run deleted)."""
    return ensure_local_folder(Path(artifacts), folder, mirror)
