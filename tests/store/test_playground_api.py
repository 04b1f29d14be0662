"""The playground's routes on the real app in-process and the store (SQLite and PostgreSQL): image uploads (formats,
size, pixel and quota bounds, metadata stripped), and the validation, resolution, queueing, visibility and cancel of
generations. The worker side is in tests/processes/test_playground_worker.py, the page in
tests/browser/test_dash_playground.py."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import replace

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image, PngImagePlugin
from sqlalchemy import select
from sqlmodel import Session

from collage.app.store.tables import Job, Upload
from tests.support import API
from tests.support.api import RecordingDispatcher, config, count_rows
from tests.support.live_server import at_once, serving
from tests.support.waiting import scaled

PIXELS = 1_000_000  # the pixel bound of these tests' app


@pytest.fixture
def play(database_url, tmp_path):
    """``(client, app, dispatcher)``: the app with small upload bounds, an admin client; models under tmp/models."""
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for
    from collage.app.store.tokens import create_token

    settings = Settings(home=tmp_path, database_url=database_url, broker_url="memory://",
                        artifacts=tmp_path / "artifacts", model_roots=(tmp_path / "models",),
                        upload_max_bytes=600_000, upload_max_pixels=PIXELS, upload_quota_mb=1,
                        playground_per_user=3, playground_max_images=4)  # fmt: skip
    dispatcher = RecordingDispatcher()
    app = create_app(settings, dispatcher)
    token = create_token(engine_for(database_url), "admin", role="admin")
    return TestClient(app, headers={"Authorization": f"Bearer {token}"}), app, dispatcher


def member(app, name: str) -> TestClient:
    from collage.app.store.tokens import create_token

    return TestClient(app, headers={"Authorization": f"Bearer {create_token(app.state.engine, name)}"})


def encoded(fmt: str, size=(40, 30), colour=(200, 30, 30), mode="RGB", **params) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format=fmt, **params)
    return buf.getvalue()


def noise_png(seed: int, size=(400, 400)) -> bytes:
    """A PNG that compresses badly (about 3 bytes a pixel), for the quota."""
    import random

    rng = random.Random(seed)
    image = Image.frombytes("RGB", size, bytes(rng.getrandbits(8) for _ in range(size[0] * size[1] * 3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def upload(client: TestClient, data: bytes, name: str = "x.png", ctype: str = "application/octet-stream"):
    return client.post(API + "/images", files={"file": (name, data, ctype)})


def field_error(response, status: int = 422) -> tuple[str, str]:
    assert response.status_code == status, response.text
    detail = response.json()["detail"][0]
    return detail["path"], detail["message"]


# ------------------------------------------------------------------------------------------------------ uploads
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_png_jpeg_and_webp_are_stored_as_plain_png(play, fmt):
    client, app, _ = play
    response = upload(client, encoded(fmt), f"x.{fmt.lower()}")
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["width"], body["height"], body["new"]) == (40, 30, True)
    stored = client.get(body["url"])
    assert stored.status_code == 200 and stored.headers["content-type"] == "image/png"
    import hashlib

    assert hashlib.sha256(stored.content).hexdigest() == body["sha256"] and len(stored.content) == body["bytes"]
    with Image.open(io.BytesIO(stored.content)) as image:
        assert image.format == "PNG" and image.mode == "RGB" and image.size == (40, 30)
        assert abs(image.getpixel((5, 5))[0] - 200) <= 8  # the pixels survive (JPEG and WebP are lossy)
    # the same image again by the same token: the same hash, not counted twice
    again = upload(client, encoded(fmt), f"y.{fmt.lower()}")
    assert again.status_code == 201 and again.json()["sha256"] == body["sha256"] and again.json()["new"] is False
    mine = client.get(API + "/uploads").json()
    assert [i["sha256"] for i in mine["items"]] == [body["sha256"]] and mine["used_bytes"] == body["bytes"]


def _png_with_metadata() -> bytes:
    info = PngImagePlugin.PngInfo()
    info.add_text("Author", "secret-author")
    info.add_text("GPS", "51.5N 0.1W")
    buf = io.BytesIO()
    image = Image.new("RGB", (16, 12), (10, 200, 10))
    image.save(buf, format="PNG", pnginfo=info, icc_profile=b"not-really-an-icc-profile" * 4, dpi=(300, 300))
    return buf.getvalue()


def _jpeg_with_exif() -> bytes:
    """A 20x10 JPEG whose EXIF says: rotate 90 degrees to show it (orientation 6), with a camera make."""
    image = Image.new("RGB", (20, 10), (0, 0, 220))
    image.paste((250, 250, 0), (0, 0, 4, 10))  # a yellow band on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    exif[0x010F] = "SecretCam"  # make
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif, quality=95)
    return buf.getvalue()


def test_a_reencoded_upload_keeps_no_metadata_and_is_upright(play):
    client, _, _ = play
    for data in (_png_with_metadata(), _jpeg_with_exif()):
        assert b"secret" in data.lower() or b"Secret" in data
        body = upload(client, data).json()
        stored = client.get(body["url"]).content
        assert b"secret" not in stored.lower() and b"SecretCam" not in stored and b"GPS" not in stored
        chunks = _png_chunks(stored)
        assert set(chunks) <= {b"IHDR", b"IDAT", b"IEND"}, chunks  # no tEXt, iCCP, pHYs, eXIf
        with Image.open(io.BytesIO(stored)) as image:
            assert not image.info and not image.getexif()
    # the EXIF orientation was applied before it was dropped: the 20x10 photo shows 10x20, the band on top
    rotated = client.get(upload(client, _jpeg_with_exif()).json()["url"]).content
    with Image.open(io.BytesIO(rotated)) as image:
        assert image.size == (10, 20)
        top, bottom = image.getpixel((5, 1)), image.getpixel((5, 18))
        assert top[0] > 200 and top[1] > 200 and bottom[2] > 150 and bottom[0] < 60, (top, bottom)


def _png_chunks(data: bytes) -> list[bytes]:
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        chunks.append(data[pos + 4 : pos + 8])
        pos += 12 + length
    return chunks


def _eps() -> bytes:
    return b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n(/etc/passwd) (r) file\nshowpage\n"


@pytest.mark.parametrize(
    "data, expected",
    [
        (encoded("GIF"), "not a PNG, JPEG or WebP image"),
        (encoded("BMP"), "not a PNG, JPEG or WebP image"),
        (encoded("TIFF"), "not a PNG, JPEG or WebP image"),
        (_eps(), "not a PNG, JPEG or WebP image"),
        (b"just some text, not an image at all", "not a PNG, JPEG or WebP image"),
        (b"", "is empty"),
        (encoded("PNG")[:60], "unreadable"),  # a cut-off PNG
    ],
    ids=["gif", "bmp", "tiff", "eps", "text", "empty", "truncated"],
)
def test_anything_but_png_jpeg_and_webp_is_refused_naming_the_field(play, data, expected):
    client, app, _ = play
    path, message = field_error(upload(client, data, "x.png", "image/png"))
    assert path == "file" and expected in message, message
    assert count_rows(app, Upload) == 0


def _bomb(width: int, height: int) -> bytes:
    """A PNG header announcing ``width x height`` pixels, followed by a few KB of compressed zero rows."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (1 + 3 * width) * 64, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_it_is_decoded(play):
    client, _, _ = play
    import resource

    for width, height in [(1001, 1000), (30_000, 30_000), (100_000, 100_000)]:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        path, message = field_error(upload(client, _bomb(width, height)))
        assert path == "file" and ("pixels, more than the" in message or "too large to decode" in message), message
        # nothing near width x height x 3 bytes was ever allocated (1 GB for the smallest real bomb here)
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB
    assert upload(client, encoded("PNG", size=(1000, 1000))).status_code == 201  # exactly the bound: accepted


