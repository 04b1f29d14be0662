"""Export jobs: the routes (``POST /runs/{id}/exports``, ``GET /exports/{id}``, its download and cancel) on SQLite and
PostgreSQL with the dispatcher's test double, and the worker's handler (``worker/export_job.py``) run as a worker runs
it, with its real export process, on real checkpoints: the export loads and gives the checkpoint's logits, a cancel
stops it and leaves no files, a token keeps its newest export, a vanished or misplaced checkpoint fails clearly."""

from __future__ import annotations

import io
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from collage.app.status import RunStatus
from collage.app.store import jobs

from .checkpoint_support import checkpoint_model, model_inputs, place, run_config
from .test_api import API

SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # a process per export: once


def _member(app, name="mallory") -> TestClient:
    from collage.app.store.tokens import create_token

    token = create_token(app.state.engine, name)
    return TestClient(app, headers={"Authorization": f"Bearer {token}"})


def _run_with_checkpoints(client, app, kind="lora", queue="default") -> str:
    config = run_config(kind)
    config["resources"] = {"gpus": 0, "queue": queue}
    run = client.post(API + "/runs", json=config).json()["id"]
    place(app.state.writer, Path(app.state.settings.artifacts), run, kind)
    return run


def _work(app, queue="default") -> str:
    """What a worker of ``queue`` does with the next message: claim the oldest job, run it to its end."""
    from collage.worker.jobs import run_job

    job = jobs.claim_next_job(app.state.engine, queue, "test-worker")
    assert job is not None
    return run_job(job, app.state.settings, "test-worker")


def _untar(data: bytes, dest: Path) -> Path:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        archive.extractall(dest, filter="data")
    (top,) = list(dest.iterdir())
    return top


# ------------------------------------------------------------------------------------------------------- routes


def test_an_export_is_queued_on_the_runs_queue_and_reported(api):
    client, _, dispatcher, app = api
    run = _run_with_checkpoints(client, app, queue="gpu-a")
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
    run = _run_with_checkpoints(admin, app)
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


