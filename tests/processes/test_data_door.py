"""The data door (issue 17) with real processes: ``collage data check`` as a subprocess and the API's preview and check
through the real dataset helper (a child process), on SQLite and PostgreSQL, never run Ghostscript, refuse images
outside the operator's data roots, stop at their time, image and byte bounds, and limit each token's requests in
flight; waiting previews never hang the API behind a real uvicorn server."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from PIL import Image

from collage.training.data.display import MAX_DEPTH
from collage.training.infra.home import cache_dir
from tests.support.hostile_data import (
    POSTSCRIPT,
    bomb_png,
    escaping_rows,
    hostile_png,
    nested,
    write_rows,
)
from tests.support.waiting import scaled, wait_for

API = "/api/v1"


def _reencoded_sha(data: bytes) -> str:
    """The SHA-256 the preview would store the image under (it stores the decoded image as a PNG)."""
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="PNG")
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _fake_gs(tmp_path: Path) -> tuple[Path, Path]:
    """A ``gs`` first on PATH that only leaves a marker: it must never run."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "GHOSTSCRIPT_RAN"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f"#!/bin/sh\ntouch {marker}\necho 9.99\n")
    (bin_dir / "gs").chmod(0o755)
    return bin_dir, marker


def _postscript_dataset(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "x.eps").write_bytes(POSTSCRIPT)
    (folder / "y.png").write_bytes(POSTSCRIPT)  # PostScript named like a PNG
    (folder / "ok.png").write_bytes(hostile_png())
    rows = [{"prompt": "eps", "images": ["x.eps"]}, {"prompt": "renamed", "images": ["y.png"]},
            {"prompt": "fine", "images": ["ok.png"]}]  # fmt: skip
    write_rows(folder / "train.jsonl", rows)


def test_collage_data_check_never_runs_ghostscript(tmp_path):
    bin_dir, marker = _fake_gs(tmp_path)
    _postscript_dataset(tmp_path / "data")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLLAGE_HOME": str(tmp_path / "h")}
    env.pop("COLLAGE_DATA_ROOTS", None)
    result = subprocess.run(
        [sys.executable, "-m", "collage.app.cli", "data", "check", str(tmp_path / "data"), "--json"],
        capture_output=True, text=True, env=env, timeout=scaled(300),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert [e["row"] for e in report["errors"]] == [0, 1]
    assert all("not a PNG, JPEG, WebP, GIF, BMP or TIFF image" in e["message"] for e in report["errors"])
    assert not marker.exists(), "Ghostscript ran"
    # with COLLAGE_DATA_ROOTS set, the local check confines image paths as a worker does
    (tmp_path / "data" / "out.png").symlink_to(tmp_path / "elsewhere.png")
    (tmp_path / "elsewhere.png").write_bytes(hostile_png())
    write_rows(tmp_path / "data" / "train.jsonl", [{"prompt": "out", "images": ["out.png"]}])
    confined = subprocess.run(
        [sys.executable, "-m", "collage.app.cli", "data", "check", str(tmp_path / "data"), "--json"],
        capture_output=True, text=True, env={**env, "COLLAGE_DATA_ROOTS": str(tmp_path / "data")}, timeout=scaled(300),
    )  # fmt: skip
    assert confined.returncode == 1 and "outside the folders" in confined.stdout, confined.stdout + confined.stderr


def _preview(client, source: str, **params):
    return client.get(API + "/datasets/preview", params={"source": source, **params})


def test_a_split_file_linked_to_a_file_outside_is_never_shown(api, tmp_path):
    """A ``train.csv`` linked to /etc/passwd was shown row by row in a preview: the dataset helper refuses it,
    naming the file, in the preview and in the check; nothing of the outside file reaches the answer."""
    client, _, _, _ = api
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "passwd").write_text("prompt,answer\nroot:x:0:0:root:/root:/bin/bash,1\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").symlink_to(outside / "passwd")
    preview = _preview(client, str(tmp_path / "data"))
    assert preview.status_code == 400 and "train.csv: leads outside the folders" in preview.json()["detail"], (
        preview.text
    )
    check = client.post(API + "/datasets/check", json={"source": str(tmp_path / "data")})
    assert check.status_code == 400 and "train.csv: leads outside" in check.json()["detail"], check.text
    assert "root:x" not in preview.text + check.text


