"""Checkpoints and exports end to end through a real Celery worker process (Redis, PostgreSQL, the real dispatcher): a
LoRA run trained over REST writes its checkpoints, the API lists and streams them byte for byte, an export job runs
on the worker and its download loads and runs on a two-image prompt; an export waits behind the training its worker
is busy with (its place shown) and a cancel ends it there."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import torch

from tests.support import API
from tests.support.checkpoints import LORA, files_of, model_inputs
from tests.support.cluster import run_config
from tests.support.waiting import wait_for

SMALL = {"max_steps": 2, "save_steps": 1, "per_device_train_batch_size": 8, "num_generations": 4,
         "max_completion_length": 6, "max_prompt_length": 256, "learning_rate": 5e-3}  # fmt: skip


def _untar(data: bytes, dest: Path) -> Path:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        archive.extractall(dest, filter="data")
    (top,) = list(dest.iterdir())
    return top


def test_a_runs_checkpoints_download_and_export_through_a_real_worker(cluster, tmp_path):
    cluster.start_worker("w1")
    config = run_config(rewards=[{"name": "numeric"}, {"name": "accuracy"}])
    config["model"] = {**config["model"], "lora": LORA}
    config["train"] = {**config["train"], **SMALL}
    response = cluster.client.post(API + "/runs", json=config)
    assert response.status_code == 201, response.text
    run_id = response.json()["id"]
    run = cluster.wait_status(run_id, ("succeeded", "failed"))
    assert run["status"] == "succeeded", (run["error"], cluster.events(run_id))

    items = cluster.client.get(f"{API}/runs/{run_id}/checkpoints").json()["items"]
    assert [(i["step"], i["kind"], i["attempt"]) for i in items] == [(1, "adapter", 1), (2, "adapter", 1)]
    on_disk = Path(cluster.settings.artifacts) / "runs" / run_id / "attempt-1" / "checkpoints" / "step-2" / "model"
    assert items[1]["bytes"] == sum(p.stat().st_size for p in on_disk.iterdir())
    download = cluster.client.get(f"{API}/runs/{run_id}/checkpoints/last/download")
    assert download.status_code == 200
    assert files_of(_untar(download.content, tmp_path / "checkpoint")) == files_of(on_disk)

    made = cluster.client.post(f"{API}/runs/{run_id}/exports", json={"step": "last", "merge_lora": True})
    assert made.status_code == 202, made.text
    job_id = made.json()["id"]
    job = wait_for(
        lambda: cluster.client.get(f"{API}/exports/{job_id}").json(),
        f"export {job_id} to end",
        until=lambda j: j["status"] in ("succeeded", "failed"),
        timeout=240,
        logs=list(cluster.logs.values()),
    )
    assert job["status"] == "succeeded", job
    exported = _untar(cluster.client.get(job["download_url"]).content, tmp_path / "export")
    assert exported.name == f"{run_id}-step-2-merged"
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(exported)
    model = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32).eval()
    inputs = model_inputs(processor)
    with torch.no_grad():
        logits = model(**inputs).logits
        other = model(**model_inputs(processor, seed=1)).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, other)  # it sees its images
    assert model.generate(**inputs, max_new_tokens=3, do_sample=False).shape[1] > inputs["input_ids"].shape[1]

    # the worker is busy training: an export waits behind it, with its place, and a cancel ends it there
    busy = run_config(max_steps=30, delay=0.3)
    busy_id = cluster.client.post(API + "/runs", json=busy).json()["id"]
    cluster.wait_step(busy_id, 1)
    waiting = cluster.client.post(f"{API}/runs/{run_id}/exports", json={"step": 1}).json()["id"]
    state = cluster.client.get(f"{API}/exports/{waiting}").json()
    assert state["status"] == "queued" and state["queue_position"] == 1
    assert cluster.client.post(f"{API}/exports/{waiting}/cancel").json()["status"] == "cancelled"
    assert cluster.client.post(f"{API}/runs/{busy_id}/cancel").status_code == 200
    cluster.wait_status(busy_id, ("cancelled", "failed", "succeeded"), timeout=120)
    assert not (Path(cluster.settings.artifacts) / "exports" / waiting).exists()