def test_an_oversize_upload_is_413_while_it_is_read(play):
    client, _, _ = play
    just_over = b"\x89PNG\r\n\x1a\n" + b"\x00" * (600_000 - 7)  # one byte over the file bound, inside the frame slack
    response = upload(client, just_over)
    assert response.status_code == 413 and "COLLAGE_UPLOAD_MAX_BYTES" in response.json()["detail"]
    huge = upload(client, b"\x00" * 5_000_000)  # far over: the body limit stops it as it arrives
    assert huge.status_code == 413 and "larger than" in huge.json()["detail"]

    def chunked():  # no Content-Length: the bytes are counted as they come
        for _ in range(100):
            yield b"--b\r\nContent-Disposition: form-data; name=file; filename=x\r\n\r\n" + b"\x00" * 65536

    streamed = client.post(
        API + "/images", content=chunked(), headers={"Content-Type": "multipart/form-data; boundary=b"}
    )
    assert streamed.status_code == 413, streamed.text
    # the JSON routes keep their 1 MiB bound
    assert client.post(API + "/generate", content=b"{" + b" " * 1_100_000 + b"}",
                       headers={"Content-Type": "application/json"}).status_code == 413  # fmt: skip


def test_the_upload_quota_is_per_token_and_clear(play):
    client, app, _ = play
    alice, bob = member(app, "alice"), member(app, "bob")
    images = [noise_png(i) for i in range(3)]
    assert all(400_000 < len(d) < 600_000 for d in images), [len(d) for d in images]
    assert upload(alice, images[0]).status_code == 201
    assert upload(alice, images[1]).status_code == 201
    over = upload(alice, images[2])
    assert over.status_code == 429, over.text
    assert "quota of 1048576 bytes" in over.json()["detail"] and "COLLAGE_UPLOAD_QUOTA_MB" in over.json()["detail"]
    assert upload(alice, images[0]).status_code == 201  # one already uploaded still answers (not counted again)
    assert upload(bob, images[2]).status_code == 201  # another token's quota is its own
    usage = alice.get(API + "/uploads").json()
    assert len(usage["items"]) == 2 and usage["quota_bytes"] == 1 << 20 and usage["used_bytes"] <= 1 << 20
    assert count_rows(app, Upload) == 3


