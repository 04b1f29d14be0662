"""Helpers of the tests that train tiny models in-process: a small run config and a callback that records what a
run reports."""

from __future__ import annotations

from collage.training.callbacks import Callback
from collage.training.config import parse_config


def make_config(**sections):
    base = {
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": "synth:count-red", "rows": 24, "min_images": 0, "max_images": 3},
        "rewards": [{"name": "numeric"}, {"name": "accuracy"}],
        "train": {
            "max_steps": 2,
            "learning_rate": 1e-3,
            "per_device_train_batch_size": 8,
            "num_generations": 4,
            "max_prompt_length": 256,
            "max_completion_length": 6,
        },
        "resources": {"gpus": 0},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return parse_config(base)


class Recorder(Callback):
    def __init__(self, stop_after: int | None = None):
        self.metrics, self.samples, self.events, self.ended = [], [], [], None
        self.stop_after = stop_after

    def on_metrics(self, step, metrics):
        self.metrics.append((step, metrics))

    def on_samples(self, step, rows):
        self.samples.extend(rows)

    def on_event(self, level, message):
        self.events.append((level, message))

    def should_stop(self):
        return self.stop_after is not None and len(self.metrics) >= self.stop_after

    def on_end(self, status, error=None):
        self.ended = (status, error)
