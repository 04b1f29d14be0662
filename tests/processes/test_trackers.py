"""Mirroring runs to trackio and Weights & Biases (``logging.report_to``; worker/trackers.py).

Both trackers run for real and locally: trackio writes its SQLite store under ``TRACKIO_DIR``, W&B runs in offline
mode under ``WANDB_DIR`` (its own service a process of its own); the tests read back what each stored. One run goes
through the whole worker (``collage serve``), the other drives the callback directly with rollout rows carrying
real images.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import math
import os
import struct
from pathlib import Path

import pytest
from PIL import Image

from collage.worker.trackers import TrackersCallback
from tests.support.browser import small_config, wait_done
from tests.support.trackers import (
    TRACKIO_PROJECT,
    WANDB_PROJECT,
    drive,
    metrics_for,
    rows_for,
    trackio_logs,
)
from tests.support.waiting import wait_for

# found, not imported: trackio reads TRACKIO_DIR when first imported, which must happen inside tracker_env
if importlib.util.find_spec("trackio") is None or importlib.util.find_spec("wandb") is None:
    pytest.skip("the trackers extra is not installed: pip install 'collage-rl[trackers]'", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tracker_env, server):  # conftest's server, started with the trackers' environment
    return server


def trackio_config(run_name: str) -> dict:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_config(TRACKIO_PROJECT, run_name) or {}


def wandb_records(run_folder: Path) -> list:
    """Every record of an offline run's ``.wandb`` file: W&B's LevelDB-style log (32 KiB blocks, each chunk a
    7-byte header: CRC32, length, type full/first/middle/last) of ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_folder / "*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, block, chunks, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def wandb_finished_records(run_folder: Path, timeout: float = 60.0) -> list:
    """The records of an offline run once W&B's own service has written its run record: that service writes the
    ``.wandb`` log in a process of its own, which on a loaded machine can still be flushing when ``finish`` has
    returned."""
    return wait_for(
        lambda: wandb_records(run_folder),
        "W&B's service to write the run record",
        timeout=timeout,
        until=lambda records: any(r.WhichOneof("record_type") == "run" for r in records),
        interval=0.5,
    )


def wandb_run_folder(tracker_env: Path, run_id: str) -> Path:
    (folder,) = glob.glob(str(tracker_env / "wandb" / "wandb" / f"offline-run-*-{run_id}"))
    return Path(folder)


def wandb_history(records) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            item = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            out.setdefault(item["_step"], {}).update(item)
    return out


def wandb_tables(records) -> dict[int, dict]:
    """step -> the rollout table W&B staged (its JSON, with the images' bytes by path), from the run_table
    artifacts the run logged."""
    tables: list[dict] = []
    for record in records:
        if record.WhichOneof("record_type") == "artifact" and record.artifact.type == "run_table":
            files = {c.path: Path(c.local_path) for c in record.artifact.manifest.contents}
            (table_file,) = [p for p in files if p.endswith(".table.json")]
            table = json.loads(files[table_file].read_text())
            table["files"] = files
            tables.append(table)
    return {table["data"][0][0]: table for table in tables}


def pixels(png_bytes: bytes) -> tuple:
    image = Image.open(io.BytesIO(png_bytes)).convert("RGB")
    return image.size, image.getpixel((0, 0))


