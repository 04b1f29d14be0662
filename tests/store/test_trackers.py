"""Mirroring runs to trackio and Weights & Biases (``logging.report_to``; worker/trackers.py): a failing tracker warns
once and stops while the other, trackio for real and locally (its SQLite store under ``TRACKIO_DIR``), stores every
step."""

from __future__ import annotations

import importlib.util

import pytest

from collage.worker.trackers import TrackersCallback, TrackioBackend
from tests.support.trackers import (
    Failing,
    drive,
    trackio_logs,
)

# found, not imported: trackio reads TRACKIO_DIR when first imported, which must happen inside tracker_env
if importlib.util.find_spec("trackio") is None or importlib.util.find_spec("wandb") is None:
    pytest.skip("the trackers extra is not installed: pip install 'collage-rl[trackers]'", allow_module_level=True)


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
