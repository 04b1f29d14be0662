"""An image route waiting on a bucket that does not answer: it holds no store connection while it waits, answers
503 with Retry-After within ``COLLAGE_S3_REQUEST_WAIT``, and every other route keeps answering meanwhile."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from collage.app.bucket import BUCKET_THREADS
from collage.app.store.images import relative_path
from collage.app.store.tokens import create_token
from collage.training.infra.objectstore import StorageUnreachable
from tests.support.api import API, filled_run, make_app, png
from tests.support.waiting import scaled, wait_for


class StalledBucket:
    """A bucket that takes writes but whose reads never answer (an S3 outage), until released."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.release = threading.Event()
        self.engine = None
        self.connections_held: list[int] = []  # the store connections checked out when each read began
        self.reads = 0
        self._lock = threading.Lock()

    def ensure_bucket(self) -> None:
        pass

    def put_bytes(self, rel, data, once=False, content_type=None) -> None:
        self.objects[rel] = data

    def fetch_file(self, rel: str, dest: Path) -> bool:
        with self._lock:
            self.reads += 1
            if self.engine is not None:
                self.connections_held.append(self.engine.pool.checkedout())
        self.release.wait(scaled(60))
        raise StorageUnreachable("the test's stalled bucket")

    def presign(self, rel: str, seconds: int) -> str:
        return f"http://bucket.invalid/{rel}"


@pytest.fixture
def stalled(database_url, tmp_path, monkeypatch):
    import collage.training.infra.objectstore as objectstore

    bucket = StalledBucket()
    monkeypatch.setattr(objectstore, "_mirror", lambda *args, **kwargs: bucket)
    app = make_app(database_url, tmp_path, artifacts_url="s3://stalled/prefix", s3_request_wait=scaled(2))
    bucket.engine = app.state.engine
    token = create_token(app.state.engine, "images", role="admin")
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    run = filled_run(client, app)
    sha = hashlib.sha256(png((9, 9, 9))).hexdigest()
    (app.state.settings.artifacts / relative_path(sha)).unlink()  # only the bucket has it now: a cache miss
    yield client, bucket, sha, run
    bucket.release.set()


def _get_in_thread(client, url, answers: list, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.append(client.get(url, **kwargs)), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("size", ["full", "thumb"])
def test_an_image_waiting_on_a_stalled_bucket_holds_no_store_connection_and_answers_503(stalled, size):
    client, bucket, sha, run = stalled
    answers: list = []
    _get_in_thread(client, f"{API}/images/{sha}", answers, params={"size": size})
    wait_for(lambda: bucket.reads, "the image request to reach the bucket", timeout=30)
    # the request's store session was closed before the bucket call: no connection is held while it waits
    assert bucket.connections_held == [0]
    # and every other route answers while the image waits
    assert client.get(f"{API}/runs/{run}").status_code == 200
    # the request answers 503 within its bound, long before the bucket would (it never does here)
    response = wait_for(lambda: answers[0] if answers else None, "the image request to answer", timeout=20)
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) > 0
    assert "COLLAGE_S3_REQUEST_WAIT" in response.json()["detail"]


def test_many_thumbnails_during_a_bucket_outage_all_answer_503_and_the_app_keeps_answering(stalled):
    client, bucket, sha, run = stalled
    answers: list = []
    threads = [_get_in_thread(client, f"{API}/images/{sha}", answers, params={"size": "thumb"}) for _ in range(12)]
    wait_for(lambda: bucket.reads, "the thumbnails to reach the bucket", until=lambda n: n == BUCKET_THREADS,
             timeout=30)  # fmt: skip
    # the bucket's threads are all taken and more requests wait for one: none of them holds a store connection
    wait_for(bucket.engine.pool.checkedout, "no store connection checked out", until=lambda n: n == 0, timeout=10)
    assert client.get(f"{API}/runs/{run}").status_code == 200
    assert client.get(f"{API}/health").status_code in (200, 503)  # answered, whatever the bucket does
    wait_for(lambda: len(answers), "every thumbnail request to answer", until=lambda n: n == len(threads), timeout=30)
    assert [r.status_code for r in answers] == [503] * len(threads)
    assert bucket.reads == BUCKET_THREADS  # the requests that waited for a thread past their bound never ran
