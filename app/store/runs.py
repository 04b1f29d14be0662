"""The run routes' reads and writes beyond the :class:`~collage.app.store.writer.StoreWriter`'s (which creates, moves
and deletes runs in retried transactions of their own): who created a run, the traceback behind its error, its place
and expected wait in its queue, a user's edits of its tags and notes, the audit entries of what users do to runs,
and the snapshots the live stream polls.

The functions that take a Session work in the caller's (a request's one session); those that write commit it, one
transaction each. :func:`run_snapshot` takes the engine: a stream reads in short sessions of its own between polls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.core.status import RunStatus
from collage.app.store.tables import ApiToken, Event, Metric, Run, RunTag, utcnow

from .queueing import queue_of, queued_runs
from .text import TRACEBACK_LEVEL, has_traceback
from .tokens import audit

RECENT_RUNS = 20  # finished runs whose durations make a queue's estimate
SNAPSHOT_METRICS = 5000  # metric values one stream poll reads at most

Worker = dict[str, Any]  # a live worker as store.workers.live_workers describes it


def creator_names(session: Session, runs: Sequence[Run]) -> dict[int, str]:
    """Token id -> name for the runs' creators (tokens are revoked, never deleted, so the name stays)."""
    ids = {r.created_by for r in runs if r.created_by is not None}
    if not ids:
        return {}
    return dict(session.execute(select(col(ApiToken.id), col(ApiToken.name)).where(col(ApiToken.id).in_(ids))).all())


def run_labels(session: Session, run_ids: set[str]) -> dict[str, tuple[str, str]]:
    """Run id -> (name, status), for the runs the live workers are training."""
    if not run_ids:
        return {}
    rows = session.execute(select(col(Run.id), col(Run.name), col(Run.status)).where(col(Run.id).in_(run_ids))).all()
    return {r.id: (r.name, r.status) for r in rows}


def error_detail(session: Session, run: Run) -> str | None:
    """The traceback behind a failed run's error: its newest traceback event (or, for a run that failed before
    tracebacks moved there, the stored error itself)."""
    if run.error is None:
        return None
    if has_traceback(run.error):
        return run.error
    return session.scalars(
        select(col(Event.message))
        .where(col(Event.run_id) == run.id, col(Event.level) == TRACEBACK_LEVEL)
        .order_by(col(Event.id).desc())
        .limit(1)
    ).first()


# ------------------------------------------------------------------------------------------- a queued run's wait
def queue_place(session: Session, run: Run, workers: list[Worker] | None) -> tuple[int | None, float | None]:
    """``(position, estimate_s)`` of a queued run, ``workers`` being the live workers of its queue (None: they
    could not be read).

    Position: 1-based among the queued runs of the same ``resources.queue``, in the order they were queued (a
    run's creation, or its latest resume: the broker hands runs out first in, first out).

    Estimate: with D the mean wall-clock duration (start to finish) of the last 20 succeeded runs of that queue,
    each live worker of the queue is free after the rest of its current run (D minus the time it has run so far,
    or its own pace, elapsed x steps left / steps done, once it has made progress; at least 0) or at once when
    idle; the runs ahead are handed to whichever worker is free first, D each, and the estimate is when a worker
    is free for this run. None without a live worker on the queue or without a finished run to take D from.
    """
    queue = queue_of(run.config)
    order = queued_runs(session, queue)
    position = next((i + 1 for i, q in enumerate(order) if q.run_id == run.id), None)
    if position is None:
        return None, None
    if not workers:
        return position, None
    mean = _mean_duration(session, queue)
    if mean is None:
        return position, None
    free_at = _free_in(session, workers, mean)
    for _ in range(position - 1):  # the runs ahead take the first free worker, one mean duration each
        first = min(range(len(free_at)), key=free_at.__getitem__)
        free_at[first] += mean
    return position, round(min(free_at), 1)