def stored_files(app) -> tuple[set[str], list[str]]:
    """The images on disk (their hashes) and any file left under a temporary name."""
    root = app.state.settings.artifacts
    images = {p.stem for p in (root / "images").rglob("*.png")} if (root / "images").exists() else set()
    staged = [str(p) for p in root.rglob(".upload-*")] if root.exists() else []
    return images, staged


def uploaded_hashes(app) -> set[str]:
    with Session(app.state.engine) as session:
        return set(session.scalars(select(Upload.sha256)))


def noise_jpeg(seed: int, size=(900, 900), quality: int = 10) -> bytes:
    """A JPEG of noise: small on the wire, about twenty times larger once re-encoded as a PNG of its pixels."""
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def test_a_refused_upload_leaves_no_file_and_no_row(play):
    """Over the quota (429), or growing too much once re-encoded (422): nothing lands on the disk; what is on disk
    is exactly what is recorded (the first 19 refused uploads used to leave their files, referenced by nothing)."""
    client, app, _ = play
    alice = member(app, "alice")
    accepted = [upload(alice, noise_png(i)) for i in range(2)]
    assert [r.status_code for r in accepted] == [201, 201]
    for seed in range(3, 8):  # each distinct, each over what is left of the quota
        assert upload(alice, noise_png(seed)).status_code == 429
    grown = noise_jpeg(1)
    assert len(grown) < 600_000
    path, message = field_error(upload(alice, grown, "noise.jpg"))
    assert path == "file" and "re-encodes to a PNG of" in message and "times what was sent" in message
    images, staged = stored_files(app)
    assert staged == [] and images == uploaded_hashes(app) == {r.json()["sha256"] for r in accepted}
    assert alice.get(API + "/uploads").json()["used_bytes"] == sum(r.json()["bytes"] for r in accepted)


def test_every_tokens_uploads_together_stay_under_the_servers_budget_and_its_free_disk(play):
    """COLLAGE_UPLOAD_BUDGET_MB bounds all tokens' uploads together (507, naming it), and an upload that would leave
    the disk with less than COLLAGE_MIN_FREE_DISK_MB free is refused before its bytes are staged."""
    client, app, _ = play
    app.state.settings = replace(app.state.settings, upload_quota_mb=10, upload_budget_mb=1)
    alice, bob = member(app, "alice"), member(app, "bob")
    assert upload(alice, noise_png(0)).status_code == 201
    assert upload(bob, noise_png(1)).status_code == 201
    over = upload(bob, noise_png(2))
    assert over.status_code == 507 and "COLLAGE_UPLOAD_BUDGET_MB" in over.json()["detail"], over.text
    app.state.settings = replace(app.state.settings, upload_budget_mb=100, min_free_disk_mb=1 << 40)
    full = upload(bob, noise_png(3))
    assert full.status_code == 507 and "COLLAGE_MIN_FREE_DISK_MB" in full.json()["detail"], full.text
    images, staged = stored_files(app)
    assert staged == [] and images == uploaded_hashes(app) and len(images) == 2


