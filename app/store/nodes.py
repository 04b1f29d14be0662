"""Runs on several hosts (``resources.nodes``): which workers a run attempt holds, and whether each of them lives.

torchrun's c10d rendezvous joins the hosts' processes into one job; what it leaves to the scheduler is Collage's:

- **A gang claim.** The worker that takes a queued run with ``nodes: N`` (the leader, node 0) reserves N - 1 other
  live, idle workers of the run's queue and moves the run to running in **one transaction**: every row changes by a
  conditional update (a worker still idle and unreserved, the run still queued), and any that loses its race rolls
  the whole claim back. N slots start the run together or none does.
- **Busy and reserved.** A worker's own claim marks it busy only while nobody has reserved it, and a reservation
  takes only a worker that is neither busy nor reserved, so a worker never holds two runs.
- **Nodes' heartbeats.** Each host's worker beats its ``run_nodes`` row and reads the others': a host whose beats
  stop (its worker or machine lost) fails the attempt on every host; a reserved worker that never started its part
  (it died between its last beat and the claim) puts the run back in the queue as a new attempt, and the next claim
  takes any N live slots.

Nothing here imports torch or fastapi: the workers call it, and the web tier reads the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import exists, insert, not_, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.core.status import ACTIVE, RunStatus
from collage.app.store.engine import session_scope
from collage.app.store.tables import Event, Run, RunNode, Worker, table_of, utcnow

from .errors import StoreError
from .sql import changed_rows


def nodes_of(config: dict[str, Any]) -> int:
    """How many hosts a run's config asks for (``resources.nodes``; 1 when unset)."""
    return int((config.get("resources") or {}).get("nodes") or 1)


@dataclass(frozen=True)
class Node:
    """This host's part of a run attempt on several hosts."""

    rank: int  # torchrun's node rank: 0 = the leader, which hosts the rendezvous
    nodes: int
    endpoint: str  # host:port of the rendezvous


class GangNotReady(StoreError):
    """Fewer live idle workers than the run needs (or one was taken meanwhile): the claim rolled back."""


# ------------------------------------------------------------------------------------------------ busy, free
def mark_busy(engine: Engine, worker: str, run_id: str) -> bool:
    """This worker takes ``run_id`` as its own (a one-host run): False when a gang claim has reserved it meanwhile
    (it must serve that run first). A worker with no row (a test's supervisor, no registry) is free."""
    with session_scope(engine) as session:
        if session.get(Worker, worker) is None:
            return True
        return changed_rows(session, update(Worker).where(col(Worker.name) == worker, col(Worker.reserved_for).is_(None))
                            .values(current_run_id=run_id)) == 1  # fmt: skip


def release(engine: Engine, worker: str, run_id: str) -> None:
    """This worker is done with ``run_id`` (its own, or one it was reserved for): neither busy with it nor reserved
    for it any more. A reservation for another run made meanwhile stays."""
    with session_scope(engine) as session:
        session.execute(update(Worker).where(col(Worker.name) == worker, col(Worker.current_run_id) == run_id)
                        .values(current_run_id=None))  # fmt: skip
        session.execute(update(Worker).where(col(Worker.name) == worker, col(Worker.reserved_for) == run_id)
                        .values(reserved_for=None, reserved_attempt=None))  # fmt: skip


def reservation(engine: Engine, worker: str) -> tuple[str, int] | None:
    """The run attempt that has reserved this worker as one of its hosts, if one has."""
    with Session(engine) as session:
        row = session.execute(select(col(Worker.reserved_for), col(Worker.reserved_attempt))
                              .where(col(Worker.name) == worker)).first()  # fmt: skip
    if row is None or row[0] is None or row[1] is None:
        return None
    return str(row[0]), int(row[1])


# ------------------------------------------------------------------------------------------------ the claim
def _idle_workers(session: Session, leader: str, queue: str, gpus: int, live_within: float) -> list[str]:
    cutoff = utcnow() - timedelta(seconds=live_within)
    rows = session.execute(
        select(col(Worker.name), col(Worker.queues), col(Worker.gpus))
        .where(
            col(Worker.name) != leader,
            col(Worker.last_seen) >= cutoff,
            col(Worker.current_run_id).is_(None),
            col(Worker.reserved_for).is_(None),
        )
        .order_by(col(Worker.name))
    ).all()
    return [name for name, queues, slot in rows if queue in (queues or []) and len(slot or []) >= gpus]


