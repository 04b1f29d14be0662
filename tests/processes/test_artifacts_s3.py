"""Artifacts on object storage through the real app, on SQLite and PostgreSQL, against a real S3 server: the web
node and a "worker host" each with its own local cache folder and nothing shared but the store and the bucket.
Images and thumbnails are served from the bucket (streamed, or redirected to presigned URLs), checkpoints and
exports are downloaded by a web node that never had them, and a checkpoint without its manifest does not exist."""

from __future__ import annotations

import io
import tarfile
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support import API
from tests.support.api import RecordingDispatcher
from tests.support.s3 import s3_environment, shared_endpoint
from tests.support.waiting import scaled


@pytest.fixture
def s3(database_url, tmp_path, monkeypatch):
    """``(client, web_settings, worker_writer, app)``: the web app caches the bucket under ``web-cache``, the worker's
    writer under ``worker-cache``."""
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for
    from collage.app.store.tokens import create_token
    from collage.app.store.writer import StoreWriter

    env = s3_environment(shared_endpoint())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    web = Settings(
        home=tmp_path / "web-home", database_url=database_url, broker_url="memory://",
        artifacts=tmp_path / "web-cache", artifacts_url=env["COLLAGE_ARTIFACTS"],
        s3_endpoint_url=env["COLLAGE_S3_ENDPOINT_URL"], s3_retry_for=20,
    )  # fmt: skip
    app = create_app(web, RecordingDispatcher())
    token = create_token(engine_for(database_url), "tests", role="admin")
    worker = StoreWriter(engine_for(database_url), tmp_path / "worker-cache", mirror=web.mirror())
    return TestClient(app, headers={"Authorization": f"Bearer {token}"}), web, worker, app


