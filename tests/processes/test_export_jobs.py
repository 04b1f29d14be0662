"""Export jobs run as a worker runs them (``worker/export_job.py``), with their real export process, on real
checkpoints and SQLite: the export loads and gives the checkpoint's logits, a cancel stops it at once and leaves no
files, and a token keeps its newest export while the older download says why it is gone."""

from __future__ import annotations

import io
import tarfile
import threading
from pathlib import Path

import pytest
import torch

from collage.app.core.status import RunStatus
from tests.support import API
from tests.support.checkpoints import (
    checkpoint_model,
    model_inputs,
    run_with_checkpoints,
    work_next_job,
)
from tests.support.waiting import scaled, wait_for

SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # a process per export: once


def _untar(data: bytes, dest: Path) -> Path:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        archive.extractall(dest, filter="data")
    (top,) = list(dest.iterdir())
    return top


@SQLITE_ONLY
def test_an_export_job_makes_a_folder_that_loads_with_the_checkpoints_logits(api, tmp_path):
    client, _, _, app = api
    run = run_with_checkpoints(client, app, "lora")
    job_id = client.post(f"{API}/runs/{run}/exports", json={"step": 2, "merge_lora": True}).json()["id"]
    assert work_next_job(app) == RunStatus.SUCCEEDED
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
    run = run_with_checkpoints(client, app, "lora")
    job_id = client.post(f"{API}/runs/{run}/exports", json={"merge_lora": True}).json()["id"]
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(work_next_job(app)))
    worker.start()
    wait_for(lambda: client.get(f"{API}/exports/{job_id}").json()["progress"], "the export process to report once",
             until=lambda progress: progress > 0.0, interval=0.05, timeout=120,
             gone=lambda: None if worker.is_alive() else "the export job ended")  # fmt: skip
    assert client.post(f"{API}/exports/{job_id}/cancel").json()["status"] == "cancelling"
    worker.join(timeout=scaled(60))
    assert outcome == [RunStatus.CANCELLED]
    body = client.get(f"{API}/exports/{job_id}").json()
    assert body["status"] == "cancelled" and body["download_url"] is None
    exports = Path(app.state.settings.artifacts) / "exports"
    assert list(exports.iterdir()) == []  # neither the export, its temporary folder nor its working folder


@SQLITE_ONLY
def test_a_token_keeps_its_newest_export_and_the_older_download_says_why_it_is_gone(api):
    client, _, _, app = api
    run = run_with_checkpoints(client, app, "full")
    first = client.post(f"{API}/runs/{run}/exports", json={"step": 1}).json()["id"]
    assert work_next_job(app) == RunStatus.SUCCEEDED
    assert client.get(f"{API}/exports/{first}/download").status_code == 200
    second = client.post(f"{API}/runs/{run}/exports", json={"step": 2}).json()["id"]
    assert work_next_job(app) == RunStatus.SUCCEEDED
    gone = client.get(f"{API}/exports/{first}/download")
    assert gone.status_code == 410 and f"replaced by the newer export {second}" in gone.json()["detail"]
    assert client.get(f"{API}/exports/{first}").json()["removed"]
    exports = Path(app.state.settings.artifacts) / "exports"
    assert [p.name for p in exports.iterdir()] == [second]
    assert client.get(f"{API}/exports/{second}/download").status_code == 200
