"""A run's checkpoints over the REST API, on SQLite and PostgreSQL, with real checkpoints that Collage's trainer
writes with a tiny model in-process, placed where a worker writes them: the list and its best checkpoint, the
streamed tar of a model folder (round trip byte for byte, memory bounded), and everything an attacker with a member
token might try (unknown steps, a run without checkpoints, a link out of the checkpoint, a store row naming another
folder, too many downloads at once)."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tracemalloc
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support import API
from tests.support.checkpoints import files_of, place, submit_run, trained


def _member(app, name="mallory") -> TestClient:
    from collage.app.store.tokens import create_token

    token = create_token(app.state.engine, name)
    return TestClient(app, headers={"Authorization": f"Bearer {token}"})


def _artifacts(app) -> Path:
    return Path(app.state.settings.artifacts)


def _untar(data: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for member in archive.getmembers():
            assert not member.issym() and not member.islnk() and ".." not in member.name.split("/")
            if member.isfile():
                out[member.name] = archive.extractfile(member).read()
    return out


def test_the_list_has_every_checkpoint_with_its_details_and_the_best_one(api):
    client, _, _, app = api
    run = submit_run(client, "lora", metric_for_best_model="reward")
    folders = place(app.state.writer, _artifacts(app), run, "lora", metrics={1: 0.75, 2: 0.5})
    body = client.get(f"{API}/runs/{run}/checkpoints").json()
    assert body["metric_for_best_model"] == "reward" and body["greater_is_better"] is True
    items = body["items"]
    assert [i["step"] for i in items] == [1, 2]
    for item in items:
        model = folders[item["step"]] / "model"
        assert item["kind"] == "adapter" and item["attempt"] == 1
        assert item["bytes"] == sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
        assert item["created_at"] and item["download_url"] == f"{API}/runs/{run}/checkpoints/{item['step']}/download"
    assert [(i["metric"], i["best"]) for i in items] == [(0.75, True), (0.5, False)]


def test_members_list_and_download_every_runs_checkpoints(api):
    admin, _, _, app = api
    run = submit_run(admin)
    place(app.state.writer, _artifacts(app), run, "full")
    mallory = _member(app)
    assert [i["step"] for i in mallory.get(f"{API}/runs/{run}/checkpoints").json()["items"]] == [1, 2]
    assert mallory.get(f"{API}/runs/{run}/checkpoints/last/download").status_code == 200


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_download_is_the_checkpoints_model_folder_byte_for_byte(api, kind):
    client, _, _, app = api
    run = submit_run(client, kind, metric_for_best_model="reward")
    folders = place(app.state.writer, _artifacts(app), run, kind, metrics={1: 0.9, 2: 0.1})
    expected = {step: files_of(folder / "model") for step, folder in folders.items()}
    assert expected[1] != expected[2]  # two steps of training: different weights
    for asked, step in [("1", 1), ("2", 2), ("last", 2), ("best", 1)]:
        response = client.get(f"{API}/runs/{run}/checkpoints/{asked}/download")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/x-tar"
        name = f"{run}-step-{step}"
        assert response.headers["content-disposition"] == f'attachment; filename="{name}.tar"'
        assert int(response.headers["content-length"]) == len(response.content)
        got = _untar(response.content)
        assert got == {f"{name}/{path}": data for path, data in expected[step].items()}
    # a tar tool extracts the same folder
    archive = tmp = Path(app.state.settings.home) / "x.tar"
    archive.write_bytes(client.get(f"{API}/runs/{run}/checkpoints/2/download").content)
    shutil.unpack_archive(archive, tmp.parent / "x", format="tar")
    assert files_of(tmp.parent / "x" / f"{run}-step-2") == expected[2]


def test_a_large_checkpoint_streams_in_bounded_memory(api):
    client, _, _, app = api
    run = submit_run(client)
    folders = place(app.state.writer, _artifacts(app), run, "full")
    big = folders[2] / "model" / "model-00002-of-00002.safetensors"
    size = 768 << 20
    with big.open("wb") as fh:  # sparse: no disk space, but 768 MiB to read and send
        fh.truncate(size)
    tracemalloc.start()
    try:
        received, tail = 0, b""
        with client.stream("GET", f"{API}/runs/{run}/checkpoints/2/download") as response:
            assert response.status_code == 200
            total = int(response.headers["content-length"])
            for chunk in response.iter_bytes():
                received += len(chunk)
                tail = (tail + chunk)[-1024:]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert received == total > size
    assert tail == b"\0" * 1024  # the archive's end blocks: it was sent whole
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB held while streaming a {size >> 20} MiB file"


def test_downloads_beyond_max_exports_are_429_and_a_slot_is_freed_by_the_end_of_each(api):
    client, _, _, app = api
    from collage.app.routers.downloads import export_slots

    run = submit_run(client)
    place(app.state.writer, _artifacts(app), run, "full")
    slots = export_slots(app)
    held = 0
    while slots.acquire(blocking=False):
        held += 1
    try:
        response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
        assert response.status_code == 429 and response.headers["retry-after"] == "10"
    finally:
        for _ in range(held):
            slots.release()
    for _ in range(app.state.settings.max_exports + 2):  # each download gives its slot back
        assert client.get(f"{API}/runs/{run}/checkpoints/1/download").status_code == 200


def test_unknown_steps_are_404_and_best_or_last_of_a_run_without_checkpoints_409(api):
    client, _, _, app = api
    empty = submit_run(client)
    for step in ("best", "last"):
        response = client.get(f"{API}/runs/{empty}/checkpoints/{step}/download")
        assert response.status_code == 409 and "has no checkpoint yet" in response.json()["detail"]
    response = client.get(f"{API}/runs/{empty}/checkpoints/3/download")
    assert response.status_code == 404 and "it has none yet" in response.json()["detail"]
    run = submit_run(client)
    place(app.state.writer, _artifacts(app), run, "full")
    response = client.get(f"{API}/runs/{run}/checkpoints/7/download")
    assert response.status_code == 404
    assert response.json()["detail"] == f"run {run} has no checkpoint at step 7: its checkpoints are at steps 1, 2"
    best = client.get(f"{API}/runs/{run}/checkpoints/best/download")  # the run has no metric_for_best_model
    assert best.status_code == 409 and "no train.metric_for_best_model" in best.json()["detail"]
    for bad in ("first", "-1", "1.5", "99999999999", "2147483648"):
        response = client.get(f"{API}/runs/{run}/checkpoints/{bad}/download")
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["detail"][0]["path"] == "path.step"
    for path in ("/checkpoints", "/checkpoints/1/download"):
        assert client.get(f"{API}/runs/nosuchrun{path}").status_code == 404


def test_a_link_inside_a_checkpoint_is_refused_and_never_followed(api):
    client, _, _, app = api
    run = submit_run(client)
    folders = place(app.state.writer, _artifacts(app), run, "full")
    secret = Path(app.state.settings.home) / "secret-key.txt"
    secret.write_text("the server's secret")
    os.symlink(secret, folders[1] / "model" / "tokenizer.json.link")
    response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
    assert response.status_code == 409
    assert "tokenizer.json.link is a symbolic link" in response.json()["detail"]
    assert "the server's secret" not in response.text
    # a whole model folder replaced by a link to somewhere else
    model = folders[2] / "model"
    shutil.rmtree(model)
    elsewhere = Path(app.state.settings.home) / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    os.symlink(elsewhere, model)
    response = client.get(f"{API}/runs/{run}/checkpoints/2/download")
    assert response.status_code == 409 and "{}" not in response.text


def test_a_store_row_naming_a_folder_outside_the_runs_own_is_refused(api):
    client, _, _, app = api
    victim = submit_run(client)
    victim_folders = place(app.state.writer, _artifacts(app), victim, "full")
    run = submit_run(client)
    place(app.state.writer, _artifacts(app), run, "full")
    writer = app.state.writer
    artifacts = _artifacts(app)
    outside = [
        str(victim_folders[1]),  # another run's checkpoint
        str(artifacts),  # the artifacts' root (every run's files)
        str(artifacts / "runs" / run),  # the run's own root folder, not a checkpoint inside it
        str(artifacts / "runs" / run / ".." / victim / "attempt-1" / "checkpoints" / "step-1"),
        "/etc",
        "relative/step-1",
    ]
    for path in outside:
        writer.add_checkpoint(run, 1, path, kind="full", size=1)
        response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
        assert response.status_code == 409, (path, response.status_code)
        assert "outside the run's folder" in response.json()["detail"]
    shutil.rmtree(artifacts / "runs" / run / "attempt-1" / "checkpoints" / "step-2")
    response = client.get(f"{API}/runs/{run}/checkpoints/2/download")
    assert response.status_code == 410 and "its files are gone" in response.json()["detail"]


def test_trained_checkpoints_are_real():
    """The fixtures' checkpoints come from the trainer: a LoRA run saves adapters, a full run whole models."""
    assert (trained("lora") / "checkpoints" / "step-2" / "model" / "adapter_model.safetensors").is_file()
    assert (trained("full") / "checkpoints" / "step-2" / "model" / "model.safetensors").is_file()