def claim_gang(
    session: Session, run_id: str, leader: str, nodes: int, queue: str, gpus: int, live_within: float, endpoint: str
) -> tuple[int, list[str]] | None:
    """Inside one transaction (the caller's): the leader takes the queued run ``run_id`` with ``nodes - 1`` other
    live idle workers of ``queue`` whose slots hold ``gpus`` GPUs. Returns the attempt and the workers by node rank;
    None when the run is no longer queued; raises :class:`GangNotReady` (the caller rolls back) when the workers are
    not there or one was taken meanwhile."""
    attempt = session.scalars(select(col(Run.attempt)).where(col(Run.id) == run_id,
                                                             col(Run.status) == RunStatus.QUEUED)).first()  # fmt: skip
    if attempt is None:
        return None
    busy = update(Worker).where(col(Worker.name) == leader, col(Worker.reserved_for).is_(None))
    if changed_rows(session, busy.values(current_run_id=run_id)) != 1:
        raise GangNotReady(f"worker {leader} is reserved for another run")
    followers: list[str] = []
    for name in _idle_workers(session, leader, queue, gpus, live_within):
        taken = changed_rows(session, update(Worker).where(
            col(Worker.name) == name, col(Worker.reserved_for).is_(None), col(Worker.current_run_id).is_(None)
        ).values(reserved_for=run_id, reserved_attempt=attempt))  # fmt: skip
        followers += [name] * taken
        if len(followers) == nodes - 1:
            break
    if len(followers) < nodes - 1:
        raise GangNotReady(f"{len(followers) + 1} of the {nodes} idle live workers the run needs on queue {queue!r}")
    now = utcnow()
    moved = update(Run).where(col(Run.id) == run_id, col(Run.status) == RunStatus.QUEUED, col(Run.attempt) == attempt)
    if changed_rows(session, moved.values(status=RunStatus.RUNNING, worker=leader, started_at=now, heartbeat_at=now,
                                          updated_at=now)) != 1:  # fmt: skip
        raise GangNotReady("the run was taken or cancelled meanwhile")
    hosts = [leader, *followers]
    others = ", ".join(f"{name} (node {rank})" for rank, name in enumerate(hosts) if rank)
    session.add(Event(run_id=run_id, level="info",
                      message=f"status: running on {leader} (node 0 of {nodes}) with {others}"[:500]))  # fmt: skip
    session.execute(insert(table_of(RunNode)), [
        {"run_id": run_id, "attempt": attempt, "rank": rank, "worker": name, "heartbeat_at": now,
         "endpoint": endpoint if rank == 0 else None, "started_at": now if rank == 0 else None}
        for rank, name in enumerate(hosts)
    ])  # fmt: skip
    return attempt, hosts


# ------------------------------------------------------------------------------------------------ each node
def node_of(engine: Engine, run_id: str, attempt: int, worker: str) -> Node | None:
    """This worker's part of the attempt (None: it has none, or the attempt has no leader row)."""
    with Session(engine) as session:
        rows = session.scalars(select(RunNode).where(col(RunNode.run_id) == run_id, col(RunNode.attempt) == attempt)
                               .order_by(col(RunNode.rank))).all()  # fmt: skip
    mine = next((r for r in rows if r.worker == worker), None)
    if mine is None or not rows or rows[0].rank != 0 or rows[0].endpoint is None:
        return None
    return Node(rank=mine.rank, nodes=len(rows), endpoint=rows[0].endpoint)


def start_node(engine: Engine, run_id: str, attempt: int, worker: str) -> Node | None:
    """A follower starts its part: its row is marked started and the worker busy with the run, if the attempt is
    still current and still running (else None, and nothing changes)."""
    node = node_of(engine, run_id, attempt, worker)
    if node is None:
        return None
    now = utcnow()
    with session_scope(engine) as session:
        current = session.scalars(select(col(Run.id)).where(col(Run.id) == run_id, col(Run.attempt) == attempt,
                                                            col(Run.status) == RunStatus.RUNNING)).first()  # fmt: skip
        if current is None:
            return None
        started = changed_rows(session, update(RunNode).where(
            col(RunNode.run_id) == run_id, col(RunNode.attempt) == attempt, col(RunNode.worker) == worker,
            col(RunNode.started_at).is_(None)).values(started_at=now, heartbeat_at=now))  # fmt: skip
        if started != 1:
            return None
        session.execute(update(Worker).where(col(Worker.name) == worker, col(Worker.reserved_for) == run_id)
                        .values(current_run_id=run_id))  # fmt: skip
    return node