def test_mirrors_metrics_and_rollout_table_with_images(tracker_env):
    warnings: list[str] = []
    callback = TrackersCallback(["trackio", "wandb"], warnings.append, run_id="synth0001")
    drive(callback, steps=3, name="synthetic")
    assert warnings == []

    # trackio: every step's metrics with the same keys and values, the run's config, one table per step
    logs = trackio_logs("synthetic-synth0001")
    metric_logs = {entry["step"]: entry for entry in logs if "reward" in entry}
    assert sorted(metric_logs) == [1, 2, 3]
    for step, entry in metric_logs.items():
        assert {k: entry[k] for k in metrics_for(step)} == metrics_for(step)
    config = trackio_config("synthetic-synth0001")
    assert config["name"] == "synthetic" and config["collage_run_id"] == "synth0001"
    assert config["logging"]["report_to"] == ["trackio", "wandb"]
    tables = {entry["step"]: entry["rollouts"]["_value"] for entry in logs if "rollouts" in entry}
    assert sorted(tables) == [1, 2, 3]
    for step, table in tables.items():
        expected = rows_for(step)
        assert len(table) == len(expected)
        for got, row in zip(table, expected, strict=True):
            assert (got["step"], got["group"], got["index"]) == (row.step, row.group, row.index)
            assert got["prompt"] == f"How many? {row.group}" and got["completion"] == row.completion
            assert got["reward"] == row.reward and got["advantage"] == row.advantage
            assert got["rewards/accuracy"] == row.rewards["accuracy"]
            assert got["rewards/numeric"] == row.rewards["numeric"]
            assert len(got["images"]) == len(row.images)
            for stored, image in zip(got["images"], row.images, strict=True):
                assert stored["_type"] == "trackio.image"
                stored_png = (Path(os.environ["TRACKIO_DIR"]) / "media" / stored["file_path"]).read_bytes()
                assert pixels(stored_png) == pixels(image.png)

    # W&B (offline): the run's name, project and config, every step's metrics, one table per step with images
    records = wandb_finished_records(wandb_run_folder(tracker_env, "synth0001"))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project, run.run_id) == ("synthetic", WANDB_PROJECT, "synth0001")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["collage_run_id"] == "synth0001" and config["train"]["max_steps"] == 50
    history = wandb_history(records)
    assert sorted(history) == [1, 2, 3]
    for step, item in history.items():
        assert {k: item[k] for k in metrics_for(step)} == metrics_for(step)
        assert item["rollouts/_type"] == "table-file"
    tables = wandb_tables(records)
    assert sorted(tables) == [1, 2, 3]
    for step, table in tables.items():
        expected = rows_for(step)
        assert table["columns"] == [
            "step", "group", "index", "prompt", "completion", "reward",
            "rewards/accuracy", "rewards/numeric", "advantage", "images",
        ]  # fmt: skip
        for got, row in zip(table["data"], expected, strict=True):
            assert got[:9] == [
                row.step, row.group, row.index, f"How many? {row.group}", row.completion, row.reward,
                row.rewards["accuracy"], row.rewards["numeric"], row.advantage,
            ]  # fmt: skip
            assert [im["_type"] for im in got[9]] == ["image-file"] * len(row.images)
            for stored, image in zip(got[9], row.images, strict=True):
                assert pixels(table["files"][stored["path"]].read_bytes()) == pixels(image.png)


def test_worker_mirrors_a_run(server, tracker_env):
    """Through the worker: the run's metrics (every key, every step, as the store has them) and its rollout rows
    reach both trackers, and the run records no warning."""
    client = server["client"]
    config = small_config("mirrored")
    config["logging"] = {"report_to": ["trackio", "wandb"]}
    run_id = client.post("/runs", json=config).json()["id"]
    run = wait_done(client, run_id)
    assert run["status"] == "succeeded", run
    store = client.get(f"/runs/{run_id}/metrics").json()
    assert store and all(len(points) == 3 for points in store.values())
    events = client.get(f"/runs/{run_id}/events").json()["items"]
    assert [e for e in events if e["level"] in ("warning", "error")] == []

    logs = [e for e in trackio_logs(f"mirrored-{run_id}") if "rollouts" not in e]
    assert sorted(e["step"] for e in logs) == [1, 2, 3]
    history = wandb_history(wandb_records(wandb_run_folder(tracker_env, run_id)))
    assert sorted(history) == [1, 2, 3]
    for key, points in store.items():
        for step, value in points:
            (entry,) = [e for e in logs if e["step"] == step]
            for mirrored in (entry.get(key), history[step].get(key)):
                assert mirrored is not None, f"{key} at step {step} not mirrored"
                assert math.isclose(mirrored, value, rel_tol=1e-6, abs_tol=1e-9), (key, step, mirrored, value)

    samples = client.get(f"/runs/{run_id}/samples", params={"limit": 500}).json()["items"]
    tables = [e["rollouts"]["_value"] for e in trackio_logs(f"mirrored-{run_id}") if "rollouts" in e]
    mirrored_rows = sorted(
        (r["step"], r["group"], r["index"], r["completion"], len(r["images"])) for t in tables for r in t
    )
    stored_rows = sorted((s["step"], s["group"], s["index"], s["completion"], len(s["images"])) for s in samples)
    assert mirrored_rows == stored_rows and len(stored_rows) == 24
