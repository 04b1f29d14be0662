"""The write side of the run store, used by the API and by workers.

Every method is one transaction. ``append_samples`` writes a whole step (rows, their images, the links) at
once and replaces what an earlier delivery of the same step wrote, so retries never duplicate rows;
``append_metrics`` upserts, so re-writing a step's metrics is idempotent too.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.store.engine import session_scope
from collage.app.store.errors import StoreError
from collage.app.store.tables import (
    ENDED,
    ApiToken,
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
    SampleToolImage,
    table_of,
    utcnow,
)  # fmt: skip
from collage.training.callbacks import scalar_columns
from collage.training.infra.objectstore import ObjectMirror

from . import rollups
from .faults import is_disk_full, retryable, store_disk_full
from .images import image_info, write_image
from .sql import changed_rows, dialect_insert
from .text import TRACEBACK_LEVEL, clean_json, clean_text, nul_note, split_traceback
from .tokens import audit

log = logging.getLogger("collage.store")
T = TypeVar("T")

NULL_REWARD = -1e300
_KEEP = (
    object()
)  # transition(): leave the run's error as it is  # reward_sort of unscorable rows: below any real reward


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
    # the dataset row's scalar columns besides the prompt and images; kept as training.callbacks.scalar_columns says
    columns: Mapping[str, Any] | None = None
    split: str = "train"  # or "eval": a held-out evaluation rollout
    # a multi-turn rollout's turns (training.callbacks.TrajectoryTurn fits: role, text, tool_call, images, sources,
    # error; an image needs only ``png``, and ``sha256`` when known); empty for a row without tools
    trajectory: Sequence[Any] = ()


SPLITS = ("train", "eval")


def _split_of(row: Any) -> str:
    split = getattr(row, "split", "train")
    if split not in SPLITS:  # the API types a row's split as one of these: a bad one must never reach the table
        raise ValueError(f"a rollout row's split must be one of {SPLITS}, got {split!r}")
    return split


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


NUL_METRIC = "store/nul_replaced"  # NUL characters of a step's rollout text stored as U+FFFD


def _first_nul_count(session: Session, run_id: str) -> bool:
    """Whether no step of the run has had NUL characters replaced yet (its first such step warns, once)."""
    found = session.execute(
        select(col(Metric.step)).where(col(Metric.run_id) == run_id, col(Metric.key) == NUL_METRIC).limit(1)
    ).first()
    return found is None


def _source(value: Any) -> dict[str, Any] | None:
    """A tool image's source as the contract has it, ``{"image": k, "bbox_2d": [x1, y1, x2, y2]}``; None for
    anything else (a box that is not four finite numbers, an index that is not a whole number >= 0): the row and
    the image are kept, the box is not drawn."""
    if not isinstance(value, Mapping):
        return None
    image, box = value.get("image"), value.get("bbox_2d")
    if not isinstance(image, int) or isinstance(image, bool) or image < 0 or not isinstance(box, Sequence):
        return None
    if len(box) != 4 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in box):
        return None
    if not all(math.isfinite(v) for v in box):
        return None
    return {"image": image, "bbox_2d": [v if isinstance(v, int) else float(v) for v in box]}


def _tool_call(value: Any) -> tuple[dict[str, Any] | None, int]:
    """A tool call as the contract has it, ``{"name", "arguments"}``, cleaned; a call that is not a mapping keeps
    its text as the name (shown, never lost)."""
    if value is None:
        return None, 0
    if not isinstance(value, Mapping):
        name, n = clean_text(str(value))
        return {"name": name, "arguments": None}, n
    name, n_name = clean_text(str(value.get("name", "")))
    arguments, n_arguments = clean_json(value.get("arguments"))
    return {"name": name, "arguments": arguments}, n_name + n_arguments


def _trajectory_json(
    row: Any, turn_shas: list[list[str]], sizes: Mapping[str, tuple[int, int]]
) -> tuple[list[dict[str, Any]], int]:
    """The contract's turns of a rollout row's trajectory (``turn_shas``: each turn's image hashes, as written; the
    width and height are the stored image's), cleaned, and how many NUL characters the cleaning replaced."""
    turns: list[dict[str, Any]] = []
    nuls = 0
    for turn, shas in zip(getattr(row, "trajectory", None) or (), turn_shas, strict=True):
        text, n = clean_text(str(getattr(turn, "text", "") or ""))
        nuls += n
        out: dict[str, Any] = {"role": str(getattr(turn, "role", "assistant")), "text": text}
        tool_call, n = _tool_call(getattr(turn, "tool_call", None))
        nuls += n
        if tool_call is not None:
            out["tool_call"] = tool_call
        if shas:
            sources = list(getattr(turn, "sources", None) or ())
            sources += [None] * (len(shas) - len(sources))
            images = []
            for sha, source in zip(shas, sources, strict=False):
                width, height = sizes[sha]
                image: dict[str, Any] = {"sha256": sha, "width": width, "height": height}
                if (found := _source(source)) is not None:
                    image["source"] = found
                images.append(image)
            out["images"] = images
        error = getattr(turn, "error", None)
        if error is not None:
            out["error"], n = clean_text(str(error))
            nuls += n
        turns.append(out)
    return turns, nuls


def trajectory_counts(turns: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The rollout table's counts of a trajectory: its tool calls (assistant turns that call a tool), the turns that
    report a tool error, and its turns."""
    return {
        "tool_calls": sum(1 for t in turns if t.get("role") == "assistant" and t.get("tool_call") is not None),
        "tool_errors": sum(1 for t in turns if t.get("error") is not None),
        "turns": len(turns),
    }


def _sample_row(
    run_id: str,
    step: int,
    row: Any,
    shas: list[str],
    turn_shas: list[list[str]] | None = None,
    sizes: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[dict[str, Any], int]:
    """The ``samples`` row of one rollout row, its text cleaned, and how many NUL characters the cleaning replaced
    (``turn_shas``: the hashes of its trajectory's images, turn by turn; ``sizes``: their width and height)."""
    reward = _clean(row.reward)
    std = _clean(row.group_std)
    prompt, n_prompt = clean_json(row.prompt)
    completion, n_completion = clean_text(row.completion)
    rewards, n_rewards = clean_json({k: _clean(v) for k, v in row.rewards.items()})
    columns, n_columns = clean_json(scalar_columns(getattr(row, "columns", None)))
    trajectory, n_trajectory = _trajectory_json(row, turn_shas or [], sizes or {})
    sample = {
        "run_id": run_id,
        "step": step,
        "group": int(row.group),
        "index": int(row.index),
        "prompt": prompt,
        "prompt_text": prompt_text(prompt),
        "completion": completion,
        "rewards": rewards,
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
        "columns": columns or None,
        "split": _split_of(row),
        "trajectory": trajectory or None,
        **trajectory_counts(trajectory),
    }
    return sample, n_prompt + n_completion + n_rewards + n_columns + n_trajectory


def _insert_samples(
    session: Session,
    sample_rows: list[dict[str, Any]],
    per_row: list[list[str]],
    per_turn: list[list[list[str]]] | None = None,
) -> None:
    """Insert the rows and the links to their images, in order (``sort_by_parameter_order``: the ids come back in
    the order the rows went in, so each row gets its own images), and the links to their trajectories' tool images
    (``per_turn``: each row's, turn by turn), numbered over the rollout after the row's own."""
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
    tool_links = [
        {"sample_id": sid, "position": len(shas) + pos, "sha256": sha}
        for sid, shas, turns in zip(ids, per_row, per_turn or [[] for _ in ids], strict=True)
        for pos, sha in enumerate(sha for turn in turns for sha in turn)
    ]
    if tool_links:
        session.execute(insert(table_of(SampleToolImage)), tool_links)


class StaleAttempt(StoreError):
    """A training process's attempt is no longer the run's current one (the run was reaped, resumed or
    deleted meanwhile): it must stop writing and exit."""


class StoreWriter:
    """Every write is one transaction, retried with back-off when the database connection drops (for
    ``retry_for`` seconds). ``for_attempt`` gives a writer whose every transaction first checks (and locks)
    that the run is still active under that attempt, or raises :class:`StaleAttempt` and writes nothing."""

    def __init__(self, engine: Engine, artifacts: Path, retry_for: float = 30.0, mirror: ObjectMirror | None = None):
        self.engine = engine
        self.artifacts = Path(artifacts)
        self.retry_for = retry_for
        self.mirror = mirror  # the artifacts' bucket: images are written there before their rows
        self.run_id: str | None = None
        self.attempt: int | None = None

    def for_attempt(self, run_id: str, attempt: int) -> StoreWriter:
        guarded = StoreWriter(self.engine, self.artifacts, self.retry_for, self.mirror)
        guarded.run_id, guarded.attempt = run_id, attempt
        return guarded

    def _guard(self, session: Session, run_id: str | None, **values: Any) -> None:
        """The transaction's one UPDATE of the run's row, last: the changes to the run (``values``: progress,
        heartbeat, counters) and, for an attempt writer, the check that the attempt is still current."""
        if self.attempt is None:
            if values and run_id is not None:
                session.execute(update(Run).where(col(Run.id) == run_id).values(**values))
            return
        alive = changed_rows(
            session,
            update(Run)
            .where(
                col(Run.id) == self.run_id,
                col(Run.attempt) == self.attempt,
                col(Run.status).in_([RunStatus.RUNNING, RunStatus.CANCELLING]),
            )
            .values(**{"updated_at": utcnow(), **values}),
        )
        if not alive:
            raise StaleAttempt(f"run {self.run_id}: attempt {self.attempt} is no longer current")

    def _write(self, work: Callable[[Session], T], run_id: str | None = None, **run_values: Any) -> T:
        deadline = time.monotonic() + self.retry_for
        delay = 0.05
        while True:
            try:
                with session_scope(self.engine) as session:
                    result = work(session)
                    # the guard comes last: it re-reads the run's newest committed row (so a reap or resume that
                    # committed meanwhile makes this whole transaction roll back) and holds the run's row lock only
                    # until the commit just after it, so a writer frozen mid-transaction never blocks the reaper
                    self._guard(session, run_id, **run_values)
                    return result
            except StaleAttempt:
                raise
            except Exception as exc:  # only a dropped connection is retried; anything else is re-raised
                if is_disk_full(exc):
                    raise store_disk_full(self.engine) from exc
                if not retryable(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("store write failed (%s): retrying in %.2fs", type(exc).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _unguarded(self) -> StoreWriter:
        return StoreWriter(self.engine, self.artifacts, self.retry_for, self.mirror)

    def atomically(self, work: Callable[[Session], T]) -> T:
        """``work(session)`` as one transaction, retried like a write; an exception it raises rolls it all back
        (a gang claim that finds a worker taken meanwhile, ``app.store.nodes``)."""
        return self._unguarded()._write(work)

    def read(self, work: Callable[[Session], T]) -> T:
        """``work(session)``, a read retried like a write: a connection that is refused or drops is tried again for
        ``retry_for`` seconds (the training process's reads at its start, which nothing else would retry)."""
        return self._unguarded()._write(work)

    # ----------------------------------------------------------------- runs
    def create_run(
        self,
        config: Mapping[str, Any],
        parent_id: str | None = None,
        run_id: str | None = None,
        created_by: ApiToken | None = None,
    ) -> Run:
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
            created_by=created_by.id if created_by is not None else None,
        )
        actor = created_by.name if created_by is not None else None
        with session_scope(self.engine) as session:
            session.add(run)
            session.flush()
            for tag in dict.fromkeys(config.get("tags") or []):
                session.add(RunTag(run_id=run.id, tag=tag))
            session.add(Event(run_id=run.id, level="info", message="queued", actor=actor))
        return run

    def transition(
        self,
        run_id: str,
        from_states: Iterable[RunStatus],
        to: RunStatus,
        *,
        when_attempt: int | None = None,
        error: str | None | object = _KEEP,
        message: str | None = None,
        actor: str | None = None,
        where: Sequence[Any] = (),
        **values: Any,
    ) -> bool:
        """The one way a run's status changes: ``from_states`` -> ``to`` in one conditional UPDATE (only if the
        run is in one of ``from_states``, under attempt ``when_attempt`` when given, and matches ``where``), with
        its event.
        Returns whether this call made the change; a caller that lost a race gets ``False`` and writes nothing.
        """
        now = utcnow()
        changes: dict[str, Any] = {"status": to, "updated_at": now, **values}
        if to == RunStatus.RUNNING:
            changes.setdefault("started_at", now)
            changes.setdefault("heartbeat_at", now)
        if to in ENDED:
            changes["finished_at"] = now
        detail = None
        if isinstance(error, str):  # everyone sees the error without its traceback; that is an admin-only event
            error, detail = split_traceback(clean_text(error)[0])
        if error is not _KEEP:
            changes["error"] = error  # None clears it (a resumed run)
        conditions = [col(Run.id) == run_id, col(Run.status).in_(list(from_states)), *where]
        if when_attempt is not None:
            conditions.append(col(Run.attempt) == when_attempt)
        text = clean_text(message)[0] if message else f"status: {to}"

        def write(session: Session) -> bool:
            if changed_rows(session, update(Run).where(*conditions).values(**changes)) != 1:
                return False
            level = "error" if to == RunStatus.FAILED else "info"
            session.add(Event(run_id=run_id, level=level, message=text, actor=actor))
            if detail is not None:
                session.add(Event(run_id=run_id, level=TRACEBACK_LEVEL, message=detail, actor=actor))
            return True

        return self._unguarded()._write(write)

    def set_progress(self, run_id: str, step: int, seconds_per_step: float | None = None) -> None:
        """The training process reached ``step`` (a beat of its heartbeat too), its recent steps taking
        ``seconds_per_step`` each (None: not measured, the last value stays)."""
        now = utcnow()
        timing = {} if seconds_per_step is None or not math.isfinite(seconds_per_step) else {
            "seconds_per_step": seconds_per_step}  # fmt: skip
        self._write(lambda session: None, run_id, step=step, updated_at=now, heartbeat_at=now, **timing)

    def begin_attempt(self, run_id: str, resumed_from_step: int, max_steps: int) -> None:
        """A training process starts (or resumes) the run at ``resumed_from_step``: whatever an earlier attempt
        wrote after that step is removed, so this attempt rewrites it (metrics, rollups, rows, checkpoints)."""

        def write(session: Session) -> None:
            ids = select(col(Sample.id)).where(col(Sample.run_id) == run_id, col(Sample.step) > resumed_from_step)
            session.execute(delete(SampleImage).where(col(SampleImage.sample_id).in_(ids)))
            session.execute(delete(SampleToolImage).where(col(SampleToolImage.sample_id).in_(ids)))
            session.execute(delete(Sample).where(col(Sample.run_id) == run_id, col(Sample.step) > resumed_from_step))
            rollups.truncate(session, run_id, resumed_from_step)
            session.execute(
                delete(Checkpoint).where(col(Checkpoint.run_id) == run_id, col(Checkpoint.step) > resumed_from_step)
            )

        # an earlier attempt's step time says nothing of this one's (another host, a cold cache): estimating again
        self._write(write, run_id, step=resumed_from_step, max_steps=max_steps, seconds_per_step=None)

    def run_state(self, run_id: str) -> tuple[str, int] | None:
        """The run's (status, attempt) now; ``None``: the run was deleted. Retried like a write."""

        def read(session: Session) -> tuple[str, int] | None:
            row = session.execute(select(col(Run.status), col(Run.attempt)).where(col(Run.id) == run_id)).one_or_none()
            return (row[0], row[1]) if row is not None else None

        return self._unguarded()._write(read)

    def run_status(self, run_id: str) -> str | None:
        """The run's status now (``None``: the run was deleted)."""
        state = self.run_state(run_id)
        return state[0] if state is not None else None

    def latest_checkpoint(self, run_id: str) -> str | None:
        """The path of the run's newest checkpoint written by a then-current attempt."""

        def read(session: Session) -> str | None:
            return session.scalars(
                select(col(Checkpoint.path))
                .where(col(Checkpoint.run_id) == run_id)
                .order_by(col(Checkpoint.step).desc())
            ).first()

        return self._unguarded()._write(read)

    def checkpoint_paths(self, run_id: str) -> list[tuple[int, str]]:
        """Every checkpoint the store records for the run, ``(step, path)``, oldest first."""

        def read(session: Session) -> list[tuple[int, str]]:
            rows = session.execute(
                select(col(Checkpoint.step), col(Checkpoint.path))
                .where(col(Checkpoint.run_id) == run_id)
                .order_by(col(Checkpoint.step))
            ).all()
            return [(int(step), str(path)) for step, path in rows]

        return self._unguarded()._write(read)

    def heartbeat(self, run_id: str) -> None:
        self._write(lambda session: None, run_id, heartbeat_at=utcnow())

    # --------------------------------------------------------------- events
    def add_event(self, run_id: str, level: str, message: str, actor: str | None = None) -> None:
        """One event. A message that holds a Python traceback (a training error's) is stored twice: without the
        traceback at ``level``, for everyone, and whole at :data:`TRACEBACK_LEVEL`, which only admins read."""
        message, nuls = clean_text(message)
        events = [(level, message)]
        if level != TRACEBACK_LEVEL:
            public, detail = split_traceback(message)
            if detail is not None:
                events = [(level, public), (TRACEBACK_LEVEL, detail)]
        if nuls:
            events[0] = (events[0][0], f"{events[0][1]} [{nul_note(nuls, 'this message')}]")

        def write(session: Session) -> None:
            for event_level, text in events:
                session.add(Event(run_id=run_id, level=event_level, message=text, actor=actor))

        counted = {"warning_count": Run.warning_count + 1} if level == "warning" else {}
        self._write(write, run_id, **counted)

    # -------------------------------------------------------------- metrics
    def append_metrics(self, run_id: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Upsert one step's metrics and fold them into the per-bucket rollups, in one transaction."""
        values: dict[str, float | None] = {}
        nuls = 0
        for key, value in metrics.items():
            key, n = clean_text(key)
            values[key], nuls = _clean(value), nuls + n
        if not values:
            return
        rows = [{"run_id": run_id, "key": k, "step": step, "value": v} for k, v in values.items()]
        note = f"step {step}: {nul_note(nuls, 'metric names')}" if nuls else None

        def write(session: Session) -> None:
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
            if note is not None:
                session.add(Event(run_id=run_id, level="warning", message=note))

        self._write(write, run_id, **({"warning_count": Run.warning_count + 1} if note is not None else {}))

    # -------------------------------------------------------------- samples
    def append_samples(self, run_id: str, step: int, rows: Iterable[Any]) -> int:
        """Write one step's rollout rows with their images in one transaction; returns the row count."""
        rows = list(rows)
        image_rows, per_row, per_turn = self._store_images(rows)
        sizes = {im["sha256"]: (im["width"], im["height"]) for im in image_rows}
        sample_rows = []
        nuls = 0  # NUL characters replaced in this step's text (completions, prompts, columns, reward names, turns)
        for row, shas, turn_shas in zip(rows, per_row, per_turn, strict=True):
            sample, n = _sample_row(run_id, step, row, shas, turn_shas, sizes)
            sample_rows.append(sample)
            nuls += n
        splits = sorted({row["split"] for row in sample_rows})

        def write(session: Session) -> None:
            if image_rows:
                stmt = dialect_insert(session, table_of(Image)).on_conflict_do_nothing(index_elements=["sha256"])
                session.execute(stmt, image_rows)
            # a redelivered step replaces what the earlier delivery wrote, in the splits it writes (a step's eval
            # rows come in a call of their own and never replace its training rows, nor the other way round)
            session.execute(
                delete(Sample).where(
                    col(Sample.run_id) == run_id, col(Sample.step) == step, col(Sample.split).in_(splits or ["train"])
                )
            )
            if sample_rows:
                _insert_samples(session, sample_rows, per_row, per_turn)
            if nuls and _first_nul_count(
                session, run_id
            ):  # once per run: later steps' counts are the metric, not more warnings
                note = (f"step {step}: {nul_note(nuls, 'rollout text')}; each step's count is the metric "
                        f"{NUL_METRIC}, without another warning")  # fmt: skip
                session.add(Event(run_id=run_id, level="warning", message=note))
                session.execute(update(Run).where(col(Run.id) == run_id).values(warning_count=Run.warning_count + 1))

        self._write(write, run_id)
        if nuls:
            self.append_metrics(run_id, step, {NUL_METRIC: float(nuls)})
        return len(sample_rows)

    def _store_images(self, rows: list[Any]) -> tuple[list[dict[str, Any]], list[list[str]], list[list[list[str]]]]:
        """Write the rows' images and their trajectories' (tool) images under the artifacts (before the transaction:
        a file is never half there), each distinct image once, and return the ``images`` rows of the distinct ones,
        each row's hashes in order, and each row's trajectory images' hashes, turn by turn."""
        images: dict[str, tuple[bytes, str]] = {}

        def store(image: Any) -> str:
            sha, rel = write_image(self.artifacts, image.png, getattr(image, "sha256", None), self.mirror)
            images.setdefault(sha, (image.png, rel))
            return sha

        per_row: list[list[str]] = []
        per_turn: list[list[list[str]]] = []
        for row in rows:
            per_row.append([store(image) for image in row.images])
            turns = getattr(row, "trajectory", None) or ()
            per_turn.append([[store(image) for image in (getattr(turn, "images", None) or ())] for turn in turns])
        image_rows = []
        for sha, (png, rel) in images.items():
            width, height, fmt = image_info(png)
            image_rows.append(
                {"sha256": sha, "width": width, "height": height, "format": fmt, "size_bytes": len(png), "path": rel,
                 "created_at": utcnow()}
            )  # fmt: skip
        return image_rows, per_row, per_turn

    # ---------------------------------------------------------- checkpoints
    def add_checkpoint(
        self,
        run_id: str,
        step: int,
        path: str,
        *,
        kind: str | None = None,
        size: int | None = None,
        metric: float | None = None,
    ) -> None:
        """Record the checkpoint of ``step`` (a rewrite of the step replaces it); an attempt writer records its
        attempt with it."""
        values = {"path": path, "attempt": self.attempt, "kind": kind, "bytes": size, "metric": _clean(metric)}

        def write(session: Session) -> None:
            stmt = dialect_insert(session, table_of(Checkpoint)).on_conflict_do_update(
                index_elements=["run_id", "step"], set_=values
            )
            session.execute(stmt, [{"run_id": run_id, "step": step, "created_at": utcnow(), **values}])

        self._write(write)

    def remove_checkpoint(self, run_id: str, step: int) -> None:
        """``train.save_total_limit`` deleted the checkpoint of ``step``."""

        def write(session: Session) -> None:
            session.execute(delete(Checkpoint).where(col(Checkpoint.run_id) == run_id, col(Checkpoint.step) == step))

        self._write(write)

    def delete_run(self, run_id: str, actor: str | None = None) -> bool:
        """Delete a run that has ended, with everything it wrote, and audit it. Conditional: of concurrent deletes
        exactly one returns True (and writes the audit entry); the others, and a run that is not (or no longer)
        ended, return False and change nothing."""

        def write(session: Session) -> bool:
            # claim the run first: the conditional UPDATE takes its row lock (PostgreSQL) or the write lock
            # (SQLite), so a concurrent delete waits here and then finds no ended run to claim
            claimed = changed_rows(
                session,
                update(Run).where(col(Run.id) == run_id, col(Run.status).in_(list(ENDED))).values(updated_at=utcnow()),
            )
            if claimed != 1:
                return False
            # children first: SQLite enforces the cascades, but deleting explicitly keeps it one fast statement each
            sample_ids = select(col(Sample.id)).where(col(Sample.run_id) == run_id)
            session.execute(delete(SampleImage).where(col(SampleImage.sample_id).in_(sample_ids)))
            session.execute(delete(SampleToolImage).where(col(SampleToolImage.sample_id).in_(sample_ids)))
            for table in (Sample, Metric, MetricRollup, Event, Checkpoint, RunTag):
                session.execute(delete(table).where(col(table.run_id) == run_id))
            session.execute(update(Run).where(col(Run.parent_id) == run_id).values(parent_id=None))
            name = session.scalars(select(col(Run.name)).where(col(Run.id) == run_id)).first()
            session.execute(delete(Run).where(col(Run.id) == run_id))
            if actor is not None:
                audit(session, actor, "run.delete", run_id, name)
            return True

        return self._unguarded()._write(write)