def test_a_missing_or_misnamed_file_field_is_named(play):
    client, _, _ = play
    path, message = field_error(client.post(API + "/images", files={"image": ("x.png", encoded("PNG"))}))
    assert path == "file" and "field named file" in message
    path, _ = field_error(client.post(API + "/images", json={"file": "x"}))
    assert path == "file"
    path, _ = field_error(client.post(API + "/images", data={"file": "not a file"}))
    assert path == "file"


# --------------------------------------------------------------------------------------------------- generation
def _run_with_checkpoints(app, client, steps=(2, 4), metrics=(None, None), **changes) -> str:
    run = client.post(API + "/runs", json=config(**changes)).json()["id"]
    for step, metric in zip(steps, metrics, strict=True):
        folder = app.state.settings.artifacts / "runs" / run / "attempt-1" / "checkpoints" / f"step-{step}"
        app.state.writer.add_checkpoint(run, step, str(folder), kind="full", size=10, metric=metric)
    return run


def _request(**changes) -> dict:
    body = {"models": [{"path": "tiny:qwen2-vl"}], "prompt": "How many red shapes?", "images": [],
            "num_generations": 2, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}  # fmt: skip
    body.update(changes)
    return body


def test_generate_validates_models_steps_paths_and_images(play, tmp_path):
    client, app, dispatcher = play
    run = _run_with_checkpoints(app, client)
    bare = client.post(API + "/runs", json=config()).json()["id"]
    sha = upload(client, encoded("PNG")).json()["sha256"]
    # unknown step: 404 naming the steps there are; unknown run: 404
    response = client.post(API + "/generate", json=_request(models=[{"run": run, "step": 3}]))
    assert response.status_code == 404 and "no checkpoint at step 3" in response.json()["detail"]
    assert "its checkpoints are at steps 2, 4" in response.json()["detail"]
    assert client.post(API + "/generate", json=_request(models=[{"run": "nope"}])).status_code == 404
    # best without a metric for it: 409 saying why
    best = client.post(API + "/generate", json=_request(models=[{"run": run, "step": "best"}]))
    assert best.status_code == 409 and "has no train.metric_for_best_model" in best.json()["detail"]
    # a run without checkpoints: 409 (its last one); a step of it: 404
    response = client.post(API + "/generate", json=_request(models=[{"run": bare}]))
    assert response.status_code == 409 and "no checkpoint yet" in response.json()["detail"]
    assert client.post(API + "/generate", json=_request(models=[{"run": bare, "step": 1}])).status_code == 404
    # paths outside the roots, relative paths and hub ids: 422 naming the field; a path under the roots is fine
    for path in ["/etc", str(tmp_path / "models" / ".." / "secret"), "models/x", "Qwen/Qwen2-VL-2B-Instruct",
                 "tiny:gpt2"]:  # fmt: skip
        field, message = field_error(client.post(API + "/generate", json=_request(models=[{"path": path}])))
        assert field == "models[0].path", (path, field)
    assert (
        "COLLAGE_MODEL_ROOTS"
        in field_error(client.post(API + "/generate", json=_request(models=[{"path": "/etc"}])))[1]
    )
    ok = client.post(API + "/generate", json=_request(models=[{"path": str(tmp_path / "models" / "m")}]))
    assert ok.status_code == 202, ok.text
    # an unknown image hash: 422 naming the image; too many images: 422
    field, message = field_error(client.post(API + "/generate", json=_request(images=[sha, "0" * 64])))
    assert field == "images[1]" and "upload it first" in message
    field, _ = field_error(client.post(API + "/generate", json=_request(images=[sha] * 5)))
    assert field == "images"
    # bounds on every number, and the shape of the request
    for change, where in [({"num_generations": 0}, "num_generations"), ({"num_generations": 17}, "num_generations"),
                          ({"temperature": -0.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"max_new_tokens": 0}, "max_new_tokens"),
                          ({"max_new_tokens": 5000}, "max_new_tokens"), ({"models": []}, "models"),
                          ({"models": [{"path": "tiny:qwen2-vl"}] * 3}, "models"), ({"seed": -1}, "seed"),
                          ({"models": [{"run": run, "path": "tiny:qwen2-vl"}]}, "models[0]"), ({"extra": 1}, "extra"),
                          ({"prompt": "x" * 20_001}, "prompt"), ({"answer": "a\x00b"}, "answer")]:  # fmt: skip
        field, _ = field_error(client.post(API + "/generate", json=_request(**change)))
        assert field.startswith(where), (change, field)
    assert len(dispatcher.jobs) == 1  # only the valid request was queued


