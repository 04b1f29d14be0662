"""A terminal progress bar for ``collage train``: step, reward, time left."""

from __future__ import annotations

import sys

from collage.training.callbacks import Callback


class ProgressBar(Callback):
    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.enabled  # not a terminal: one line per step instead
        self.progress = None
        self.task = None
        self.reward = float("nan")

    def on_start(self, config, resumed_from_step):
        if not self.enabled:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("reward {task.fields[reward]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            config.name, total=config.train.max_steps, completed=resumed_from_step, reward="-"
        )

    def on_metrics(self, step, metrics):
        self.reward = metrics.get("reward", float("nan"))

    def on_progress(self, step, max_steps, seconds_per_step):
        if self.progress is not None:
            self.progress.update(self.task, completed=step, reward=f"{self.reward:.3f}")
        elif self.plain:
            left = (max_steps - step) * (seconds_per_step or 0)
            print(f"step {step}/{max_steps} reward {self.reward:.3f} ({left:.0f}s left)", file=sys.stderr, flush=True)

    def on_event(self, level, message):
        if level in ("warning", "error") and (self.enabled or self.plain):
            print(f"[{level}] {message}", file=sys.stderr, flush=True)

    def close(self):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