def test_of_two_exports_asked_at_once_by_one_token_exactly_one_is_queued(api):
    admin, _, dispatcher, app = api
    run = _run_with_checkpoints(admin, app)
    from collage.app.store.tokens import create_token

    token = create_token(app.state.engine, "racer")
    clients = [TestClient(app, headers={"Authorization": f"Bearer {token}"}) for _ in range(4)]
    barrier = threading.Barrier(len(clients))
    answers: list[int] = []

    def ask(client):
        barrier.wait()
        answers.append(client.post(f"{API}/runs/{run}/exports", json={}).status_code)

    threads = [threading.Thread(target=ask, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(answers) == [202, 429, 429, 429]
    live = [j for j, _ in dispatcher.jobs if jobs.get_job(app.state.engine, j).status == "queued"]
    assert len(live) == 1


def test_bad_exports_are_refused_with_the_reason(api):
    client, _, dispatcher, app = api
    empty = client.post(API + "/runs", json=run_config("full")).json()["id"]
    response = client.post(f"{API}/runs/{empty}/exports", json={"step": 1})
    assert response.status_code == 409 and "no checkpoint to export" in response.json()["detail"]
    full = _run_with_checkpoints(client, app, "full")
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
    run = _run_with_checkpoints(client, app, "full")
    dispatcher.fail_with = ConnectionError("broker down")
    response = client.post(f"{API}/runs/{run}/exports", json={})
    assert response.status_code == 503 and "broker down" in response.json()["detail"]
    dispatcher.fail_with = None
    assert client.post(f"{API}/runs/{run}/exports", json={}).status_code == 202  # nothing left in flight


# -------------------------------------------------------------------------------------------- the worker's handler


@SQLITE_ONLY
def test_an_export_job_makes_a_folder_that_loads_with_the_checkpoints_logits(api, tmp_path):
    client, _, _, app = api
    run = _run_with_checkpoints(client, app, "lora")
    job_id = client.post(f"{API}/runs/{run}/exports", json={"step": 2, "merge_lora": True}).json()["id"]
    assert _work(app) == RunStatus.SUCCEEDED
    body = client.get(f"{API}/exports/{job_id}").json()
    assert body["status"] == "succeeded" and body["progress"] == 1.0 and body["kind"] == "adapter"
    assert body["download_url"] == f"{API}/exports/{job_id}/download" and body["error"] is None
    folder = Path(app.state.settings.artifacts) / "exports" / job_id
    assert body["bytes"] == sum(p.stat().st_size for p in folder.iterdir())
    response = client.get(body["download_url"])
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
    assert f'filename="{run}-step-2-merged.tar"' in response.headers["content-disposition"]
    top = _untar(response.content, tmp_path / "x")
    assert top.name == f"{run}-step-2-merged" and {p.name for p in top.iterdir()} == {p.name for p in folder.iterdir()}
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(top)
    model = AutoModelForImageTextToText.from_pretrained(top, dtype=torch.float32).eval()
    inputs = model_inputs(processor)
    checkpoint = checkpoint_model("lora", Path(app.state.settings.artifacts) / "runs" / run / "attempt-1" /
                                  "checkpoints" / "step-2")  # fmt: skip
    with torch.no_grad():
        assert (model(**inputs).logits - checkpoint(**inputs).logits).abs().max().item() < 1e-4
    leftovers = [p.name for p in folder.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no working or temporary folder stays behind


@SQLITE_ONLY
def test_a_cancel_stops_a_running_export_at_once_and_leaves_no_files(api):
    client, _, _, app = api
    run = _run_with_checkpoints(client, app, "lora")
    job_id = client.post(f"{API}/runs/{run}/exports", json={"merge_lora": True}).json()["id"]
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(_work(app)))
    worker.start()
    deadline = time.monotonic() + 120
    while client.get(f"{API}/exports/{job_id}").json()["progress"] == 0.0:  # the export process reported once
        assert time.monotonic() < deadline and worker.is_alive(), "the export never started"
        time.sleep(0.05)
    assert client.post(f"{API}/exports/{job_id}/cancel").json()["status"] == "cancelling"
    worker.join(timeout=60)
    assert outcome == [RunStatus.CANCELLED]
    body = client.get(f"{API}/exports/{job_id}").json()
    assert body["status"] == "cancelled" and body["download_url"] is None
    exports = Path(app.state.settings.artifacts) / "exports"
    assert list(exports.iterdir()) == []  # neither the export, its temporary folder nor its working folder


@SQLITE_ONLY
def test_a_token_keeps_its_newest_export_and_the_older_download_says_why_it_is_gone(api):
    client, _, _, app = api
    run = _run_with_checkpoints(client, app, "full")
    first = client.post(f"{API}/runs/{run}/exports", json={"step": 1}).json()["id"]
    assert _work(app) == RunStatus.SUCCEEDED
    assert client.get(f"{API}/exports/{first}/download").status_code == 200
    second = client.post(f"{API}/runs/{run}/exports", json={"step": 2}).json()["id"]
    assert _work(app) == RunStatus.SUCCEEDED
    gone = client.get(f"{API}/exports/{first}/download")
    assert gone.status_code == 410 and f"replaced by the newer export {second}" in gone.json()["detail"]
    assert client.get(f"{API}/exports/{first}").json()["removed"]
    exports = Path(app.state.settings.artifacts) / "exports"
    assert [p.name for p in exports.iterdir()] == [second]
    assert client.get(f"{API}/exports/{second}/download").status_code == 200


@SQLITE_ONLY
def test_a_checkpoint_gone_or_misplaced_before_the_export_ran_fails_it_clearly(api):
    client, _, _, app = api
    run = _run_with_checkpoints(client, app, "full")
    gone = client.post(f"{API}/runs/{run}/exports", json={"step": 1}).json()["id"]
    app.state.writer.remove_checkpoint(run, 1)  # save_total_limit removed it while the export waited
    assert _work(app) == RunStatus.FAILED
    body = client.get(f"{API}/exports/{gone}").json()
    assert body["error"] == (
        f"run {run} no longer has a checkpoint at step 1 (train.save_total_limit may have removed it): its "
        "checkpoints are at steps 2"
    )
    misplaced = client.post(f"{API}/runs/{run}/exports", json={"step": 2}).json()["id"]
    app.state.writer.add_checkpoint(run, 2, "/etc", kind="full", size=1)
    assert _work(app) == RunStatus.FAILED
    assert "recorded outside the run's folder: refused" in client.get(f"{API}/exports/{misplaced}").json()["error"]
    assert not (Path(app.state.settings.artifacts) / "exports" / misplaced).exists()
