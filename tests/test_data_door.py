"""The data door (issue 17): image paths inside dataset rows stay under the operator's data roots, images open only
in raster formats (Ghostscript never runs), previews are bounded in work and in output, and dataset requests
never take the API down with them.

Through the real parts: the loader on real files, the real API with the real dataset helper (a child process),
the trainer with a tiny model, and ``collage data check`` as a subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image

from collage.training.config import parse_config
from collage.training.data.check import check_dataset, dataset_fingerprint
from collage.training.data.display import MAX_DEPTH, bounded
from collage.training.data.loader import load_dataset
from collage.training.data.rows import RowError
from collage.training.home import cache_dir
from collage.training.images import RASTER_FORMATS, decode_raster

API = "/api/v1"
POSTSCRIPT = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n"
    b"(/etc/hostname) (r) file pop\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n"
)


def _png(colour=(200, 30, 30), size=(16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _reencoded_sha(data: bytes) -> str:
    """The SHA-256 the preview would store the image under (it stores the decoded image as a PNG)."""
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="PNG")
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A 60-byte PNG whose header announces ``width x height`` pixels: a decompression bomb's calling card."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b"")


def _write_rows(file: Path, rows: list[dict]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def outside(tmp_path_factory):
    """A folder outside every root, holding a real image, a PostScript file and a secret."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "file.png").write_bytes(_png((1, 2, 3)))
    (folder / "x.jpg").write_bytes(_png((4, 5, 6)))  # content decides the decoder, not the name
    (folder / "secret").mkdir()
    (folder / "secret" / "token.png").write_bytes(_png((7, 8, 9)))
    return folder


