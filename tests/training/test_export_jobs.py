"""Export jobs' routes (``POST /runs/{id}/exports``, ``GET /exports/{id}``, its download and cancel), on SQLite and
PostgreSQL through the in-process app with the dispatcher's test double, on real checkpoints of a tiny model: the
job is queued on the run's queue and reported, one export in flight per token, refusals with their reason, a broker
failure answered 503, and a vanished or misplaced checkpoint failing the job clearly on the worker's handler."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from collage.app.core.status import RunStatus
from collage.app.store import jobs
from tests.support import API
from tests.support.checkpoints import (
    run_config,
    run_with_checkpoints,
    work_next_job,
)
from tests.support.waiting import scaled

SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # a process per export: once


def _member(app, name="mallory") -> TestClient:
    from collage.app.store.tokens import create_token

    token = create_token(app.state.engine, name)
    return TestClient(app, headers={"Authorization": f"Bearer {token}"})


def test_an_export_is_queued_on_the_runs_queue_and_reported(api):
    client, _, dispatcher, app = api
    run = run_with_checkpoints(client, app, queue="gpu-a")
    response = client.post(f"{API}/runs/{run}/exports", json={"step": "last", "merge_lora": True})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert response.json()["url"] == response.headers["location"] == f"{API}/exports/{job_id}"
    assert dispatcher.jobs == [(job_id, "gpu-a")]
    body = client.get(f"{API}/exports/{job_id}").json()
    assert body["status"] == "queued" and body["queue_position"] == 1 and body["run_id"] == run
    assert body["step"] == 2 and body["merge_lora"] is True and body["download_url"] is None
    download = client.get(f"{API}/exports/{job_id}/download")
    assert download.status_code == 409 and "once it has succeeded" in download.json()["detail"]
    assert client.post(f"{API}/exports/{job_id}/cancel").json()["status"] == "cancelled"
    again = client.post(f"{API}/exports/{job_id}/cancel")
    assert again.status_code == 409 and "has ended" in again.json()["detail"]


def test_one_export_in_flight_per_token_and_only_its_token_or_an_admin_cancels_it(api):
    admin, _, _, app = api
    run = run_with_checkpoints(admin, app)
    mallory, alice = _member(app, "mallory"), _member(app, "alice")
    first = mallory.post(f"{API}/runs/{run}/exports", json={"step": 1}).json()["id"]  # any member exports any run
    second = mallory.post(f"{API}/runs/{run}/exports", json={"step": 2})
    assert second.status_code == 429 and second.headers["retry-after"] == "10"
    assert f"export {first} of this token is still queued" in second.json()["detail"]
    other = alice.post(f"{API}/runs/{run}/exports", json={}).json()["id"]  # another token: its own export
    refused = alice.post(f"{API}/exports/{first}/cancel")
    assert refused.status_code == 403 and "only the token that asked" in refused.json()["detail"]
    assert mallory.get(f"{API}/exports/{first}").json()["status"] == "queued"  # nothing happened to it
    assert admin.post(f"{API}/exports/{other}/cancel").json()["status"] == "cancelled"
    assert mallory.post(f"{API}/exports/{first}/cancel").json()["status"] == "cancelled"
    assert mallory.post(f"{API}/runs/{run}/exports", json={"step": 2}).status_code == 202  # its turn again


def test_of_twelve_exports_asked_at_once_by_one_token_exactly_one_is_queued(api):
    admin, _, dispatcher, app = api
    run = run_with_checkpoints(admin, app)
    from collage.app.store.tokens import create_token

    token = create_token(app.state.engine, "racer")
    clients = [TestClient(app, headers={"Authorization": f"Bearer {token}"}) for _ in range(12)]
    barrier = threading.Barrier(len(clients))
    answers: list[int] = []

    def ask(client):
        barrier.wait()
        answers.append(client.post(f"{API}/runs/{run}/exports", json={}).status_code)

    threads = [threading.Thread(target=ask, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=scaled(60))
    assert sorted(answers) == [202] + [429] * 11
    live = [j for j, _ in dispatcher.jobs if jobs.get_job(app.state.engine, j).status == "queued"]
    assert len(live) == 1


def test_bad_exports_are_refused_with_the_reason(api):
    client, _, dispatcher, app = api
    empty = client.post(API + "/runs", json=run_config("full")).json()["id"]
    response = client.post(f"{API}/runs/{empty}/exports", json={"step": 1})
    assert response.status_code == 409 and "no checkpoint to export" in response.json()["detail"]
    full = run_with_checkpoints(client, app, "full")
    response = client.post(f"{API}/runs/{full}/exports", json={"step": 9})
    assert response.status_code == 404 and "its checkpoints are at steps 1, 2" in response.json()["detail"]
    response = client.post(f"{API}/runs/{full}/exports", json={"step": "best"})
    assert response.status_code == 409 and "no train.metric_for_best_model" in response.json()["detail"]
    response = client.post(f"{API}/runs/{full}/exports", json={"merge_lora": True})
    assert response.status_code == 422 and response.json()["detail"][0]["path"] == "merge_lora"
    for body in ({"step": "first"}, {"step": True}, {"step": -1}, {"step": 2**31}, {"step": 1, "extra": 1}):
        assert client.post(f"{API}/runs/{full}/exports", json=body).status_code == 422, body
    assert client.post(f"{API}/runs/nosuchrun/exports", json={}).status_code == 404
    for path in ("/exports/nosuchjob", "/exports/nosuchjob/download"):
        assert client.get(API + path).status_code == 404
    assert client.post(f"{API}/exports/nosuchjob/cancel").status_code == 404
    assert dispatcher.jobs == []  # nothing refused was queued
    # a playground job is not an export
    playground = jobs.create_job(app.state.engine, jobs.JobKind.GENERATE, "default", {})
    assert client.get(f"{API}/exports/{playground.id}").status_code == 404
    for method, path in (("POST", f"/runs/{full}/exports"), ("GET", "/exports/x"), ("GET", "/exports/x/download"),
                         ("POST", "/exports/x/cancel")):  # fmt: skip
        assert client.request(method, API + path, headers={"Authorization": ""}).status_code == 401


def test_an_export_that_cannot_be_queued_is_cancelled_and_answered_503(api):
    client, _, dispatcher, app = api
    run = run_with_checkpoints(client, app, "full")
    dispatcher.fail_with = ConnectionError("broker down")
    response = client.post(f"{API}/runs/{run}/exports", json={})
    assert response.status_code == 503 and "broker down" in response.json()["detail"]
    dispatcher.fail_with = None
    assert client.post(f"{API}/runs/{run}/exports", json={}).status_code == 202  # nothing left in flight


@SQLITE_ONLY
def test_a_checkpoint_gone_or_misplaced_before_the_export_ran_fails_it_clearly(api):
    client, _, _, app = api
    run = run_with_checkpoints(client, app, "full")
    gone = client.post(f"{API}/runs/{run}/exports", json={"step": 1}).json()["id"]
    app.state.writer.remove_checkpoint(run, 1)  # save_total_limit removed it while the export waited
    assert work_next_job(app) == RunStatus.FAILED
    body = client.get(f"{API}/exports/{gone}").json()
    assert body["error"] == (
        f"run {run} no longer has a checkpoint at step 1 (train.save_total_limit may have removed it): its "
        "checkpoints are at steps 2"
    )
    misplaced = client.post(f"{API}/runs/{run}/exports", json={"step": 2}).json()["id"]
    app.state.writer.add_checkpoint(run, 2, "/etc", kind="full", size=1)
    assert work_next_job(app) == RunStatus.FAILED
    assert "recorded outside the run's folder: refused" in client.get(f"{API}/exports/{misplaced}").json()["error"]
    assert not (Path(app.state.settings.artifacts) / "exports" / misplaced).exists()