def _mean_duration(session: Session, queue: str) -> float | None:
    """The mean duration in seconds of the queue's last RECENT_RUNS succeeded runs; None without one."""
    recent = session.execute(
        select(col(Run.config), col(Run.started_at), col(Run.finished_at))
        .where(col(Run.status) == RunStatus.SUCCEEDED, col(Run.started_at).is_not(None))
        .order_by(col(Run.finished_at).desc())
        .limit(RECENT_RUNS * 5)
    ).all()
    durations = [
        (r.finished_at - r.started_at).total_seconds()
        for r in recent
        if r.finished_at is not None and queue_of(r.config) == queue
    ][:RECENT_RUNS]
    return sum(durations) / len(durations) if durations else None


def _free_in(session: Session, workers: list[Worker], mean: float) -> list[float]:
    """Seconds until each worker is done with its current run (0 for an idle one)."""
    busy_ids = [w["current_run"] for w in workers if w["current_run"]]
    busy = {
        r.id: r
        for r in session.execute(
            select(col(Run.id), col(Run.started_at), col(Run.step), col(Run.max_steps)).where(col(Run.id).in_(busy_ids))
        ).all()
    } if busy_ids else {}  # fmt: skip
    now = utcnow().replace(tzinfo=None)
    free_at = []
    for w in workers:
        current = busy.get(w["current_run"]) if w["current_run"] else None
        if current is None or current.started_at is None:
            free_at.append(0.0)
            continue
        elapsed = max(0.0, (now - current.started_at.replace(tzinfo=None)).total_seconds())
        if current.step > 0 and current.max_steps > current.step:
            left = elapsed * (current.max_steps - current.step) / current.step
        else:
            left = mean - elapsed
        free_at.append(max(0.0, left))
    return free_at


# ------------------------------------------------------------------------------------------------ users' changes
def edit_run(
    session: Session, run_id: str, actor: str, *, tags: list[str] | None, notes: str | None, set_notes: bool
) -> bool:
    """Replace the run's tags when ``tags`` is given (the config keeps them too) and its notes when ``set_notes``
    (empty or None clears them), audited as ``run.edit``; one transaction, committed. False when the run is gone
    (deleted since the caller read it): nothing is written."""
    # re-read, not the caller's copy: the config the tags go into must be the stored one
    stored = session.get(Run, run_id, populate_existing=True)
    if stored is None:
        return False
    changed = []
    if tags is not None:
        unique = list(dict.fromkeys(tags))
        session.execute(delete(RunTag).where(col(RunTag.run_id) == run_id))
        for tag in unique:
            session.add(RunTag(run_id=run_id, tag=tag))
        stored.config = {**stored.config, "tags": unique}
        changed.append("tags")
    if set_notes:
        stored.notes = notes or None
        changed.append("notes")
    if changed:
        stored.updated_at = utcnow()
        audit(session, actor, "run.edit", run_id, f"{stored.name}: {', '.join(changed)}")
    session.commit()
    return True


def record_action(session: Session, actor: str, action: str, run: Run) -> None:
    """The audit entry of what ``actor`` did to ``run`` (``run.cancel``, ``run.resume``), committed."""
    audit(session, actor, action, run.id, run.name)
    session.commit()


# ------------------------------------------------------------------------------------------------ the live stream
def run_snapshot(
    engine: Engine, run_id: str, after_step: int
) -> tuple[dict[str, Any] | None, dict[int, dict[str, float]]]:
    """The run's status and progress now (None: no such run) and its metrics of the steps after ``after_step``
    (at most SNAPSHOT_METRICS values), read in a short session of its own: a stream holds no connection between
    its polls."""
    with Session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            return None, {}
        state = {"status": run.status, "step": run.step, "max_steps": run.max_steps, "error": run.error}
        metrics: dict[int, dict[str, float]] = {}
        for step, key, value in session.execute(
            select(col(Metric.step), col(Metric.key), col(Metric.value))
            .where(col(Metric.run_id) == run_id, col(Metric.step) > after_step)
            .order_by(col(Metric.step))
            .limit(SNAPSHOT_METRICS)
        ):
            metrics.setdefault(step, {})[key] = value
        return state, metrics