def escaping_rows(root: Path, outside: Path) -> tuple[list[dict], list[str]]:
    """Rows (in ``root/data/train.jsonl``) that name outside files every way there is, and each one's counterpart
    naming a missing outside file: the refusals must read the same."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "ok.png").write_bytes(_png())
    (data / "escape").symlink_to(outside)  # a link inside the root that points out
    (data / "link.png").symlink_to(outside / "file.png")
    up = os.path.relpath(outside, data)  # ../../outside0
    existing = [str(outside / "file.png"), f"{up}/x.jpg", "escape/file.png", "link.png",
                f"{data}/../../{outside.name}/secret/token.png"]  # fmt: skip
    missing = [str(outside / "nope.png"), f"{up}/nope.jpg", "escape/nope.png", "dangling.png",
               f"{data}/../../{outside.name}/secret/nope.png"]  # fmt: skip
    (data / "dangling.png").symlink_to(outside / "gone.png")
    rows = [{"prompt": "fine", "images": ["ok.png"]}]
    rows += [{"prompt": f"existing {k}", "images": [p]} for k, p in enumerate(existing)]
    rows += [{"prompt": f"missing {k}", "images": [p]} for k, p in enumerate(missing)]
    _write_rows(data / "train.jsonl", rows)
    return rows, existing


# --------------------------------------------------------------------------------------- 1. confinement


def test_image_paths_outside_the_roots_are_refused_alike_whether_they_exist_or_not(tmp_path, outside):
    rows, existing = escaping_rows(tmp_path, outside)
    dataset = load_dataset(str(tmp_path / "data"), data_roots=[tmp_path])
    results = list(dataset.samples())
    assert not isinstance(results[0], RowError) and results[0].images[0].size == (16, 16)
    errors = results[1:]
    assert all(isinstance(e, RowError) for e in errors), errors
    messages = {e.message for e in errors}
    assert len(messages) == 1, messages  # existing, missing, link, dangling link, ..: one text
    (message,) = messages
    assert message.startswith("image 0 is outside the folders datasets may be read from")
    assert "COLLAGE_DATA_ROOTS" in message and str(outside) not in message
    # unconfined (the operator's own CLI without COLLAGE_DATA_ROOTS), the same rows read as before
    unconfined = list(load_dataset(str(tmp_path / "data")).samples())
    assert [isinstance(r, RowError) for r in unconfined[1 : 1 + len(existing)]] == [False] * len(existing)


def test_home_relative_and_hub_style_relative_paths_are_confined_too(tmp_path, outside, monkeypatch):
    monkeypatch.setenv("HOME", str(outside))
    _write_rows(tmp_path / "train.jsonl", [{"prompt": "tilde", "images": ["~/file.png"]}])
    (error,) = load_dataset(str(tmp_path), data_roots=[tmp_path]).samples()
    assert isinstance(error, RowError) and "outside the folders" in error.message
    # rows without a folder of their own (a hub dataset): a relative path has nothing to be relative to
    from collage.training.data.rows import RawRow

    row = RawRow(0, {"prompt": "x", "images": ["file.png"]}, None, (tmp_path.resolve(),))
    with pytest.raises(RowError, match="outside the folders"):
        row.to_sample()


def test_the_check_cache_never_looks_at_outside_paths_and_knows_the_roots(tmp_path, outside, monkeypatch):
    from collage.training.data import check

    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "home"))
    escaping_rows(tmp_path, outside)
    stated: list[Path] = []
    real = check._stat
    monkeypatch.setattr(check, "_stat", lambda path, content: stated.append(Path(path)) or real(path, content))
    confined = load_dataset(str(tmp_path / "data"), data_roots=[tmp_path])
    assert dataset_fingerprint(confined, None, None) is not None
    looked_outside = [p for p in stated if not p.resolve().is_relative_to(tmp_path.resolve())]
    assert looked_outside == [] and stated  # the data file and ok.png only
    # the report of an unconfined check is not reused for a confined one
    loose = check_dataset(str(tmp_path / "data"))
    strict = check_dataset(str(tmp_path / "data"), data_roots=[tmp_path])
    assert len(strict.errors) > len(loose.errors)
    assert all("outside the folders" in e.message for e in strict.errors)


def test_synthetic_datasets_stay_readable_under_any_roots(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "home"))
    elsewhere = tmp_path / "datasets"
    elsewhere.mkdir()
    dataset = load_dataset("synth:count-red", data_roots=[elsewhere], rows=6, min_images=1, max_images=2)
    assert len(dataset.load_all()) == 6


def _saved_with_image_feature(folder: Path, records: dict) -> Path:
    """A save_to_disk folder whose ``images`` column is a list of ``datasets.Image`` with the given ``{bytes,
    path}`` values stored as they are (``save_to_disk`` would embed a path's bytes on the author's machine; an
    attacker writes the files directly, as here)."""
    import datasets

    struct = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    plain = datasets.Features({"prompt": datasets.Value("string"), "images": datasets.List(struct)})
    datasets.Dataset.from_dict(records, features=plain).save_to_disk(str(folder))
    info = json.loads((folder / "dataset_info.json").read_text())
    images = datasets.Features({"prompt": datasets.Value("string"), "images": datasets.List(datasets.Image())})
    info["features"] = images.to_dict()
    (folder / "dataset_info.json").write_text(json.dumps(info))
    assert isinstance(datasets.load_from_disk(str(folder)).features["images"].feature, datasets.Image)
    return folder


def test_hub_style_datasets_never_decode_images_themselves(tmp_path, outside):
    """A save_to_disk dataset with an Image feature: ``datasets`` would open the stored path (any path, any
    format); Collage reads the column undecoded and opens it confined and raster-only."""
    (tmp_path / "x.eps").write_bytes(POSTSCRIPT)  # inside the root; the row names it relative to the saved folder
    records = {
        "prompt": ["inline", "outside", "missing outside", "postscript bytes", "postscript path"],
        "images": [
            [{"bytes": _png(), "path": None}],
            [{"bytes": None, "path": str(outside / "file.png")}],
            [{"bytes": None, "path": str(outside / "nope.png")}],
            [{"bytes": POSTSCRIPT, "path": "y.eps"}],
            [{"bytes": None, "path": "../x.eps"}],
        ],
    }
    saved = _saved_with_image_feature(tmp_path / "saved", records)
    inline, out, missing, ps_bytes, ps_path = load_dataset(str(saved), data_roots=[tmp_path]).samples()
    assert not isinstance(inline, RowError) and inline.images[0].size == (16, 16)
    assert isinstance(out, RowError) and isinstance(missing, RowError)
    assert out.message == missing.message and "outside the folders" in out.message
    for error in (ps_bytes, ps_path):
        assert isinstance(error, RowError) and "not a PNG, JPEG, WebP, GIF, BMP or TIFF image" in error.message


# ------------------------------------------------------------------------------------ 2. raster formats


def _raster(fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image = Image.new("RGB", (12, 10), (10, 120, 240))
    if fmt == "MPO":
        image.save(buf, "MPO", save_all=True, append_images=[Image.new("RGB", (12, 10))])
    else:
        image.save(buf, fmt, **options)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"])
def test_raster_formats_open(fmt):
    image = decode_raster(_raster(fmt))
    assert image.format == fmt and image.size == (12, 10)
    assert fmt in RASTER_FORMATS or fmt == "MPO"  # MPO comes through the JPEG decoder


@pytest.mark.parametrize("name", ["x.eps", "y.png"])
def test_postscript_is_refused_in_process(tmp_path, name):
    (tmp_path / name).write_bytes(POSTSCRIPT)
    _write_rows(tmp_path / "train.jsonl", [{"prompt": "ps", "images": [name]}])
    (error,) = load_dataset(str(tmp_path)).samples()
    assert isinstance(error, RowError)
    assert error.message == (
        f"image 0 ({tmp_path / name}) is unreadable: not a PNG, JPEG, WebP, GIF, BMP or TIFF image "
        "(Collage opens only these raster formats)"
    )


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's own, before Collage's refusal
def test_decompression_bombs_are_a_row_error(tmp_path, monkeypatch):
    (tmp_path / "bomb.png").write_bytes(_bomb_png())  # 10^10 pixels announced: Pillow's DecompressionBombError
    (tmp_path / "big.png").write_bytes(_png(size=(60, 60)))  # over a lowered limit, under twice it: a warning
    rows = [{"prompt": "bomb", "images": ["bomb.png"]}, {"prompt": "big", "images": ["big.png"]}]
    _write_rows(tmp_path / "train.jsonl", rows)
    bomb, _ = load_dataset(str(tmp_path)).samples()
    assert isinstance(bomb, RowError) and "image 0 (" in bomb.message and "too large to decode" in bomb.message
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    _, big = load_dataset(str(tmp_path)).samples()
    assert isinstance(big, RowError) and "is 60x60 pixels, more than the 2000 Collage decodes" in big.message


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
    (folder / "ok.png").write_bytes(_png())
    rows = [{"prompt": "eps", "images": ["x.eps"]}, {"prompt": "renamed", "images": ["y.png"]},
            {"prompt": "fine", "images": ["ok.png"]}]  # fmt: skip
    _write_rows(folder / "train.jsonl", rows)


def test_collage_data_check_never_runs_ghostscript(tmp_path):
    bin_dir, marker = _fake_gs(tmp_path)
    _postscript_dataset(tmp_path / "data")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLLAGE_HOME": str(tmp_path / "h")}
    env.pop("COLLAGE_DATA_ROOTS", None)
    result = subprocess.run(
        [sys.executable, "-m", "collage.app.cli", "data", "check", str(tmp_path / "data"), "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert [e["row"] for e in report["errors"]] == [0, 1]
    assert all("not a PNG, JPEG, WebP, GIF, BMP or TIFF image" in e["message"] for e in report["errors"])
    assert not marker.exists(), "Ghostscript ran"
    # with COLLAGE_DATA_ROOTS set, the local check confines image paths as a worker does
    (tmp_path / "data" / "out.png").symlink_to(tmp_path / "elsewhere.png")
    (tmp_path / "elsewhere.png").write_bytes(_png())
    _write_rows(tmp_path / "data" / "train.jsonl", [{"prompt": "out", "images": ["out.png"]}])
    confined = subprocess.run(
        [sys.executable, "-m", "collage.app.cli", "data", "check", str(tmp_path / "data"), "--json"],
        capture_output=True, text=True, env={**env, "COLLAGE_DATA_ROOTS": str(tmp_path / "data")}, timeout=300,
    )  # fmt: skip
    assert confined.returncode == 1 and "outside the folders" in confined.stdout, confined.stdout + confined.stderr


# --------------------------------------------------------------------------------- 1 + 2 through the API


def _preview(client, source: str, **params):
    return client.get(API + "/datasets/preview", params={"source": source, **params})


def test_preview_refuses_outside_images_and_never_serves_them(api, tmp_path, outside):
    client, _, _, _ = api
    rows, existing = escaping_rows(tmp_path, outside)
    response = _preview(client, str(tmp_path / "data"), rows=len(rows))
    assert response.status_code == 200, response.text
    shown = response.json()["rows"]
    assert shown[0]["error"] is None and len(shown[0]["images"]) == 1
    errors = {r["error"] for r in shown[1:]}
    assert len(errors) == 1 and next(iter(errors)).startswith("image 0 is outside the folders")
    assert all(r["images"] == [] for r in shown[1:])
    for file in [outside / "file.png", outside / "x.jpg", outside / "secret" / "token.png"]:
        data = file.read_bytes()
        for sha in {hashlib.sha256(data).hexdigest(), _reencoded_sha(data)}:
            assert client.get(f"{API}/images/{sha}").status_code == 404
    check = client.post(API + "/datasets/check", json={"source": str(tmp_path / "data")}).json()
    assert [e["row"] for e in check["errors"]] == list(range(1, len(rows)))
    assert {e["message"] for e in check["errors"]} == errors


def test_the_operator_roots_reach_the_helper_from_settings(api, tmp_path, outside):
    client, _, _, app = api
    escaping_rows(tmp_path, outside)
    (outside / "data.jsonl").write_text(json.dumps({"prompt": "p", "images": ["file.png"]}) + "\n")
    app.state.settings = dataclasses.replace(app.state.settings, data_roots=(outside,))
    inside = _preview(client, str(outside / "data.jsonl")).json()["rows"][0]
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
    (tmp_path / "bomb.png").write_bytes(_bomb_png())
    _write_rows(tmp_path / "train.jsonl", [{"prompt": "boom", "images": ["bomb.png"]}])
    response = _preview(client, str(tmp_path))
    assert response.status_code == 200, response.text
    assert "too large to decode" in response.json()["rows"][0]["error"]


def test_a_training_run_refuses_rows_with_outside_images(tmp_path, outside):
    from collage.training.trainer import Trainer, TrainingError

    escaping_rows(tmp_path, outside)
    config = parse_config(
        {
            "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
            "dataset": {"source": str(tmp_path / "data"), "bad_rows": "fail"},
            "rewards": [{"name": "accuracy"}],
            "train": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4},
            "resources": {"gpus": 0},
        }
    )
    with pytest.raises(TrainingError) as info:
        Trainer(config, tmp_path / "out", [], data_roots=[tmp_path]).setup()
    message = str(info.value)
    assert "10 of 11 rows fail `collage data check` (dataset.bad_rows: fail)" in message
    assert "row 1: image 0 is outside the folders datasets may be read from" in message
    assert str(outside) not in message


# ------------------------------------------------------------------------------------------- 4. bounds


def test_a_synth_preview_generates_only_its_rows_with_the_datasets_content(tmp_path, monkeypatch):
    from collage.app.datahelper import preview_rows

    monkeypatch.setenv("COLLAGE_HOME", str(tmp_path / "home"))
    options = {"rows": 40, "min_images": 0, "max_images": 4, "seed": 5}
    shown = load_dataset("synth:same-shape", limit=6, **options)
    assert len(shown) == 6 and shown.total == 40
    assert not any(cache_dir("datasets").iterdir()), "a preview writes no dataset"
    full = load_dataset("synth:same-shape", **options)
    for mine, theirs in zip(shown.rows, full.rows[:6], strict=True):
        assert {k: v for k, v in mine.data.items() if k != "images"} == {
            k: v for k, v in theirs.data.items() if k != "images"
        }
        assert [hashlib.sha256(b).hexdigest() for b in mine.data["images"]] == [
            Path(name).stem for name in theirs.data["images"]
        ]
    assert preview_rows(shown, 6, tmp_path / "a") == preview_rows(full, 6, tmp_path / "b")


def test_a_limited_load_parses_only_its_rows_and_counts_the_rest(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [json.dumps({"prompt": f"p{k}"}) for k in range(7)]
    (tmp_path / "j").mkdir()
    # blank lines are no rows; the last line has no newline; a bad line after the shown rows is only counted
    (tmp_path / "j" / "train.jsonl").write_text("\n".join(lines[:3]) + "\n\n  \n{not json\n" + "\n".join(lines[3:]))
    shown = load_dataset(str(tmp_path / "j"), limit=2)
    assert [r.data["prompt"] for r in shown.rows] == ["p0", "p1"] and shown.total == 8
    assert load_dataset(str(tmp_path / "j"), limit=3).total == 8
    pq.write_table(pa.Table.from_pylist([{"prompt": f"q{k}"} for k in range(2500)]), tmp_path / "t.parquet")
    parquet = load_dataset(str(tmp_path / "t.parquet"), limit=4)
    assert [r.data["prompt"] for r in parquet.rows] == ["q0", "q1", "q2", "q3"] and parquet.total == 2500
    assert (
        len(load_dataset(str(tmp_path / "t.parquet"))) == 2500
        and load_dataset(str(tmp_path / "t.parquet")).total is None
    )


def test_a_row_nested_past_the_json_readers_limit_is_a_clear_error(tmp_path):
    from collage.training.data.rows import RowError

    (tmp_path / "train.jsonl").write_text('{"prompt": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (item,) = load_dataset(str(tmp_path)).samples()
    assert isinstance(item, RowError) and str(item) == "row 0: train.jsonl line 1 is nested too deeply to read"


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


@pytest.mark.slow
def test_a_check_past_its_time_is_killed_and_leaves_no_temp_folder(api):
    from collage.app.routers.datasets import data_helper

    client, _, _, app = api
    assert _preview(client, "synth:count-red").status_code == 200  # the helper runs and has its imports
    app.state.settings = dataclasses.replace(app.state.settings, check_timeout=6)
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
    """A dataset whose data file is a FIFO: reading it waits until :meth:`release` writes a row. Requests for it
    stay in flight as long as the test wants."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True)
        self.folder, self.fifo = folder, folder / "train.jsonl"
        os.mkfifo(self.fifo)

    def release(self, threads: list[threading.Thread], timeout: float = 300) -> None:
        """Feed every reader until all ``threads`` have ended."""
        deadline = time.monotonic() + timeout
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: nobody reads it now
                    raise
                time.sleep(0.05)
                continue
            os.write(fd, b'{"prompt": "released"}\n')
            os.close(fd)
            time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def _wait_for(predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _tokens(app, count: int) -> list[str]:
    from collage.app.store.tokens import create_token

    return [create_token(app.state.engine, f"member-{k}", role="member") for k in range(count)]


def _gate_total(app) -> int:
    gate = getattr(app.state, "dataset_gate", None)
    return gate.total if gate is not None else 0


def test_each_token_has_a_limit_of_dataset_requests_in_flight(api, tmp_path):
    client, _, _, app = api
    app.state.settings = dataclasses.replace(app.state.settings, dataset_per_user=1, preview_timeout=300)
    stuck = Stuck(tmp_path / "stuck")
    alice, bob = (
        {"Authorization": f"Bearer {t}"} for t in _tokens(app, 2)
    )  # fmt: skip
    first, answers = _in_background(
        lambda: client.get(API + "/datasets/preview", params={"source": str(stuck.folder)}, headers=alice)
    )
    threads = [first]
    try:
        _wait_for(lambda: _gate_total(app) == 1)
        second = client.get(API + "/datasets/preview", params={"source": "synth:count-red"}, headers=alice)
        assert second.status_code == 429 and int(second.headers["Retry-After"]) > 0
        assert "this token already has 1 dataset request(s) in flight" in second.json()["detail"]
        other, other_answers = _in_background(
            lambda: client.post(API + "/datasets/check", json={"source": "synth:count-red", "rows": 8}, headers=bob)
        )
        threads.append(other)
        _wait_for(lambda: _gate_total(app) == 2)  # another token is admitted
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
        _wait_for(lambda: server.started)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def test_waiting_previews_never_hang_the_api(api, tmp_path):
    """45 members preview a dataset that never ends: 8 are admitted (one reads, 7 wait for the helper), the rest are
    answered 429 at once, and /health and /runs still answer while they wait (the waiting ones used to hold every
    thread of the server's threadpool)."""
    import httpx

    _, admin, _, app = api
    app.state.settings = dataclasses.replace(
        app.state.settings, dataset_per_user=1, dataset_queue=8, preview_timeout=300
    )
    stuck = Stuck(tmp_path / "stuck")
    tokens = _tokens(app, 45)
    with _served(app) as base:
        threads, answers = [], []
        for token in tokens:
            headers = {"Authorization": f"Bearer {token}"}
            thread, out = _in_background(
                lambda h=headers: httpx.get(
                    base + API + "/datasets/preview", params={"source": str(stuck.folder)}, headers=h, timeout=300
                )
            )
            threads.append(thread)
            answers.append(out)
        try:
            _wait_for(lambda: sum(1 for out in answers if out) == 37)
            assert {out[0].status_code for out in answers if out} == {429}
            assert _gate_total(app) == 8
            alive: list = []
            headers = {"Authorization": f"Bearer {admin}"}
            checker = threading.Thread(
                target=lambda: alive.extend(
                    [httpx.get(base + API + path, headers=headers, timeout=120) for path in ("/health", "/runs")]
                ),
                daemon=True,
            )
            checker.start()
            checker.join(timeout=120)  # liveness, not speed
            assert [r.status_code for r in alive] == [200, 200]
        finally:
            stuck.release(threads)
    assert sorted(out[0].status_code for out in answers) == [200] * 8 + [429] * 37


# --------------------------------------------------------------------------------------- 5. deep values


def _nested(levels: int):
    value: object = "bottom"
    for _ in range(levels):
        value = [value]
    return value


def test_a_900_level_column_previews_as_a_bounded_marker(api, tmp_path):
    client, _, _, _ = api
    rows = [
        {"prompt": "deep column", "deep": _nested(900), "nan": float("nan"), "long": "x" * 50_000},
        {"prompt": {"deep": _nested(900)}},  # an unusable row shows its prompt as stored: bounded too
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


def test_bounded_values_are_json_and_small():
    value = {"k" * 10: list(range(1000)), "b": b"\x00" * 99, "s": "y" * 10_000, "n": [{"a": _nested(50)}] * 200}
    shown = bounded(value)
    text = json.dumps(shown, allow_nan=False)
    assert len(text) < 40_000
    assert shown["b"] == "<99 bytes>" and shown["k" * 10][-1] == "… (950 more items)"
    assert re.search(r"… \(\d+ more characters\)$", shown["s"])
    assert bounded({"a": [1, "x", None, True, 2.5]}) == {"a": [1, "x", None, True, 2.5]}
