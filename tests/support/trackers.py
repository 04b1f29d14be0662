"""What the tracker tests of several tiers share (worker/trackers.py): trackio and W&B pointed at local folders,
rollout rows with real images, a callback driven through a short fake run, and a tracker that fails."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image

from collage.training.callbacks import RolloutImage, RolloutRow
from collage.training.config import parse_config
from collage.worker.trackers import Backend, TrackersCallback

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


def trackio_logs(run_name: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(TRACKIO_PROJECT, run_name)


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