def test_preview_refuses_outside_images_and_never_serves_them(api, tmp_path, outside_images):
    client, _, _, _ = api
    rows, existing = escaping_rows(tmp_path, outside_images)
    response = _preview(client, str(tmp_path / "data"), rows=len(rows))
    assert response.status_code == 200, response.text
    shown = response.json()["rows"]
    assert shown[0]["error"] is None and len(shown[0]["images"]) == 1
    errors = {r["error"] for r in shown[1:]}
    assert len(errors) == 1 and next(iter(errors)).startswith("image 0 is outside the folders")
    assert all(r["images"] == [] for r in shown[1:])
    for file in [outside_images / "file.png", outside_images / "x.jpg", outside_images / "secret" / "token.png"]:
        data = file.read_bytes()
        for sha in {hashlib.sha256(data).hexdigest(), _reencoded_sha(data)}:
            assert client.get(f"{API}/images/{sha}").status_code == 404
    check = client.post(API + "/datasets/check", json={"source": str(tmp_path / "data")}).json()
    assert [e["row"] for e in check["errors"]] == list(range(1, len(rows)))
    assert {e["message"] for e in check["errors"]} == errors


def test_the_operator_roots_reach_the_helper_from_settings(api, tmp_path, outside_images):
    client, _, _, app = api
    escaping_rows(tmp_path, outside_images)
    (outside_images / "data.jsonl").write_text(json.dumps({"prompt": "p", "images": ["file.png"]}) + "\n")
    app.state.settings = dataclasses.replace(app.state.settings, data_roots=(outside_images,))
    inside = _preview(client, str(outside_images / "data.jsonl")).json()["rows"][0]
    assert inside["error"] is None and len(inside["images"]) == 1  # under the operator's roots: read
    assert _preview(client, str(tmp_path / "data")).status_code == 400  # the home is no longer a root


