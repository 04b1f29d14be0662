"""The run lifecycle in the store, on SQLite and PostgreSQL: one conditional transition for every status change,
attempt-guarded writes, concurrent resumes through the in-process app that make one new attempt, and writes that
survive a dropped database connection."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select, text
from sqlmodel import Session

from collage.app.store.tables import Checkpoint, Event, Metric, Run
from collage.app.store.writer import StaleAttempt, StoreWriter
from tests.support.api import config


@pytest.fixture
def writer(database_url, tmp_path):
    from collage.app.store.engine import engine_for

    return StoreWriter(engine_for(database_url), tmp_path / "artifacts")


def _run(writer: StoreWriter) -> str:
    from collage.training.config import parse_config

    return writer.create_run(parse_config(config()).model_dump(mode="json")).id


def _state(writer: StoreWriter, run_id: str) -> tuple[str, int]:
    state = writer.run_state(run_id)
    assert state is not None
    return state


def test_a_transition_happens_only_from_its_states_and_once(writer):
    run_id = _run(writer)
    assert not writer.transition(run_id, ["running"], "succeeded")  # it is queued
    assert _state(writer, run_id) == ("queued", 1)
    results = []
    barrier = threading.Barrier(4)

    def claim(name):
        barrier.wait()
        results.append(writer.transition(run_id, ["queued"], "running", worker=name))

    threads = [threading.Thread(target=claim, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True], "exactly one claim wins"
    with Session(writer.engine) as session:
        starts = session.scalar(select(func.count()).where(Event.run_id == run_id, Event.message == "status: running"))
    assert starts == 1


def test_a_stale_attempt_writes_nothing(writer):
    run_id = _run(writer)
    assert writer.transition(run_id, ["queued"], "running")
    first = writer.for_attempt(run_id, 1)
    first.append_metrics(run_id, 1, {"reward": 0.5})
    first.add_checkpoint(run_id, 1, "/runs/x/attempt-1/checkpoints/step-1")
    # reaped as lost, then resumed: attempt 2 is current
    assert writer.transition(run_id, ["running"], "failed", when_attempt=1, error="lost")
    assert writer.transition(run_id, ["failed"], "queued", when_attempt=1, attempt=Run.attempt + 1, error=None)
    assert writer.transition(run_id, ["queued"], "running")
    for write in (
        lambda: first.append_metrics(run_id, 2, {"reward": 9.0}),
        lambda: first.append_samples(run_id, 2, []),
        lambda: first.add_checkpoint(run_id, 2, "/runs/x/attempt-1/checkpoints/step-2"),
        lambda: first.add_event(run_id, "info", "from the past"),
        lambda: first.set_progress(run_id, 2),
        lambda: first.heartbeat(run_id),
    ):
        with pytest.raises(StaleAttempt):
            write()
    # and its final word is refused too
    assert not writer.transition(run_id, ["running", "cancelling"], "succeeded", when_attempt=1)
    second = writer.for_attempt(run_id, 2)
    second.append_metrics(run_id, 2, {"reward": 1.0})
    with Session(writer.engine) as session:
        assert session.scalars(select(Metric.value).where(Metric.run_id == run_id).order_by(Metric.step)).all() == [
            0.5,
            1.0,
        ]
        assert session.scalars(select(Checkpoint.step).where(Checkpoint.run_id == run_id)).all() == [1]
        assert not session.scalars(select(Event).where(Event.message == "from the past")).all()
        run = session.get(Run, run_id)
        assert run.status == "running" and run.attempt == 2 and run.step == 0


def test_the_step_time_is_the_current_attempts_and_starts_again_on_resume(writer):
    """The time left comes from the step time the training process measured; a resumed attempt starts with none
    ("estimating"), never with the earlier attempt's."""
    run_id = _run(writer)
    assert writer.transition(run_id, ["queued"], "running")
    first = writer.for_attempt(run_id, 1)
    first.begin_attempt(run_id, 0, 200)
    first.set_progress(run_id, 1, 2.5)
    first.set_progress(run_id, 2, float("nan"))  # not a time: the last one stays
    first.set_progress(run_id, 3)
    with Session(writer.engine) as session:
        run = session.get(Run, run_id)
        assert (run.step, run.seconds_per_step) == (3, 2.5)
    assert writer.transition(run_id, ["running"], "failed", when_attempt=1, error="lost")
    assert writer.transition(run_id, ["failed"], "queued", when_attempt=1, attempt=Run.attempt + 1, error=None)
    assert writer.transition(run_id, ["queued"], "running")
    second = writer.for_attempt(run_id, 2)
    second.begin_attempt(run_id, 3, 200)
    with Session(writer.engine) as session:
        assert session.get(Run, run_id).seconds_per_step is None
    second.set_progress(run_id, 4, 0.75)
    with Session(writer.engine) as session:
        assert session.get(Run, run_id).seconds_per_step == 0.75


def test_concurrent_resumes_make_one_new_attempt(api):
    client, _, dispatcher, app = api
    run_id = client.post("/api/v1/runs", json=config()).json()["id"]
    writer = app.state.writer
    assert writer.transition(run_id, ["queued"], "running") and writer.transition(run_id, ["running"], "failed")
    answers = []
    barrier = threading.Barrier(3)

    def resume():
        barrier.wait()
        answers.append(client.post(f"/api/v1/runs/{run_id}/resume").status_code)

    threads = [threading.Thread(target=resume) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [200, 409, 409]
    assert client.get(f"/api/v1/runs/{run_id}").json()["attempt"] == 2
    assert [r for r, _ in dispatcher.submitted].count(run_id) == 2  # created once, resumed once


def test_a_write_is_retried_when_the_connection_drops_mid_transaction(migrated_postgres_url, tmp_path):
    """PostgreSQL kills the writer's connection inside its transaction: the writer retries on a new one."""
    from collage.app.store.engine import engine_for
    from tests.support.services import truncate

    truncate(migrated_postgres_url)
    writer = StoreWriter(engine_for(migrated_postgres_url), tmp_path)
    run_id = _run(writer)
    assert writer.transition(run_id, ["queued"], "running")
    guarded = writer.for_attempt(run_id, 1)
    killed = []
    real = guarded._guard

    def guard_then_die(session, run_id, **values):
        real(session, run_id, **values)
        if not killed:
            killed.append(True)
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    guarded._guard = guard_then_die  # type: ignore[method-assign]
    guarded.append_metrics(run_id, 1, {"reward": 0.25})
    assert killed == [True]
    with Session(writer.engine) as session:
        assert session.scalars(select(Metric.value).where(Metric.run_id == run_id)).all() == [0.25]
