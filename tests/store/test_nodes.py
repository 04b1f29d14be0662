"""Runs on several hosts in the store (``app.store.nodes``), on SQLite and PostgreSQL: the gang claim takes N live
idle workers and the run in one transaction or nothing; a worker is never busy and reserved at once; each host's
verdict on the others (lost: the attempt fails; never started: the run is queued again, in its place)."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlmodel import Session, col

from collage.app.store import nodes
from collage.app.store.tables import Event, Run, RunNode, Worker, utcnow
from collage.app.store.writer import StoreWriter
from collage.worker.supervisor import Gang, claim
from tests.support.api import config


@pytest.fixture
def writer(database_url, tmp_path):
    from collage.app.store.engine import engine_for

    return StoreWriter(engine_for(database_url), tmp_path / "artifacts")


def _run(writer: StoreWriter, hosts: int = 2, queue: str = "default") -> str:
    from collage.training.config import parse_config

    data = config()
    data["resources"] = {"gpus": 0, "nodes": hosts, "queue": queue}
    return writer.create_run(parse_config(data).model_dump(mode="json")).id


def _worker(writer: StoreWriter, name: str, queues=("default",), seen_ago: float = 0.0, **values) -> None:
    with Session(writer.engine) as session:
        session.add(Worker(name=name, hostname="h", pid=1, queues=list(queues), gpus=[],
                           last_seen=utcnow() - timedelta(seconds=seen_ago), **values))  # fmt: skip
        session.commit()


def _workers(writer: StoreWriter) -> dict[str, tuple]:
    with Session(writer.engine) as session:
        rows = session.scalars(select(Worker)).all()
        return {w.name: (w.current_run_id, w.reserved_for) for w in rows}


def _nodes(writer: StoreWriter, run_id: str) -> list[tuple]:
    with Session(writer.engine) as session:
        rows = session.scalars(select(RunNode).where(RunNode.run_id == run_id).order_by(RunNode.rank)).all()
        return [(r.attempt, r.rank, r.worker, r.endpoint, r.started_at is not None) for r in rows]


GANG = Gang(address="10.1.2.3", port=29400, live_within=20)


def test_a_gang_claim_takes_live_idle_workers_of_the_queue_and_the_run_at_once(writer):
    run_id = _run(writer, hosts=3)
    _worker(writer, "lead")
    _worker(writer, "busy", current_run_id="other")
    _worker(writer, "gone", seen_ago=60)  # not seen for longer than live_within
    _worker(writer, "elsewhere", queues=("big",))
    _worker(writer, "f1")
    _worker(writer, "f2")
    run = claim(writer, run_id, "lead", GANG)
    assert run is not None and run.status == "running" and run.worker == "lead"
    assert _nodes(writer, run_id) == [(1, 0, "lead", "10.1.2.3:29400", True), (1, 1, "f1", None, False),
                                      (1, 2, "f2", None, False)]  # fmt: skip
    assert _workers(writer)["lead"] == (run_id, None)
    assert _workers(writer)["f1"] == (None, run_id) and _workers(writer)["f2"] == (None, run_id)
    assert _workers(writer)["busy"] == ("other", None) and _workers(writer)["gone"] == (None, None)
    assert nodes.reservation(writer.engine, "f1") == (run_id, 1)
    with Session(writer.engine) as session:
        messages = list(session.scalars(select(Event.message).where(Event.run_id == run_id)))
    assert "status: running on lead (node 0 of 3) with f1 (node 1), f2 (node 2)" in messages


def test_too_few_workers_leave_everything_as_it_was(writer):
    run_id = _run(writer, hosts=3)
    _worker(writer, "lead")
    _worker(writer, "f1")
    _worker(writer, "gone", seen_ago=60)
    assert claim(writer, run_id, "lead", GANG) is None
    assert writer.run_state(run_id) == ("queued", 1)
    assert _workers(writer) == {"lead": (None, None), "f1": (None, None), "gone": (None, None)}  # rolled back
    assert _nodes(writer, run_id) == []


def test_a_reserved_worker_does_not_claim_a_run_of_its_own(writer):
    gang_run = _run(writer, hosts=2)
    _worker(writer, "lead")
    _worker(writer, "f1")
    assert claim(writer, gang_run, "lead", GANG) is not None
    single = _run(writer, hosts=1)
    assert claim(writer, single, "f1") is None, "f1 must serve the run that reserved it first"
    assert writer.run_state(single) == ("queued", 1)
    assert nodes.start_node(writer.engine, gang_run, 1, "f1") == nodes.Node(rank=1, nodes=2, endpoint="10.1.2.3:29400")
    assert nodes.start_node(writer.engine, gang_run, 1, "f1") is None, "a redelivered part starts nothing twice"
    assert _workers(writer)["f1"] == (gang_run, gang_run)
    nodes.release(writer.engine, "f1", gang_run)
    assert _workers(writer)["f1"] == (None, None)
    assert claim(writer, single, "f1") is not None


def test_concurrent_gang_claims_never_share_a_worker(writer):
    """Four leaders, each wanting one follower, and three idle workers beside them: whoever wins, no worker ends up
    in two runs, and every claimed run has its two distinct hosts."""
    runs = [_run(writer, hosts=2) for _ in range(4)]
    for name in ("a", "b", "c", "d", "e", "f", "g"):
        _worker(writer, name)
    barrier = threading.Barrier(4)
    won: list[str] = []

    def lead(name: str, run_id: str) -> None:
        barrier.wait()
        if claim(writer, run_id, name, GANG) is not None:
            won.append(run_id)

    threads = [threading.Thread(target=lead, args=(n, r)) for n, r in zip("abcd", runs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won, "at least one gang claim goes through"
    hosts = [name for run_id in won for _, _, name, _, _ in _nodes(writer, run_id)]
    assert len(hosts) == len(set(hosts)) == 2 * len(won), hosts
    for run_id in set(runs) - set(won):
        assert writer.run_state(run_id) == ("queued", 1) and _nodes(writer, run_id) == []


def test_a_host_that_stops_beating_is_lost_and_one_that_never_started_requeues_the_run(writer):
    run_id = _run(writer, hosts=2)
    _worker(writer, "lead")
    _worker(writer, "f1")
    assert claim(writer, run_id, "lead", GANG) is not None
    assert nodes.check_nodes(writer.engine, run_id, 1, timeout=30) is None
    old = utcnow() - timedelta(seconds=45)
    with Session(writer.engine) as session:
        session.execute(update(RunNode).where(col(RunNode.rank) == 1).values(heartbeat_at=old))
        session.commit()
    verdict = nodes.check_nodes(writer.engine, run_id, 1, timeout=30)
    assert verdict is not None and not verdict.lost
    assert "node 1 of 2 (worker f1) did not start its part within 30s" in verdict.message
    assert writer.atomically(lambda session: nodes.requeue(session, run_id, 1, verdict.message))
    assert writer.run_state(run_id) == ("queued", 2)
    assert _workers(writer)["f1"] == (None, None), "the reservation went with the attempt"
    assert nodes.start_node(writer.engine, run_id, 1, "f1") is None, "the old attempt's part starts nothing"
    # the next claim takes any live slots, under the new attempt
    nodes.release(writer.engine, "lead", run_id)
    _worker(writer, "f2")
    assert claim(writer, run_id, "f2", GANG) is not None
    assert [(a, r) for a, r, *_ in _nodes(writer, run_id) if a == 2] == [(2, 0), (2, 1)]
    assert nodes.start_node(writer.engine, run_id, 2, _nodes(writer, run_id)[-1][2]) is not None
    with Session(writer.engine) as session:
        session.execute(update(RunNode).where(col(RunNode.attempt) == 2, col(RunNode.rank) == 1)
                        .values(heartbeat_at=old))  # fmt: skip
        session.commit()
    verdict = nodes.check_nodes(writer.engine, run_id, 2, timeout=30)
    assert verdict is not None and verdict.lost, verdict
    # at least the 45 s its row was set back (more on a slow machine: the age is read at the check)
    assert int(re.search(r"stopped beating for (\d+)s", verdict.message).group(1)) >= 45, verdict.message
    nodes.end_node(writer.engine, run_id, 2, 1)
    assert nodes.check_nodes(writer.engine, run_id, 2, timeout=30) is None, "a host whose part ended is not lost"


def test_the_reaper_frees_reservations_of_attempts_that_went_nowhere(writer):
    run_id = _run(writer, hosts=2)
    _worker(writer, "lead")
    _worker(writer, "f1")
    assert claim(writer, run_id, "lead", GANG) is not None
    assert nodes.free_stale_reservations(writer.engine) == 0, "the attempt runs: its reservation stays"
    assert writer.transition(run_id, ["running"], "failed", error="x")
    assert nodes.free_stale_reservations(writer.engine) == 1
    assert _workers(writer)["f1"] == (None, None)
    with Session(writer.engine) as session:
        assert session.get(Run, run_id).status == "failed"
