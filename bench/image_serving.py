"""Rollout images served from S3-compatible object storage: a page of thumbnails, cold and warm.

A web node (`collage serve --workers 0`, a process of its own) with its artifacts in a bucket
(`COLLAGE_ARTIFACTS=s3://...`) and an empty cache of its own; the rollout rows and their images were written by a
"worker host" (a `StoreWriter` with another cache folder), so the web node has none of the files. A page of the
rollout table shows `--page` thumbnails; a browser fetches them over 6 connections at once (HTTP/1.1), which is
what the client here does. Timed, per page (wall time until its last thumbnail arrived) and per request:

- `cold`: the first web node to show these rows: each thumbnail is made from the image fetched from the bucket,
  stored in the bucket, and cached;
- `cold, thumbs in bucket`: another web node (an empty cache) after the first one made them: fetched from the
  bucket and cached;
- `warm`: the same node again (its cache has them);
- `presigned`: `COLLAGE_S3_PRESIGN=60`: the web node answers 307, the client then reads the bucket itself.

Needs an S3 server: `bash scripts/services.sh` starts SeaweedFS on 127.0.0.1:8333 (`--endpoint` to change).

    .venv/bin/python bench/image_serving.py [--pages 10] [--page 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONNECTIONS = 6  # what a browser opens per host over HTTP/1.1
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "collage",
    "AWS_SECRET_ACCESS_KEY": "collage-bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def pngs(count: int, seed: int) -> list[bytes]:
    """Distinct rollout-sized images (224 x 224 RGB noise-and-shapes PNGs, ~100-150 kB each)."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        image = Image.effect_noise((224, 224), 40).convert("RGB")
        draw = ImageDraw.Draw(image)
        for _ in range(4):
            x, y = rng.randrange(180), rng.randrange(180)
            draw.rectangle((x, y, x + 40, y + 40), fill=tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def make_web(settings, token: str):
    """A web node: `collage serve --workers 0` in a process of its own (the client's threads never share its GIL),
    with its own COLLAGE_HOME and cache, and a client that keeps CONNECTIONS connections to it."""
    import httpx

    port = free_port()
    home = Path(tempfile.mkdtemp(prefix="collage-bench-web-"))
    env = {**os.environ, "COLLAGE_HOME": str(home), "COLLAGE_DATABASE_URL": settings.database_url,
           "COLLAGE_BROKER_URL": f"sqla+sqlite:///{home / 'broker.db'}", "COLLAGE_ARTIFACTS": settings.artifacts_url,
           "COLLAGE_S3_ENDPOINT_URL": settings.s3_endpoint_url, "COLLAGE_S3_PRESIGN": str(settings.s3_presign)}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "collage.app.cli", "serve", "--workers", "0", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                          limits=limits, timeout=60)  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            if client.get("/api/v1/health").status_code == 200:
                return client, proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the web node did not start")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_times(client, pages: list[list[str]], follow: bool) -> tuple[list[float], list[float]]:
    """Each page's wall time (all its thumbnails, CONNECTIONS at a time) and each request's, in ms."""
    import httpx

    requests: list[float] = []
    lock = threading.Lock()
    bucket = httpx.Client(timeout=60)

    def fetch(sha: str) -> None:
        started = time.perf_counter()
        response = client.get(f"/api/v1/images/{sha}", params={"size": "thumb"})
        if follow and response.status_code == 307:
            response = bucket.get(response.headers["location"])
        assert response.status_code == 200 and response.content[:4] == b"\x89PNG", response.status_code
        with lock:
            requests.append((time.perf_counter() - started) * 1000)

    per_page = []
    with ThreadPoolExecutor(CONNECTIONS) as pool:
        for page in pages:
            started = time.perf_counter()
            list(pool.map(fetch, page))
            per_page.append((time.perf_counter() - started) * 1000)
    bucket.close()
    return per_page, requests


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def fill(settings, engine, images: int, seed: int) -> list[str]:
    """A run whose rollout rows hold ``images`` distinct images, written by a worker host's store writer."""
    import hashlib

    from collage.app.store.writer import ImageIn, SampleIn, StoreWriter

    worker = StoreWriter(engine, Path(tempfile.mkdtemp(prefix="collage-bench-worker-cache-")), mirror=settings.mirror())
    run = worker.create_run({"name": "image-bench", "algorithm": "grpo", "model": {"path": "tiny:qwen2-vl"},
                             "dataset": {"source": "synth:count-red"}, "train": {"max_steps": 10}}).id  # fmt: skip
    worker.transition(run, ["queued"], "running")
    data = pngs(images, seed)
    rows = [SampleIn(group=i // 4, index=i % 4, prompt="p", completion="c", images=[ImageIn(png=png)],
                     rewards={"accuracy": 1.0}, reward=1.0, advantage=0.0, completion_length=1, truncated=False)
            for i, png in enumerate(data)]  # fmt: skip
    for start in range(0, len(rows), 50):
        worker.for_attempt(run, 1).append_samples(run, 1 + start // 50, rows[start : start + 50])
    return [hashlib.sha256(png).hexdigest() for png in data]


def one_round(args, base_settings, engine, token: str, seed: int) -> dict[str, tuple[list[float], list[float]]]:
    """The four cases on fresh images (a new prefix in the bucket, empty caches)."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    settings = replace(base_settings, artifacts_url=f"s3://collage-bench/{prefix}")
    settings.mirror().ensure_bucket()
    shas = fill(settings, engine, args.pages * args.page, seed)
    pages = [shas[i : i + args.page] for i in range(0, len(shas), args.page)]
    results = {}
    client, proc = make_web(settings, token)
    results["cold (thumbnail made from the bucket's image)"] = page_times(client, pages, follow=False)
    results["warm (this node's cache)"] = page_times(client, pages, follow=False)
    proc.terminate()
    client, proc = make_web(settings, token)  # another node: an empty cache of its own
    results["cold, thumbnails in the bucket (another node)"] = page_times(client, pages, follow=False)
    proc.terminate()
    client, proc = make_web(replace(settings, s3_presign=60), token)
    results["presigned (307, then the bucket)"] = page_times(client, pages, follow=True)
    proc.terminate()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=10)
    parser.add_argument("--page", type=int, default=50, help="thumbnails on a page of the rollout table")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--endpoint", default="http://127.0.0.1:8333")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="collage-image-bench-"))
    os.environ.update(COLLAGE_HOME=str(home), **CREDENTIALS)
    sys.path.insert(0, str(ROOT))
    from collage.app.core.settings import Settings
    from collage.app.store.engine import engine_for, upgrade
    from collage.app.store.tokens import create_token

    database = f"sqlite:///{home / 'collage.db'}"
    upgrade(database)
    engine = engine_for(database)
    token = create_token(engine, "bench", role="admin")
    base = Settings(home=home, database_url=database, broker_url="memory://", artifacts=home / "unused",
                    artifacts_url="s3://collage-bench/x", s3_endpoint_url=args.endpoint)  # fmt: skip
    rounds = [one_round(args, base, engine, token, seed) for seed in range(args.repeats)]
    print(f"{args.pages} pages of {args.page} thumbnails, {CONNECTIONS} connections, {args.repeats} repetitions "
          "(median of each repetition's figure)\n")  # fmt: skip
    print("| case | page p50 ms | page p95 ms | request p50 ms | request p95 ms |")
    print("|---|---:|---:|---:|---:|")
    for case in rounds[0]:
        pages = [r[case][0] for r in rounds]
        requests = [r[case][1] for r in rounds]
        row = [statistics.median(statistics.median(p) for p in pages), statistics.median(p95(p) for p in pages),
               statistics.median(statistics.median(q) for q in requests), statistics.median(p95(q) for q in requests)]  # fmt: skip
        print(f"| {case} | " + " | ".join(f"{v:.1f}" for v in row) + " |")


if __name__ == "__main__":
    main()
