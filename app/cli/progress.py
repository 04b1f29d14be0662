"""A terminal progress bar for ``collage train``: step, reward, time left."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from collage.training.callbacks import Callback

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class ProgressBar(Callback):
    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.enabled  # not a terminal: one line per step instead
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.reward = float("nan")
        self.eval_reward: float | None = None

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
        # a step-0 record (eval_on_start) holds only eval keys: the training reward is unknown until step 1
        if "reward" in metrics:
            self.reward = metrics["reward"]
        if "eval/reward" in metrics:
            self.eval_reward = metrics["eval/reward"]

    def _shown(self) -> str:
        shown = "-" if self.reward != self.reward else f"{self.reward:.3f}"
        return shown if self.eval_reward is None else f"{shown} (eval {self.eval_reward:.3f})"

    def on_progress(self, step, max_steps, seconds_per_step):
        if self.progress is not None:
            assert self.task is not None  # added with the bar
            self.progress.update(self.task, completed=step, reward=self._shown())
        elif self.plain:
            left = (max_steps - step) * (seconds_per_step or 0)
            print(f"step {step}/{max_steps} reward {self._shown()} ({left:.0f}s left)", file=sys.stderr, flush=True)

    def on_event(self, level, message):
        if level in ("warning", "error") and (self.enabled or self.plain):
            print(f"[{level}] {message}", file=sys.stderr, flush=True)

    def close(self):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def quiet_library_progress_bars() -> None:
    """No Hugging Face progress bars ("Loading weights", "Writing model shards", datasets' "Map") from this process
    and the processes it starts. They belong to an interactive session of those libraries: in `collage serve` and
    `collage worker` they come from background processes that share the terminal (`scripts/demo.sh` follows its
    run there with `collage submit --follow`, and a worker's output is its log), and `collage train` draws its own
    bar. Set through the libraries' environment variables before they are imported, so the workers' training
    processes and the dataset helper inherit it; a value the user set stays."""
    import os

    # written, never read as configuration: these are the libraries' own switches, inherited by the children
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(name, "1")
    import importlib

    # a library imported already read its variable then: switch it off through its own function too
    for module, function in (("huggingface_hub.utils", "disable_progress_bars"),
                             ("transformers.utils.logging", "disable_progress_bar"),
                             ("datasets.utils.tqdm", "disable_progress_bars")):  # fmt: skip
        if module.split(".")[0] in sys.modules:
            getattr(importlib.import_module(module), function)()


class CountProgress:
    """Progress of a long count (``collage data check``'s rows) on stderr: a bar on a terminal, else a line at
    every tenth of the way, so a log shows it is moving. ``update(done, total)``; ``close()`` at the end."""

    def __init__(self, what: str):
        self.what = what
        self.tty = sys.stderr.isatty()
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.shown_tenth = 0

    def update(self, done: int, total: int) -> None:
        if self.tty:
            if self.progress is None:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

                self.progress = Progress(TextColumn(self.what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                         console=None, transient=True)  # fmt: skip
                self.progress.start()
                self.task = self.progress.add_task(self.what, total=total)
            assert self.task is not None  # added with the bar
            self.progress.update(self.task, completed=done)
            return
        tenth = done * 10 // max(total, 1)
        if total >= 1000 and tenth > self.shown_tenth:
            self.shown_tenth = tenth
            print(f"{self.what} {done}/{total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