def _png(colour=(200, 30, 30), size=(48, 32)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _run_with_images(client, worker) -> tuple[str, list[bytes]]:
    from collage.app.store.writer import ImageIn, SampleIn

    response = client.post(API + "/runs", json={"name": "s3", "model": {"path": "tiny:qwen2-vl"},
                                                "dataset": {"source": "synth:count-red", "rows": 8}})  # fmt: skip
    assert response.status_code == 201, response.text
    run = response.json()["id"]
    worker.transition(run, ["queued"], "running")
    pngs = [_png((200, 30, 30)), _png((30, 30, 200), (64, 40))]
    rows = [SampleIn(group=0, index=i, prompt="p", completion="c", images=[ImageIn(png=p) for p in pngs],
                     rewards={"accuracy": 1.0}, reward=1.0, advantage=0.0, completion_length=1,
                     truncated=False) for i in range(2)]  # fmt: skip
    worker.for_attempt(run, 1).append_samples(run, 1, rows)
    return run, pngs


def test_images_written_on_a_worker_host_are_served_from_the_bucket(s3):
    import hashlib

    client, web, worker, _ = s3
    run, pngs = _run_with_images(client, worker)
    for png in pngs:
        sha = hashlib.sha256(png).hexdigest()
        assert web.mirror().get_bytes(f"images/{sha[:2]}/{sha[2:4]}/{sha}.png") == png  # in the bucket
        assert not (web.artifacts / "images").exists() or not any((web.artifacts / "images").rglob(f"{sha}.png"))
        response = client.get(f"{API}/images/{sha}")
        assert response.status_code == 200 and response.content == png
        assert "immutable" in response.headers["cache-control"] and response.headers["etag"]
        thumb = client.get(f"{API}/images/{sha}", params={"size": "thumb"})
        assert thumb.status_code == 200 and thumb.content[:4] == b"\x89PNG"
        # the thumbnail went to the bucket too: another web node serves it without making it again
        assert web.mirror().get_bytes(f"thumbs/{sha[:2]}/{sha[2:4]}/{sha}.png") == thumb.content
    samples = client.get(f"{API}/runs/{run}/samples").json()
    assert len(samples["items"]) == 2


def test_with_presigned_urls_the_web_node_redirects_to_the_bucket(s3):
    import hashlib

    client, web, worker, app = s3
    _, pngs = _run_with_images(client, worker)
    app.state.settings = replace(web, s3_presign=60)
    sha = hashlib.sha256(pngs[1]).hexdigest()
    for size in ("full", "thumb"):
        response = client.get(f"{API}/images/{sha}", params={"size": size}, follow_redirects=False)
        assert response.status_code == 307, response.text
        assert response.headers["cache-control"] == "private, max-age=30"
        location = response.headers["location"]
        assert location.startswith(web.s3_endpoint_url) and "Signature" in location
        body = urllib.request.urlopen(location, timeout=scaled(10)).read()  # the browser's request, to the bucket
        assert body == pngs[1] if size == "full" else body[:4] == b"\x89PNG"
    # signed for the address browsers use (COLLAGE_S3_PUBLIC_URL), which may differ from the web node's
    public = web.s3_endpoint_url.replace("127.0.0.1", "localhost")
    app.state.settings = replace(web, s3_presign=60, s3_public_url=public)
    response = client.get(f"{API}/images/{sha}", follow_redirects=False)
    assert response.status_code == 307 and response.headers["location"].startswith(public)
    assert urllib.request.urlopen(response.headers["location"], timeout=scaled(10)).read() == pngs[1]


def _checkpoint_on_worker(worker, web, run: str, step: int, tmp: Path) -> dict[str, bytes]:
    """A checkpoint folder written on the worker host and published as the worker does: every file, manifest last,
    then recorded relative to the artifacts."""
    rel = f"runs/{run}/attempt-1/checkpoints/step-{step}"
    folder = worker.artifacts / rel
    files = {"model/config.json": b'{"a": 1}', "model/model.safetensors": bytes(range(256)) * 400,
             "trainer_state.pt": b"state"}  # fmt: skip
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    web.mirror().put_folder(rel, folder)
    worker.for_attempt(run, 1).add_checkpoint(run, step, rel, kind="full", size=len(files["model/model.safetensors"]))
    return files


def test_a_web_node_downloads_a_checkpoint_it_never_had_from_the_bucket(s3, tmp_path):
    client, web, worker, _ = s3
    run, _ = _run_with_images(client, worker)
    files = _checkpoint_on_worker(worker, web, run, 1, tmp_path)
    assert not (web.artifacts / "runs").exists()
    response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
    assert response.status_code == 200, response.text
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:") as archive:
        got = {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}
    name = f"{run}-step-1"
    assert got == {f"{name}/{k.removeprefix('model/')}": v for k, v in files.items() if k.startswith("model/")}
    listed = client.get(f"{API}/runs/{run}/checkpoints").json()
    assert [c["step"] for c in listed["items"]] == [1]


def test_a_checkpoint_removed_from_the_bucket_is_410_not_a_500(s3, tmp_path):
    client, web, worker, _ = s3
    run, _ = _run_with_images(client, worker)
    _checkpoint_on_worker(worker, web, run, 1, tmp_path)
    web.mirror().delete_folder(f"runs/{run}/attempt-1/checkpoints/step-1")
    response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
    assert response.status_code == 410, response.text
    assert "gone" in response.json()["detail"]


@pytest.mark.parametrize("damage", ["a name outside", "a file that differs"])
def test_a_checkpoint_whose_bucket_copy_is_damaged_is_a_502_naming_it_not_a_500(s3, tmp_path, damage):
    """A MANIFEST.json tampered to name ``../`` files, or a file that no longer matches its manifest: nothing is
    written outside the web node's cache, and the download says what is wrong with the bucket's copy."""
    import json

    client, web, worker, _ = s3
    run, _ = _run_with_images(client, worker)
    _checkpoint_on_worker(worker, web, run, 1, tmp_path)
    bucket, rel = web.mirror(), f"runs/{run}/attempt-1/checkpoints/step-1"
    if damage == "a name outside":
        manifest = bucket.manifest(rel)
        manifest["files"]["../../../escaped.txt"] = next(iter(manifest["files"].values()))
        bucket.put_bytes(f"{rel}/MANIFEST.json", json.dumps(manifest).encode())
        expected = "names a file outside its folder"
    else:
        bucket.put_bytes(f"{rel}/model/config.json", b'{"tampered": true}')
        expected = "does not match its manifest"
    response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
    assert response.status_code == 502, response.text
    assert expected in response.json()["detail"] and "bucket" in response.json()["detail"]
    assert not list(web.artifacts.parent.rglob("escaped.txt"))


def test_a_checkpoint_download_while_the_bucket_is_unreachable_is_503_with_retry_after(s3, tmp_path):
    from tests.support.services import free_port

    client, web, worker, app = s3
    run, _ = _run_with_images(client, worker)
    _checkpoint_on_worker(worker, web, run, 1, tmp_path)
    app.state.settings = replace(web, s3_endpoint_url=f"http://127.0.0.1:{free_port()}", s3_retry_for=1)
    response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
    assert response.status_code == 503 and response.headers["retry-after"], response.text
    assert "unreachable" in response.json()["detail"]


def test_a_store_row_naming_a_path_outside_the_runs_folder_is_refused_with_object_storage(s3, tmp_path):
    client, web, worker, _ = s3
    run, _ = _run_with_images(client, worker)
    worker.for_attempt(run, 1).add_checkpoint(run, 3, "runs/another-run/attempt-1/checkpoints/step-3", kind="full")
    worker.for_attempt(run, 1).add_checkpoint(run, 4, "../../etc", kind="full")
    for step in (3, 4):
        response = client.get(f"{API}/runs/{run}/checkpoints/{step}/download")
        assert response.status_code == 409, response.text


def test_a_bucket_unreachable_past_the_retry_window_fails_the_write_naming_it_and_writes_no_row(s3, monkeypatch):
    """The rollout rows of a step are written only after their images: with the bucket gone for longer than
    COLLAGE_S3_RETRY_FOR, the store callback's writer raises one StorageError naming the endpoint (the child turns
    it into the run's failure, one event) and the step has no row without its image."""
    import hashlib

    from collage.app.store.writer import StoreWriter
    from collage.training.callbacks import RolloutImage, RolloutRow
    from collage.training.infra.objectstore import ObjectMirror, StorageError
    from collage.worker.store_callback import StoreCallback
    from tests.support.services import free_port

    client, web, worker, _ = s3
    run, _ = _run_with_images(client, worker)
    dead = ObjectMirror(web.artifacts_url, f"http://127.0.0.1:{free_port()}", retry_for=1)
    writer = StoreWriter(worker.engine, worker.artifacts, mirror=dead).for_attempt(run, 1)
    callback = StoreCallback(writer, run)
    png = _png((1, 2, 3))
    image = RolloutImage(hashlib.sha256(png).hexdigest(), png, 8, 8)
    row = RolloutRow(step=2, group=0, index=0, prompt="p", completion="c", images=[image], rewards={"accuracy": 0.0},
                     reward=0.0, advantage=0.0, completion_length=1, truncated=False, row=0)  # fmt: skip
    callback.on_samples(2, [row])
    with pytest.raises(StorageError, match=r"127\.0\.0\.1.*failed for 1 s"):
        callback.close()
    assert client.get(f"{API}/runs/{run}/samples", params={"step": 2}).json()["items"] == []


def test_a_data_check_made_on_one_host_is_found_by_another_through_the_bucket(count_red_dir, tmp_path, monkeypatch):
    """The checks cache is shared through the bucket (``checks/<fingerprint>.json``): a host with an empty home
    gets the report another host made, without checking again."""
    from collage.training.data import check

    for name, value in s3_environment(shared_endpoint()).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "host-a"))
    made = check.check_dataset(str(count_red_dir))
    assert made.rows > 0 and list((tmp_path / "host-a").rglob("checks/*.json"))
    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "host-b"))
    monkeypatch.setattr(check, "run_check", lambda *a, **k: pytest.fail("host B checked again"))
    found = check.check_dataset(str(count_red_dir))
    assert (found.rows, found.images_per_row, found.errors) == (made.rows, made.images_per_row, made.errors)
    assert list((tmp_path / "host-b").rglob("checks/*.json"))