def test_a_generation_is_queued_on_its_runs_queue_and_seen_only_by_its_owner(play):
    client, app, dispatcher = play
    alice, bob = member(app, "alice"), member(app, "bob")
    run = _run_with_checkpoints(app, client, metrics=(0.5, 0.25), resources={"gpus": 0, "queue": "gpu-a"},
                                train={"max_steps": 5, "metric_for_best_model": "reward"})  # fmt: skip
    sha = upload(alice, encoded("PNG")).json()["sha256"]
    body = _request(models=[{"run": run, "step": "best"}, {"path": "tiny:qwen2-vl"}], prompt="What is [image 1]?",
                    images=[sha], answer="3")  # fmt: skip
    created = alice.post(API + "/generate", json=body)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    assert dispatcher.jobs == [(job_id, "gpu-a")]
    with Session(app.state.engine) as session:
        job = session.get(Job, job_id)
    assert job.kind == "generate" and job.queue == "gpu-a" and job.run_id == run
    first, second = job.request["models"]
    folder = app.state.settings.artifacts / "runs" / run / "attempt-1" / "checkpoints" / "step-2"
    assert first["step"] == 2 and first["path"] == f"{folder}/model" and first["kind"] == "full"
    assert [r["name"] for r in first["rewards"]] == ["accuracy", "numeric"] and first["base"] == "tiny:qwen2-vl"
    assert second["kind"] == "base" and [r["name"] for r in second["rewards"]] == ["accuracy", "format"]
    assert job.request["prompt"][0]["content"][1] == {"type": "image"} and job.request["images"] == [sha]
    seen = alice.get(f"{API}/generate/{job_id}").json()
    assert seen["status"] == "queued" and seen["queue_position"] == 1 and seen["results"] == []
    assert "no live worker takes queue 'gpu-a'" in seen["message"]
    assert [m["label"] for m in seen["models"]] == ["api-test · best = step 2", "tiny:qwen2-vl"]
    # another member cannot see or cancel it (not even learn that it exists); an admin can
    assert bob.get(f"{API}/generate/{job_id}").status_code == 404
    assert bob.post(f"{API}/generate/{job_id}/cancel").status_code == 404
    assert client.get(f"{API}/generate/{job_id}").status_code == 200
    assert alice.post(f"{API}/generate/{job_id}/cancel").json()["status"] == "cancelled"
    assert alice.get(f"{API}/generate/{job_id}").json()["status"] == "cancelled"


def test_a_token_has_a_bounded_number_of_generations_in_flight(play):
    client, app, dispatcher = play
    alice = member(app, "alice")
    made = [alice.post(API + "/generate", json=_request()) for _ in range(3)]
    assert [r.status_code for r in made] == [202, 202, 202]
    refused = alice.post(API + "/generate", json=_request())
    assert refused.status_code == 429 and "COLLAGE_PLAYGROUND_PER_USER" in refused.json()["detail"]
    assert client.post(API + "/generate", json=_request()).status_code == 202  # another token: its own bound
    alice.post(f"{API}/generate/{made[0].json()['id']}/cancel")
    assert alice.post(API + "/generate", json=_request()).status_code == 202


def test_a_burst_of_one_tokens_generations_admits_exactly_its_limit(play):
    """40 requests of one token at the same moment, through a real server's threads: exactly
    COLLAGE_PLAYGROUND_PER_USER (3) get in, on SQLite and on PostgreSQL (the count and the insert used to be two
    transactions: 4 to 9 got in)."""
    from collage.app.store.tokens import create_token

    client, app, _ = play
    secret = create_token(app.state.engine, "burst")
    with serving(app) as base, httpx.Client(base_url=base, timeout=scaled(120)) as http:
        headers = {"Authorization": f"Bearer {secret}"}
        answers = at_once([lambda: http.post(API + "/generate", json=_request(), headers=headers)] * 40)
    codes = sorted(a.status_code for a in answers)
    assert codes == [202] * 3 + [429] * 37, codes
    with Session(app.state.engine) as session:
        assert len(session.scalars(select(Job).where(Job.status == "queued")).all()) == 3


