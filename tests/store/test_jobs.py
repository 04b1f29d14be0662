"""Jobs (exports, playground generations): queued, claimed exactly once in the order they came, cancelled, reaped
when their worker dies, ended by their handler's outcome; on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlmodel import Session

from collage.app.core.status import JobKind, RunStatus
from collage.app.store import jobs
from collage.app.store.tables import Job, utcnow
from tests.support.waiting import scaled


@pytest.fixture
def engine(database_url):
    from collage.app.store.engine import engine_for

    return engine_for(database_url)


def test_jobs_are_claimed_once_each_oldest_first(engine):
    made = [jobs.create_job(engine, JobKind.EXPORT, "default", {"n": i}) for i in range(6)]
    other = jobs.create_job(engine, JobKind.GENERATE, "gpu-b", {})
    assert [jobs.queue_position(engine, j) for j in made] == [1, 2, 3, 4, 5, 6]
    claimed: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        while (job := jobs.claim_next_job(engine, "default", name)) is not None:
            with lock:
                claimed.append(job.id)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=scaled(60))
    assert sorted(claimed) == sorted(j.id for j in made) and len(set(claimed)) == 6  # each exactly once
    assert jobs.get_job(engine, other.id).status == RunStatus.QUEUED  # another queue's job is not taken
    assert jobs.claim_next_job(engine, "default", "late") is None  # a spare token is a no-op


def test_cancel_ends_a_queued_job_at_once_and_asks_a_running_one_to_stop(engine):
    queued = jobs.create_job(engine, JobKind.GENERATE, "default", {})
    running = jobs.create_job(engine, JobKind.GENERATE, "default", {})
    assert jobs.cancel_job(engine, queued.id) == RunStatus.CANCELLED
    assert jobs.claim_next_job(engine, "default", "w").id == running.id  # the cancelled one is skipped
    assert jobs.report_progress(engine, running.id, 0.5, "half way")
    assert jobs.cancel_job(engine, running.id) == RunStatus.CANCELLING
    assert jobs.cancel_requested(engine, running.id)
    assert not jobs.report_progress(engine, running.id, 0.6)  # the handler learns it should stop
    assert jobs.finish_job(engine, running.id, RunStatus.CANCELLED)
    assert not jobs.finish_job(engine, running.id, RunStatus.SUCCEEDED)  # ended once


def test_a_job_whose_worker_died_is_reaped_and_one_that_beats_is_not(engine):
    dead = jobs.create_job(engine, JobKind.EXPORT, "default", {})
    alive = jobs.create_job(engine, JobKind.EXPORT, "default", {})
    jobs.claim_next_job(engine, "default", "w1")
    jobs.claim_next_job(engine, "default", "w2")
    # both last beat a minute ago (their claim), as if that much time had passed; then one of them beats again
    with Session(engine) as session:
        session.execute(update(Job).values(heartbeat_at=utcnow() - timedelta(seconds=60)))
        session.commit()
    jobs.beat(engine, alive.id)
    assert jobs.reap_jobs(engine, timeout=30) == [dead.id]
    found = jobs.get_job(engine, dead.id)
    assert found.status == RunStatus.FAILED and "worker w1 lost" in found.error
    assert jobs.get_job(engine, alive.id).status == RunStatus.RUNNING


def test_a_handlers_outcome_ends_the_job(engine, monkeypatch, tmp_path):
    """run_job: a result succeeds, JobFailed is the user's message, anything else fails with its type and message
    (never a traceback), and a cancel seen by the handler ends it cancelled."""
    from collage.app.core.settings import Settings
    from collage.worker import jobs as worker_jobs

    settings = Settings(home=tmp_path, database_url=str(engine.url.render_as_string(hide_password=False)),
                        broker_url="memory://", artifacts=tmp_path / "a", heartbeat_interval=0.1)  # fmt: skip

    def outcome(behaviour):
        job = jobs.create_job(engine, JobKind.EXPORT, "default", {"do": behaviour})
        claimed = jobs.claim_next_job(engine, "default", "w")
        assert claimed.id == job.id

        def handler(context):
            context.progress(0.5, "working")
            if behaviour == "fail":
                raise worker_jobs.JobFailed("no checkpoint at step 7")
            if behaviour == "crash":
                raise ValueError("bad\nsecond line")
            if behaviour == "cancel":
                jobs.cancel_job(engine, job.id)
                context.progress(0.9)
            return {"path": "exports/x"}

        monkeypatch.setattr(worker_jobs, "handler_for", lambda kind: handler)
        status = worker_jobs.run_job(claimed, settings, "w")
        return status, jobs.get_job(engine, job.id)

    status, job = outcome("ok")
    assert status == "succeeded" and job.result == {"path": "exports/x"} and job.progress == 1.0
    status, job = outcome("fail")
    assert status == "failed" and job.error == "no checkpoint at step 7"
    status, job = outcome("crash")
    assert status == "failed" and job.error == "ValueError: bad"
    status, job = outcome("cancel")
    assert status == "cancelled" and job.status == "cancelled"