def _upload(client, png: bytes):
    return client.post(API + "/images", files={"file": ("x.png", png, "image/png")})


def _noise(seed: int, size=(400, 400)) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_an_upload_refused_by_its_quota_never_reaches_the_bucket(s3):
    import hashlib

    from collage.app.store.images import relative_path

    client, web, _, app = s3
    app.state.settings = replace(web, upload_quota_mb=1)
    first = _upload(client, _noise(0))
    assert first.status_code == 201, first.text
    refused = [_noise(seed) for seed in (1, 2, 3, 4)]
    assert [_upload(client, png).status_code for png in refused] == [201, 429, 429, 429]
    bucket = web.mirror()
    assert bucket is not None and bucket.exists(relative_path(first.json()["sha256"]))
    for png in refused[1:]:
        assert not bucket.exists(relative_path(hashlib.sha256(png).hexdigest()))  # not even for a moment
    assert not list(Path(web.artifacts).rglob(".upload-*"))


def test_an_upload_the_bucket_cannot_take_is_503_and_not_kept(s3):
    """The upload is charged first, then written: a bucket that does not answer (past COLLAGE_S3_RETRY_FOR) takes
    the charge back, leaves no row and no local file, and the token's quota is as it was."""
    from sqlmodel import Session, select

    from collage.app.store.tables import Image, Upload
    from tests.support.services import free_port

    client, web, _, app = s3
    app.state.settings = replace(web, s3_endpoint_url=f"http://127.0.0.1:{free_port()}", s3_retry_for=1)
    response = _upload(client, _noise(9))
    assert response.status_code == 503 and "not kept" in response.json()["detail"], response.text
    with Session(app.state.engine) as session:
        assert list(session.exec(select(Upload))) == [] and list(session.exec(select(Image))) == []
    assert not list(Path(web.artifacts).rglob("*.png"))
    assert client.get(API + "/uploads").json()["used_bytes"] == 0
    app.state.settings = web  # the bucket is back: the same upload is taken
    assert _upload(client, _noise(9)).status_code == 201


