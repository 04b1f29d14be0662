"""Mirroring runs to trackio and Weights & Biases (``logging.report_to``; worker/trackers.py), with stand-in trackers:
``report_to`` validated and normalised, a stalled tracker never blocks the loop, and a missing package names the
extra to install."""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest

from collage.training.config import ConfigError, parse_config
from collage.worker.trackers import TrackersCallback, WandbBackend
from tests.support.trackers import (
    Failing,
    drive,
)

# found, not imported: trackio reads TRACKIO_DIR when first imported, which must happen inside tracker_env
if importlib.util.find_spec("trackio") is None or importlib.util.find_spec("wandb") is None:
    pytest.skip("the trackers extra is not installed: pip install 'collage-rl[trackers]'", allow_module_level=True)


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