def beat_node(engine: Engine, run_id: str, attempt: int, rank: int) -> None:
    with session_scope(engine) as session:
        session.execute(update(RunNode).where(col(RunNode.run_id) == run_id, col(RunNode.attempt) == attempt,
                                              col(RunNode.rank) == rank).values(heartbeat_at=utcnow()))  # fmt: skip


def end_node(engine: Engine, run_id: str, attempt: int, rank: int) -> None:
    """This host's processes are gone (its part ended, whichever way)."""
    with session_scope(engine) as session:
        session.execute(update(RunNode).where(col(RunNode.run_id) == run_id, col(RunNode.attempt) == attempt,
                                              col(RunNode.rank) == rank).values(ended_at=utcnow()))  # fmt: skip


def _age(when: datetime, now: datetime) -> float:
    return (now - (when if when.tzinfo else when.replace(tzinfo=timezone.utc))).total_seconds()


@dataclass(frozen=True)
class NodeVerdict:
    """What a host's watch found wrong with another host of the attempt."""

    lost: bool  # True: a started host stopped beating (the attempt fails); False: a host never started (requeue)
    message: str


def check_nodes(engine: Engine, run_id: str, attempt: int, timeout: float) -> NodeVerdict | None:
    """Whether every host of the attempt lives: a started one beat within ``timeout`` seconds, and one not yet
    started was claimed less than ``timeout`` seconds ago. None when all do."""
    with Session(engine) as session:
        rows = session.scalars(select(RunNode).where(col(RunNode.run_id) == run_id, col(RunNode.attempt) == attempt)
                               .order_by(col(RunNode.rank))).all()  # fmt: skip
    now, nodes = utcnow(), len(rows)
    for row in rows:
        if row.ended_at is not None:
            continue
        age = _age(row.heartbeat_at, now)
        if age <= timeout:
            continue
        if row.started_at is None:
            return NodeVerdict(False, f"node {row.rank} of {nodes} (worker {row.worker}) did not start its part "
                                      f"within {timeout:.0f}s of the claim (its worker was busy with a job, lost or stopped)")  # fmt: skip
        return NodeVerdict(True, f"node {row.rank} of {nodes} (worker {row.worker}) stopped beating for {age:.0f}s: "
                                 "its host or worker was lost; the attempt ends on every host")  # fmt: skip
    return None


def requeue(session: Session, run_id: str, attempt: int, why: str) -> bool:
    """The attempt never started on every host: the run goes back to its queue as the next attempt, keeping its
    place (it trained nothing), and the workers it reserved are free again. False: the attempt is not running."""
    moved = changed_rows(session, update(Run).where(
        col(Run.id) == run_id, col(Run.attempt) == attempt, col(Run.status) == RunStatus.RUNNING
    ).values(status=RunStatus.QUEUED, attempt=attempt + 1, worker=None, updated_at=utcnow()))  # fmt: skip
    if moved != 1:
        return False
    session.add(Event(run_id=run_id, level="warning",
                      message=f"{why}: back in the queue as attempt {attempt + 1}, in its place"[:500]))  # fmt: skip
    _free(session, run_id, attempt)
    return True


def _free(session: Session, run_id: str, attempt: int) -> None:
    session.execute(update(Worker).where(col(Worker.reserved_for) == run_id, col(Worker.reserved_attempt) == attempt)
                    .values(reserved_for=None, reserved_attempt=None))  # fmt: skip


def free_stale_reservations(engine: Engine) -> int:
    """The reaper's pass: reservations whose attempt is no longer a running one (requeued, failed, deleted) are
    dropped, so a worker reserved by a claim that then went nowhere takes runs again."""
    current = exists().where(col(Run.id) == col(Worker.reserved_for), col(Run.attempt) == col(Worker.reserved_attempt),
                             col(Run.status).in_(list(ACTIVE)))  # fmt: skip
    with session_scope(engine) as session:
        return changed_rows(session, update(Worker).where(col(Worker.reserved_for).is_not(None), not_(current))
                            .values(reserved_for=None, reserved_attempt=None))  # fmt: skip


def nodes_of_run(session: Session, run_id: str) -> Sequence[RunNode]:
    """Every host of every attempt of the run, newest attempt first (the run's page and API)."""
    return session.scalars(select(RunNode).where(col(RunNode.run_id) == run_id)
                           .order_by(col(RunNode.attempt).desc(), col(RunNode.rank))).all()  # fmt: skip


def node_queue(worker: str) -> str:
    """The broker queue only ``worker`` consumes: a leader sends its followers their part of a run there."""
    return f"collage.node.{worker}"