def _damage(path: Path) -> None:
    """The same size, other bytes: only the SHA-256 tells it from the manifest's."""
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])


@pytest.fixture
def resumed(s3, database_url, tmp_path, monkeypatch):
    """``(client, web, run, make_attempt)``: a run whose attempt 1 published checkpoints 3, 6 and 9 to the bucket from
    the worker host, now resumed as attempt 2 on a host of its own (its own home and cache of the bucket)."""
    from collage.app.core.settings import get_settings
    from collage.worker.child import Attempt

    client, web, worker, _ = s3
    run, _ = _run_with_images(client, worker)
    for step in (3, 6, 9):
        _checkpoint_on_worker(worker, web, run, step, tmp_path)
    assert worker.transition(run, ["running"], "failed")
    assert worker.transition(run, ["failed"], "queued", attempt=2)
    assert worker.transition(run, ["queued"], "running")
    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "resuming-host"))
    monkeypatch.setenv("COLLAGE_DATABASE_URL", database_url)
    get_settings.cache_clear()
    yield client, web, run, lambda: Attempt(run, 2)
    get_settings.cache_clear()


def _warnings(client, run: str) -> list[str]:
    return [e["message"] for e in client.get(f"{API}/runs/{run}/events").json()["items"] if e["level"] == "warning"]


def _linked(attempt) -> dict[str, Path]:
    folder = attempt.out / "checkpoints"
    return {p.name: p.resolve() for p in folder.iterdir()} if folder.is_dir() else {}


