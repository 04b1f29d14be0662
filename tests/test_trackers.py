"""Mirroring runs to trackio and Weights & Biases (``logging.report_to``; worker/trackers.py).

Both trackers run for real and locally: trackio writes its SQLite store under ``TRACKIO_DIR``, W&B runs in offline
mode under ``WANDB_DIR``; the tests read back what each stored. One run goes through the whole worker
(``collage serve``), the rest drive the callback directly with rollout rows carrying real images."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import io
import json
import math
import os
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from collage.training.callbacks import RolloutImage, RolloutRow
from collage.training.config import ConfigError, parse_config
from collage.worker.trackers import Backend, TrackersCallback, TrackioBackend, WandbBackend
from tests.dashboard_support import small_config, wait_done

# found, not imported: trackio reads TRACKIO_DIR when first imported, which must happen inside tracker_env
if importlib.util.find_spec("trackio") is None or importlib.util.find_spec("wandb") is None:
    pytest.skip("the trackers extra is not installed: pip install 'collage-rl[trackers]'", allow_module_level=True)

TRACKIO_PROJECT = "collage-test"
WANDB_PROJECT = "collage-test-wb"


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """The operator's settings for this module's worker and in-process runs: local trackio, offline W&B, all
    under a temporary folder."""
    root = tmp_path_factory.mktemp("trackers")
    env = {
        "TRACKIO_DIR": str(root / "trackio"),
        "TRACKIO_PROJECT": TRACKIO_PROJECT,
        "WANDB_MODE": "offline",
        "WANDB_PROJECT": WANDB_PROJECT,
        "WANDB_DIR": str(root / "wandb"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_SILENT": "true",
    }
    for key in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        Path(env[key]).mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("TRACKIO_SPACE_ID", raising=False)
        mp.delenv("TRACKIO_SERVER_URL", raising=False)
        mp.delenv("WANDB_API_KEY", raising=False)
        import trackio.utils

        # trackio reads TRACKIO_DIR once, at import: nothing may have imported it before this module
        assert Path(env["TRACKIO_DIR"]) == trackio.utils.TRACKIO_DIR, "trackio was imported before TRACKIO_DIR was set"
        yield root


@pytest.fixture(scope="module")
def server(tracker_env, server):  # conftest's server, started with the trackers' environment
    return server


# ---------------------------------------------------------------- reading back what each tracker stored


def trackio_logs(run_name: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(TRACKIO_PROJECT, run_name)


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
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(run_folder)
        if any(r.WhichOneof("record_type") == "run" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


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


# ---------------------------------------------------------------- synthetic rollout rows with real images


COLOURS = [(255, 0, 0), (0, 0, 255), (0, 160, 0)]


def png(colour, size=(6, 4)) -> RolloutImage:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    data = buf.getvalue()
    return RolloutImage(hashlib.sha256(data).hexdigest(), data, *size)


def rows_for(step: int) -> list[RolloutRow]:
    rows = []
    for group in range(2):
        for index in range(2):
            n_images = (group + index + step) % 3  # 0, 1 or 2 images
            images = [png(COLOURS[(k + index) % 3], (6 + k, 4)) for k in range(n_images)]
            accuracy = float((index + step) % 2)
            rows.append(
                RolloutRow(
                    step=step,
                    group=group,
                    index=index,
                    prompt=[
                        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"How many? {group}"}]}
                    ],
                    completion=f"<answer>{step}{group}{index}</answer>",
                    images=images,
                    rewards={"accuracy": accuracy, "numeric": None if index else 0.25},
                    reward=accuracy + (0.0 if index else 0.125),
                    advantage=0.5 if index else -0.5,
                    completion_length=5,
                    truncated=False,
                    row=group,
                )
            )
    return rows


def metrics_for(step: int) -> dict[str, float]:
    return {"reward": 0.25 * step, "loss": 1.0 / step, "rewards/accuracy/mean": 0.5, "kl": 0.0}


def drive(callback: TrackersCallback, steps: int = 3, name: str = "synthetic") -> None:
    report_to = [n for n in callback.report_to if n in ("trackio", "wandb")]  # test doubles are not config names
    config = parse_config({"name": name, "logging": {"report_to": report_to}, "resources": {"gpus": 0}})
    callback.on_start(config, 0)
    for step in range(1, steps + 1):
        callback.on_metrics(step, metrics_for(step))
        callback.on_samples(step, rows_for(step))
    callback.on_end("succeeded")


def pixels(png_bytes: bytes) -> tuple:
    image = Image.open(io.BytesIO(png_bytes)).convert("RGB")
    return image.size, image.getpixel((0, 0))


# ---------------------------------------------------------------- tests


def test_report_to_validation():
    def report_to(value):
        return parse_config({"logging": {"report_to": value}}).logging.report_to

    assert parse_config({}).logging.report_to == []
    assert report_to("wandb") == ["wandb"]  # TRL accepts a single name
    assert report_to(["trackio", "wandb", "trackio"]) == ["trackio", "wandb"]
    assert report_to("none") == [] and report_to(["none"]) == [] and report_to(None) == []
    again = parse_config(parse_config({"logging": {"report_to": ["wandb"]}}).model_dump(mode="json"))
    assert again.logging.report_to == ["wandb"]  # a resolved config loads again
    with pytest.raises(ConfigError) as err:
        report_to(["trackio", "mlflow"])
    assert err.value.errors == [("logging.report_to[1]", "must be one of 'trackio', 'wandb' or 'none'")]
    with pytest.raises(ConfigError) as err:
        report_to(["none", "wandb"])
    assert err.value.errors[0][0] == "logging.report_to" and "none" in err.value.errors[0][1]
    with pytest.raises(ConfigError) as err:
        report_to({"wandb": {"project": "elsewhere"}})  # a destination is never the client's to choose
    assert err.value.errors[0][0] == "logging.report_to"
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        TrackersCallback(["mlflow"], print)


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


class Failing(Backend):
    name = module = "flaky"

    def __init__(self, fail_on: str):
        self.fail_on = fail_on
        self.calls: list[str] = []

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if what == self.fail_on:
            raise ConnectionError("tracker unreachable")

    def start(self, name, config, run_id):
        self._call("start")

    def log(self, step, metrics):
        self._call(f"log {step}")

    def log_rollouts(self, step, rows):
        self._call(f"rollouts {step}")

    def finish(self, status):
        self._call("finish")


def test_failing_tracker_warns_once_and_stops(tracker_env):
    warnings: list[str] = []
    flaky = Failing("log 2")
    backends = {"flaky": lambda: flaky, "trackio": TrackioBackend}
    callback = TrackersCallback(["flaky", "trackio"], warnings.append, run_id="flaky0001", backends=backends)
    drive(callback, steps=3, name="flaky")
    assert flaky.calls == ["start", "log 1", "rollouts 1", "log 2"]  # nothing after the failure
    assert len(warnings) == 1
    assert "flaky" in warnings[0] and "step 2's metrics" in warnings[0] and "tracker unreachable" in warnings[0]
    # the other tracker is untouched by its neighbour's failure
    assert sorted(e["step"] for e in trackio_logs("flaky-flaky0001") if "reward" in e) == [1, 2, 3]


def test_stalled_tracker_never_blocks_the_loop():
    release = threading.Event()

    class Stalled(Failing):
        def log(self, step, metrics):
            self.calls.append(f"log {step}")
            release.wait(30)

    stalled = Stalled("never")
    warnings: list[str] = []
    callback = TrackersCallback(
        ["stalled"], warnings.append, finish_timeout=0.2, queue_size=2, backends={"stalled": lambda: stalled}
    )
    drive(callback, steps=4, name="stalled")  # returns although the tracker never gets past step 1
    release.set()
    assert "log 1" in stalled.calls and "finish" not in stalled.calls
    assert any("falling behind: dropped" in w for w in warnings)
    assert any("still sending" in w and "COLLAGE_TRACKER_TIMEOUT" in w for w in warnings)


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails like a missing package
    warnings: list[str] = []
    callback = TrackersCallback(["wandb"], warnings.append, backends={"wandb": WandbBackend})
    drive(callback, steps=2)
    assert len(warnings) == 1
    assert "pip install 'collage-rl[trackers]'" in warnings[0] and "wandb" in warnings[0]
    assert "run goes on" in warnings[0]


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