def test_a_burst_of_one_tokens_uploads_stays_within_its_quota(play):
    """16 distinct images of one token at the same moment, two of which fit its quota: exactly two are kept, and
    what is on disk is what is recorded."""
    from collage.app.store.tokens import create_token

    _, app, _ = play
    secret = create_token(app.state.engine, "uploader")
    images = [noise_png(seed) for seed in range(16)]
    with serving(app) as base, httpx.Client(base_url=base, timeout=scaled(120)) as http:
        headers = {"Authorization": f"Bearer {secret}"}
        answers = at_once([
            lambda png=png: http.post(API + "/images", files={"file": ("x.png", png, "image/png")}, headers=headers)
            for png in images
        ])  # fmt: skip
    codes = sorted(a.status_code for a in answers)
    assert codes == [201] * 2 + [429] * 14, codes
    files, staged = stored_files(app)
    assert staged == [] and files == uploaded_hashes(app) == {
        a.json()["sha256"] for a in answers if a.status_code == 201
    }


def test_a_generation_that_cannot_be_queued_fails_with_503(play):
    client, app, dispatcher = play
    dispatcher.fail_with = RuntimeError("broker down")
    response = client.post(API + "/generate", json=_request())
    assert response.status_code == 503 and "broker down" in response.json()["detail"]
    with Session(app.state.engine) as session:
        job = session.scalars(select(Job)).one()
    assert job.status == "failed" and "broker down" in job.error


def test_a_queued_generation_says_it_waits_behind_training(play):
    from collage.app.store.nodes import mark_busy, release
    from collage.worker.registry import Registration

    client, app, _ = play
    worker = Registration(app.state.engine, "w-busy", ["default"], [])
    worker.beat()
    assert mark_busy(app.state.engine, "w-busy", "r123")  # as its claim of run r123 does
    worker.beat()  # a later beat leaves which run it is busy with alone
    job_id = client.post(API + "/generate", json=_request()).json()["id"]
    seen = client.get(f"{API}/generate/{job_id}").json()
    assert "waiting behind training" in seen["message"] and "run r123 on w-busy" in seen["message"], seen["message"]
    release(app.state.engine, "w-busy", "r123")
    assert "a free worker" in client.get(f"{API}/generate/{job_id}").json()["message"]


def test_a_checkpoint_row_outside_its_runs_folder_is_never_loaded(play):
    """The store's checkpoint path is data too: one pointing outside the run's own folder (another run's, /etc) is
    refused before any worker sees it, as the checkpoint download refuses it."""
    client, app, dispatcher = play
    run = client.post(API + "/runs", json=config()).json()["id"]
    app.state.writer.add_checkpoint(run, 2, "/etc", kind="full", size=10)
    response = client.post(API + "/generate", json=_request(models=[{"run": run, "step": 2}]))
    assert response.status_code == 409 and "not in the run's own folder" in response.json()["detail"]
    assert dispatcher.jobs == []


def test_a_base_model_folder_with_a_file_linked_outside_is_refused(play, tmp_path):
    client, app, dispatcher = play
    (tmp_path / "outside.txt").write_text("not a model's")
    model = tmp_path / "models" / "evil"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").symlink_to(tmp_path / "outside.txt")
    response = client.post(API + "/generate", json=_request(models=[{"path": str(model)}]))
    path, message = field_error(response)
    assert path == "models[0].path" and "holds chat_template.jinja, a link that leads outside" in message
    assert dispatcher.jobs == []


# -------------------------------------------------------------------------------------------------------- tools
def _job_request(app, job_id: str) -> dict:
    with Session(app.state.engine) as session:
        return session.get(Job, job_id).request