@pytest.mark.parametrize("cached", [False, True], ids=["not cached", "a damaged cached copy too"])
@pytest.mark.parametrize("keep_limit", [False, True], ids=["no limit", "save_total_limit"])
def test_a_resume_skips_a_damaged_newest_checkpoint_for_the_newest_intact_one(resumed, cached, keep_limit):
    """Steps 3, 6 and 9 were published, then step 9's weights in the bucket stopped matching the manifest: the
    resumed attempt continues from step 6, and the run's events say which checkpoint was skipped and why."""
    from collage.training.infra.objectstore import ensure_local_folder

    client, web, run, make_attempt = resumed
    rel = f"runs/{run}/attempt-1/checkpoints/step-{{}}"
    bucket = web.mirror()
    attempt = make_attempt()
    if cached:  # this host fetched it earlier, and its copy was damaged since
        assert ensure_local_folder(attempt.settings.artifacts, attempt.settings.artifacts / rel.format(9), bucket)
        _damage(attempt.settings.artifacts / rel.format(9) / "model/model.safetensors")
    weights = bytes(range(256)) * 400
    bucket.put_bytes(f"{rel.format(9)}/model/model.safetensors", bytes([weights[0] ^ 0xFF]) + weights[1:])
    newest = attempt.link_earlier_checkpoints(keep_limit=keep_limit)
    assert newest == attempt.settings.artifacts / rel.format(6)
    assert (newest / "model/model.safetensors").read_bytes() == weights
    expected = {"step-6"} | ({"step-3"} if keep_limit else set())
    assert set(_linked(attempt)) == expected  # the trainer resumes from the newest linked one
    warnings = _warnings(client, run)
    assert len(warnings) == 1, warnings
    assert f"checkpoint step 9 ({rel.format(9)}) was skipped" in warnings[0]
    assert "model/model.safetensors does not match its manifest" in warnings[0]
    assert "resuming from step 6" in warnings[0]


def test_a_worker_s_damaged_cached_copy_of_an_intact_checkpoint_is_fetched_again_and_used(resumed):
    from collage.training.infra.objectstore import ensure_local_folder

    client, web, run, make_attempt = resumed
    attempt = make_attempt()
    cached = attempt.settings.artifacts / f"runs/{run}/attempt-1/checkpoints/step-9"
    assert ensure_local_folder(attempt.settings.artifacts, cached, web.mirror())
    _damage(cached / "model/model.safetensors")
    (cached / "trainer_state.pt").unlink()
    assert attempt.link_earlier_checkpoints() == cached
    assert (cached / "model/model.safetensors").read_bytes() == bytes(range(256)) * 400
    assert (cached / "trainer_state.pt").read_bytes() == b"state"
    assert set(_linked(attempt)) == {"step-9"} and _warnings(client, run) == []


def test_a_resume_with_every_checkpoint_damaged_fails_the_run_naming_each(resumed):
    from collage.worker.child import EXIT_FAILED, begin

    client, web, run, make_attempt = resumed
    for step in (3, 6, 9):
        web.mirror().put_bytes(f"runs/{run}/attempt-1/checkpoints/step-{step}/trainer_state.pt", b"other")
    assert begin(make_attempt()) == EXIT_FAILED
    body = client.get(f"{API}/runs/{run}").json()
    assert body["status"] == "failed"
    assert "no recorded checkpoint can be resumed from" in body["error"]
    assert all(f"step {step}: " in body["error"] for step in (3, 6, 9)), body["error"]


@pytest.mark.parametrize("bucket_copy", ["intact", "damaged"])
def test_a_web_node_s_damaged_cached_checkpoint_is_fetched_again_or_502(s3, tmp_path, bucket_copy):
    """A web node that served a checkpoint keeps it in its cache: a copy damaged since is checked against the
    manifest at the next download, and fetched again (or, with the bucket's copy damaged too, a 502 naming it)."""
    client, web, worker, _ = s3
    run, _ = _run_with_images(client, worker)
    files = _checkpoint_on_worker(worker, web, run, 1, tmp_path)
    assert client.get(f"{API}/runs/{run}/checkpoints/1/download").status_code == 200  # now in the web's cache
    rel = f"runs/{run}/attempt-1/checkpoints/step-1"
    _damage(web.artifacts / rel / "model/model.safetensors")
    if bucket_copy == "damaged":
        web.mirror().put_bytes(f"{rel}/model/model.safetensors", b"other bytes")
    response = client.get(f"{API}/runs/{run}/checkpoints/1/download")
    if bucket_copy == "damaged":
        assert response.status_code == 502, response.text
        assert "model/model.safetensors does not match its manifest" in response.json()["detail"]
        return
    assert response.status_code == 200, response.text
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:") as archive:
        got = archive.extractfile(f"{run}-step-1/model.safetensors").read()
    assert got == files["model/model.safetensors"]
