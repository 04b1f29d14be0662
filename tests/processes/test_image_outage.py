"""Images during an outage of a real S3 server (SeaweedFS, frozen with SIGSTOP: it takes connections and never
answers), on SQLite and PostgreSQL: a thumbnail the web node does not have answers 503 with Retry-After within
``COLLAGE_S3_REQUEST_WAIT`` although the bucket's retry window is two minutes, and, with many such requests waiting,
every other route still answers (none of them holds a store connection while it waits)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import pytest
from fastapi.testclient import TestClient

from tests.support import API
from tests.support.api import RecordingDispatcher, config, png
from tests.support.s3 import BUCKET, CREDENTIALS, WeedServer
from tests.support.waiting import scaled, wait_for


@pytest.fixture
def frozen_bucket(database_url, tmp_path, monkeypatch):
    """``(client, weed, sha, run)``: an image in the bucket of a server of the test's own, not in the web node's
    cache; the server is frozen by the test and thawed and killed after it."""
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.engine import engine_for
    from collage.app.store.tokens import create_token
    from collage.app.store.writer import ImageIn, SampleIn, StoreWriter

    weed = WeedServer(tmp_path / "weed")
    weed.start()
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    web = Settings(
        home=tmp_path / "web-home", database_url=database_url, broker_url="memory://",
        artifacts=tmp_path / "web-cache", artifacts_url=f"s3://{BUCKET}/outage-{os.getpid()}-{time.time_ns()}",
        s3_endpoint_url=weed.endpoint, s3_retry_for=120, s3_request_wait=scaled(3),
    )  # fmt: skip
    app = create_app(web, RecordingDispatcher())
    token = create_token(engine_for(database_url), "outage", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    run = client.post(API + "/runs", json=config()).json()["id"]
    worker = StoreWriter(engine_for(database_url), tmp_path / "worker-cache", mirror=web.mirror())
    assert worker.transition(run, ["queued"], "running")
    image = png((10, 200, 10), (40, 30))
    worker.for_attempt(run, 1).append_samples(run, 1, [SampleIn(0, 0, "p", "c", [ImageIn(image)], {}, 1.0, 0.0, 1,
                                                                False)])  # fmt: skip
    try:
        yield client, weed, hashlib.sha256(image).hexdigest(), run
    finally:
        if weed.proc is not None and weed.proc.poll() is None:
            os.killpg(weed.proc.pid, signal.SIGCONT)
        weed.kill()


def test_thumbnails_during_a_frozen_bucket_answer_503_in_time_and_the_app_keeps_answering(frozen_bucket):
    client, weed, sha, run = frozen_bucket
    os.killpg(weed.proc.pid, signal.SIGSTOP)  # it still accepts connections (the kernel does), and never answers
    answers: list = []

    def ask() -> None:
        answers.append(client.get(f"{API}/images/{sha}", params={"size": "thumb"}))

    started = time.monotonic()
    threads = [threading.Thread(target=ask, daemon=True) for _ in range(12)]
    for thread in threads:
        thread.start()
    # while they wait on the bucket, the store-backed routes answer at once
    assert client.get(f"{API}/runs/{run}").status_code == 200
    assert client.get(f"{API}/runs").status_code == 200
    wait_for(lambda: len(answers), "every thumbnail request to answer", until=lambda n: n == len(threads),
             timeout=60)  # fmt: skip
    took = time.monotonic() - started
    assert [r.status_code for r in answers] == [503] * len(threads), [r.text for r in answers]
    assert all(int(r.headers["Retry-After"]) > 0 for r in answers)
    assert "COLLAGE_S3_REQUEST_WAIT" in answers[0].json()["detail"]
    # within the request's bound (and far below the bucket's 120 s retry window and boto3's 60 s read timeout)
    assert took < scaled(3) + scaled(20), took
    # the bucket back: the same thumbnail is served
    os.killpg(weed.proc.pid, signal.SIGCONT)
    thumb = wait_for(lambda: client.get(f"{API}/images/{sha}", params={"size": "thumb"}), "the thumbnail once the "
                     "bucket is back", until=lambda r: r.status_code == 200, timeout=90, interval=1)  # fmt: skip
    assert thumb.content[:4] == b"\x89PNG"