def test_generate_with_tools_defaults_to_the_runs_own_and_shows_them(play):
    client, app, dispatcher = play
    app.state.settings = replace(app.state.settings, playground_per_user=10)
    zoom = {"name": "image_zoom_in", "coords": "normalised", "timeout": 5.0, "args": {}}
    run = _run_with_checkpoints(app, client, tools=[zoom], train={"max_steps": 5, "max_tool_calling_iterations": 2})
    # no tools named: the first run model's own, with its settings and its tool-call limit
    job = client.post(API + "/generate", json=_request(models=[{"run": run}])).json()["id"]
    request = _job_request(app, job)
    assert request["tools"] == [zoom] and request["max_tool_calling_iterations"] == 2
    sampling = client.get(f"{API}/generate/{job}").json()["sampling"]
    assert sampling["tools"] == ["image_zoom_in"] and sampling["max_tool_calling_iterations"] == 2
    # named: in that order, the run's own keeping its settings, another with the defaults; the limit as asked
    job = client.post(API + "/generate", json=_request(models=[{"run": run}], tools=["image_rotate", "image_zoom_in"],
                                                      max_tool_calling_iterations=7)).json()["id"]  # fmt: skip
    request = _job_request(app, job)
    assert request["tools"] == [{"name": "image_rotate"}, zoom] and request["max_tool_calling_iterations"] == 7
    assert client.get(f"{API}/generate/{job}").json()["sampling"]["tools"] == ["image_rotate", "image_zoom_in"]
    # none asked for: none, and no limit shown
    job = client.post(API + "/generate", json=_request(models=[{"run": run}], tools=[])).json()["id"]
    assert _job_request(app, job)["tools"] == []
    sampling = client.get(f"{API}/generate/{job}").json()["sampling"]
    assert sampling["tools"] == [] and sampling["max_tool_calling_iterations"] is None
    # a base model has no tools of its own; given one, the limit is 4
    job = client.post(API + "/generate", json=_request()).json()["id"]
    assert _job_request(app, job)["tools"] == []
    job = client.post(API + "/generate", json=_request(tools=["image_zoom_in"])).json()["id"]
    request = _job_request(app, job)
    assert request["tools"] == [{"name": "image_zoom_in"}] and request["max_tool_calling_iterations"] == 4
    assert len(dispatcher.jobs) == 5


def test_a_tool_outside_the_allowlist_or_named_twice_is_refused_naming_it(play):
    client, app, dispatcher = play
    app.state.settings = replace(app.state.settings, playground_per_user=10)
    for tools, where, said in [
        (["image_zoom_in", "evil.module:fn"], "tools[1]", "'evil.module' is not allowlisted for tools"),
        (["image_crop"], "tools[0]", "unknown tool 'image_crop'"),
        (["image_rotate", "os:system"], "tools[1]", "never provides tools"),
        (["image_zoom_in", "image_rotate", "image_zoom_in"], "tools[2]", "'image_zoom_in' is named twice"),
    ]:
        path, message = field_error(client.post(API + "/generate", json=_request(tools=tools)))
        assert (path, said in message) == (where, True), (tools, path, message)
    assert "COLLAGE_TOOL_MODULES" in field_error(client.post(API + "/generate", json=_request(tools=["a.b:c"])))[1]
    for change, where in [({"tools": ["image_zoom_in"] * 9}, "tools"), ({"tools": [""]}, "tools[0]"),
                          ({"max_tool_calling_iterations": 0}, "max_tool_calling_iterations"),
                          ({"max_tool_calling_iterations": 17}, "max_tool_calling_iterations")]:  # fmt: skip
        path, _ = field_error(client.post(API + "/generate", json=_request(**change)))
        assert path.startswith(where), (change, path)
    # a module the operator allows: accepted by name alone (the worker imports it)
    app.state.settings = replace(app.state.settings, tool_modules=("acme_tools",))
    accepted = client.post(API + "/generate", json=_request(tools=["acme_tools.vision:count"]))
    assert accepted.status_code == 202, accepted.text
    # a run whose own tool the operator no longer allows: its default is refused, naming it; none asked: fine
    run = _run_with_checkpoints(app, client, tools=[{"name": "acme_tools.vision:count"}])
    app.state.settings = replace(app.state.settings, tool_modules=())
    path, message = field_error(client.post(API + "/generate", json=_request(models=[{"run": run}])))
    assert path == "tools" and "the run's tool 'acme_tools.vision:count' may not run here" in message
    assert client.post(API + "/generate", json=_request(models=[{"run": run}], tools=[])).status_code == 202
    assert len(dispatcher.jobs) == 2