def test_preview_and_check_never_run_ghostscript(api, tmp_path, monkeypatch):
    client, _, _, _ = api
    bin_dir, marker = _fake_gs(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")  # a new helper, with this PATH
    _postscript_dataset(tmp_path / "data")
    shown = _preview(client, str(tmp_path / "data")).json()["rows"]
    assert [r["error"] is not None for r in shown] == [True, True, False]
    assert all("not a PNG, JPEG, WebP, GIF, BMP or TIFF image" in r["error"] for r in shown[:2])
    report = client.post(API + "/datasets/check", json={"source": str(tmp_path / "data")}).json()
    assert [e["row"] for e in report["errors"]] == [0, 1]
    assert not marker.exists(), "Ghostscript ran in the dataset helper"


def test_a_decompression_bomb_is_a_row_error_in_the_preview(api, tmp_path):
    client, _, _, _ = api
    (tmp_path / "bomb.png").write_bytes(bomb_png())
    write_rows(tmp_path / "train.jsonl", [{"prompt": "boom", "images": ["bomb.png"]}])
    response = _preview(client, str(tmp_path))
    assert response.status_code == 200, response.text
    assert "too large to decode" in response.json()["rows"][0]["error"]


def test_the_huge_synth_preview_is_answered_from_its_rows_alone(api):
    client, _, _, _ = api
    before = set(cache_dir("datasets").iterdir())
    params = {"dataset_rows": 100_000, "min_images": 64, "max_images": 64, "seed": 424242}
    response = _preview(client, "synth:count-red", **params)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["total_rows"] == 100_000 and len(body["rows"]) == 5 and body["note"] is None
    assert all(len(r["images"]) == 64 for r in body["rows"])
    assert set(cache_dir("datasets").iterdir()) == before, "the preview wrote (part of) the dataset"
    shown = client.get(body["rows"][4]["images"][63]["url"])
    assert shown.status_code == 200 and Image.open(io.BytesIO(shown.content)).size == (56, 56)


def test_a_preview_stops_at_its_image_and_byte_bounds_and_says_so(api):
    client, _, _, app = api
    params = {"dataset_rows": 50, "min_images": 3, "max_images": 3, "rows": 10}
    app.state.settings = dataclasses.replace(app.state.settings, preview_max_images=7)
    body = _preview(client, "synth:count-red", **params).json()
    assert [len(r["images"]) for r in body["rows"]] == [3, 3]
    assert "stops before row 2" in body["note"] and "more than the 7 images" in body["note"]
    app.state.settings = dataclasses.replace(app.state.settings, preview_max_images=320, preview_max_bytes=40_000)
    body = _preview(client, "synth:count-red", **params).json()
    assert 0 < len(body["rows"]) < 10 and "bytes of image data" in body["note"]


def _temp_folders(name: str) -> list[Path]:
    return [p for p in cache_dir("datasets").iterdir() if p.name.startswith(name + ".")]


def test_a_check_past_its_time_is_killed_and_leaves_no_temp_folder(api):
    from collage.app.routers.datasets import data_helper

    client, _, _, app = api
    assert _preview(client, "synth:count-red").status_code == 200  # the helper runs and has its imports
    app.state.settings = dataclasses.replace(app.state.settings, check_timeout=scaled(6))
    seed = 7_000_000 + os.getpid() % 1000
    name = f"synth-count-red-r100000-i64-64-s{seed}"
    seen: list[Path] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.extend(_temp_folders(name))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        body = {"source": "synth:count-red", "rows": 100_000, "min_images": 64, "max_images": 64, "seed": seed}
        response = client.post(API + "/datasets/check", json=body)
    finally:
        done.set()
        watcher.join()
    assert response.status_code == 504 and "longer than" in response.json()["detail"]
    assert seen, "the check never started writing its dataset"
    assert _temp_folders(name) == [] and not (cache_dir("datasets") / name).exists()
    assert data_helper().proc is None  # killed; the next request starts a fresh helper


class Stuck:
    """A dataset whose requests stay in flight as long as the test wants: the web process's dataset helper is
    started with a first request, then frozen (SIGSTOP), so that every request sent to it waits; :meth:`release`
    lets it go on (SIGCONT) and it answers them all. (A FIFO as the data file used to do this; the loader now
    refuses a file that is not a regular one before it reads it.)"""

    def __init__(self, folder: Path, client):
        from collage.app.datasets.client import data_helper

        folder.mkdir(parents=True)
        self.folder = folder
        (folder / "train.jsonl").write_text('{"prompt": "released"}\n')
        warm = client.get(API + "/datasets/preview", params={"source": str(folder)})
        assert warm.status_code == 200, warm.text
        self.pid = data_helper().proc.pid
        os.kill(self.pid, signal.SIGSTOP)

    def release(self, threads: list[threading.Thread], timeout: float = 300) -> None:
        """Let the helper go on, and wait until all ``threads`` have ended."""
        os.kill(self.pid, signal.SIGCONT)
        wait_for(lambda: [t for t in threads if t.is_alive()], "every request for the stuck dataset to end",
                 until=lambda alive: not alive, timeout=timeout, interval=0.05)  # fmt: skip


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def _tokens(app, count: int) -> list[str]:
    from collage.app.store.tokens import create_token

    return [create_token(app.state.engine, f"member-{k}", role="member") for k in range(count)]


def _gate_total(app) -> int:
    gate = getattr(app.state, "dataset_gate", None)
    return gate.total if gate is not None else 0


def test_each_token_has_a_limit_of_dataset_requests_in_flight(api, tmp_path):
    client, _, _, app = api
    app.state.settings = dataclasses.replace(app.state.settings, dataset_per_user=1, preview_timeout=scaled(300))
    stuck = Stuck(tmp_path / "stuck", client)
    alice, bob = (
        {"Authorization": f"Bearer {t}"} for t in _tokens(app, 2)
    )  # fmt: skip
    first, answers = _in_background(
        lambda: client.get(API + "/datasets/preview", params={"source": str(stuck.folder)}, headers=alice)
    )
    threads = [first]
    try:
        wait_for(lambda: _gate_total(app) == 1, "one request through the gate", interval=0.05, timeout=120)
        second = client.get(API + "/datasets/preview", params={"source": "synth:count-red"}, headers=alice)
        assert second.status_code == 429 and int(second.headers["Retry-After"]) > 0
        assert "this token already has 1 dataset request(s) in flight" in second.json()["detail"]
        other, other_answers = _in_background(
            lambda: client.post(API + "/datasets/check", json={"source": "synth:count-red", "rows": 8}, headers=bob)
        )
        threads.append(other)
        wait_for(
            lambda: _gate_total(app) == 2, "a second token's request through the gate", interval=0.05
        )  # another token is admitted
    finally:
        stuck.release(threads)
    assert (
        answers[0].status_code == 200 and answers[0].json()["rows"][0]["prompt"][0]["content"][0]["text"] == "released"
    )
    assert other_answers[0].status_code == 200 and other_answers[0].json()["rows"] == 8
    assert _gate_total(app) == 0


@contextlib.contextmanager
def _served(app):
    """The app behind a real uvicorn server (one event loop and one threadpool, as in production), in a thread."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "the test server to start", interval=0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=scaled(60))
        sock.close()


def test_waiting_previews_never_hang_the_api(api, tmp_path):
    """45 members preview a dataset that never ends: 8 are admitted (one reads, 7 wait for the helper), the rest are
    answered 429 at once, and /health and /runs still answer while they wait (the waiting ones used to hold every
    thread of the server's threadpool)."""
    import httpx

    client, admin, _, app = api
    app.state.settings = dataclasses.replace(
        app.state.settings, dataset_per_user=1, dataset_queue=8, preview_timeout=scaled(300)
    )
    stuck = Stuck(tmp_path / "stuck", client)
    tokens = _tokens(app, 45)
    with _served(app) as base:
        threads, answers = [], []
        for token in tokens:
            headers = {"Authorization": f"Bearer {token}"}
            thread, out = _in_background(
                lambda h=headers: httpx.get(
                    base + API + "/datasets/preview",
                    params={"source": str(stuck.folder)},
                    headers=h,
                    timeout=scaled(300),
                )
            )
            threads.append(thread)
            answers.append(out)
        try:
            wait_for(
                lambda: sum(1 for out in answers if out),
                "37 answers",
                until=lambda n: n == 37,
                interval=0.05,
                timeout=120,
            )
            assert {out[0].status_code for out in answers if out} == {429}
            assert _gate_total(app) == 8
            alive: list = []
            headers = {"Authorization": f"Bearer {admin}"}
            checker = threading.Thread(
                target=lambda: alive.extend(
                    [
                        httpx.get(base + API + path, headers=headers, timeout=scaled(120))
                        for path in ("/health", "/runs")
                    ]
                ),
                daemon=True,
            )
            checker.start()
            checker.join(timeout=scaled(120))  # liveness, not speed
            assert [r.status_code for r in alive] == [200, 200]
        finally:
            stuck.release(threads)
    assert sorted(out[0].status_code for out in answers) == [200] * 8 + [429] * 37


def test_a_900_level_column_previews_as_a_bounded_marker(api, tmp_path):
    client, _, _, _ = api
    rows = [
        {"prompt": "deep column", "deep": nested(900), "nan": float("nan"), "long": "x" * 50_000},
        {"prompt": {"deep": nested(900)}},  # an unusable row shows its prompt as stored: bounded too
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    response = _preview(client, str(tmp_path))
    assert response.status_code == 200, response.text[:500]
    first, second = response.json()["rows"]
    value, depth = first["columns"]["deep"], 1
    while isinstance(value, list):
        (value,) = value
        depth += 1
    assert depth == MAX_DEPTH and value.startswith("[[[[") and f"nested deeper than {MAX_DEPTH} levels" in value
    assert first["columns"]["nan"] == "nan" and len(first["columns"]["long"]) < 2100
    assert "nested deeper than" in json.dumps(second["prompt"]) and second["error"]
