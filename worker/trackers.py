"""Mirroring a run to experiment trackers: trackio and Weights & Biases (``logging.report_to``, TRL's name).

A run config only names the trackers (the client opts in); where the data goes is decided by the operator's
environment on the worker alone (``TRACKIO_PROJECT``, ``TRACKIO_DIR``, ``TRACKIO_SPACE_ID``, ``WANDB_PROJECT``,
``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_DIR``, ... see docs): nothing in the config is passed to a tracker as
a destination.

Each tracker gets its own background thread and bounded queue, so a slow tracker never slows the training loop
and never holds back the other tracker or the store: the loop only queues work (it never waits; when a tracker
falls that far behind, its oldest-pending work is kept and the new item is dropped, with one warning). A
tracker that fails (import, init, a log call, finish) becomes one ``warning`` event on the run and mirroring to
that tracker stops; the run goes on. When the run ends, each tracker gets a bounded time to finish.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from collage.app.core.extras import missing_extra
from collage.training.callbacks import Callback, RolloutRow
from collage.training.rewards.builtins import prompt_text

log = logging.getLogger("collage.worker")

TRACKERS = ("trackio", "wandb")
DEFAULT_PROJECT = "collage"
TABLE_KEY = "rollouts"
FINISH_TIMEOUT_ENV = "COLLAGE_TRACKER_TIMEOUT"  # seconds a tracker may take to finish once the run ended
DEFAULT_FINISH_TIMEOUT = 60.0
QUEUE_SIZE = 256  # pending metrics/tables per tracker before new ones are dropped

Warn = Callable[[str], None]


def _pil(png: bytes) -> Any:
    from collage.training.infra.images import open_raster_file

    image = open_raster_file(io.BytesIO(png))
    image.load()
    return image


def table_columns(reward_names: Sequence[str]) -> list[Any]:
    """The rollout table's columns: one per reward function (``rewards/<name>``), images last."""
    return [
        "step",
        "group",
        "index",
        "prompt",
        "completion",
        "reward",
        *(f"rewards/{name}" for name in reward_names),
        "advantage",
        "images",
    ]


def table_rows(rows: Sequence[RolloutRow], make_image: Callable[[Any], Any]) -> tuple[list[Any], list[list[Any]]]:
    """``(columns, data)`` of one step's rollout rows; each row's images as a list of ``make_image(PIL image)``
    (decoded from the rollout's PNG, so the tracker stores exactly what the store shows)."""
    names: list[str] = []
    for row in rows:
        names.extend(name for name in row.rewards if name not in names)
    data = []
    for row in rows:
        data.append(
            [
                row.step,
                row.group,
                row.index,
                prompt_text(row.prompt),
                row.completion,
                row.reward,
                *(row.rewards.get(name) for name in names),
                row.advantage,
                [make_image(_pil(image.png)) for image in row.images],
            ]
        )
    return table_columns(names), data


class Backend:
    """One tracker's client. Every method runs on the tracker's own thread; any exception stops the mirror."""

    name = ""
    module = ""  # the package it needs (a ModuleNotFoundError for it names the trackers extra)

    def start(self, name: str, config: dict[str, Any], run_id: str | None) -> None:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_rollouts(self, step: int, rows: Sequence[RolloutRow]) -> None:
        raise NotImplementedError

    def finish(self, status: str) -> None:
        raise NotImplementedError


class TrackioBackend(Backend):
    """trackio: local SQLite under ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``), or a Space /
    self-hosted server when the operator sets ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL``; the project is
    ``TRACKIO_PROJECT`` (default ``collage``)."""

    name = module = "trackio"

    def start(self, name: str, config: dict[str, Any], run_id: str | None) -> None:
        import trackio

        self.trackio = trackio
        project = os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT
        # trackio keys runs by name: the Collage id keeps two runs of the same name apart, and a resumed
        # attempt continues the same trackio run
        run_name = f"{name}-{run_id}" if run_id else name
        self.run = trackio.init(
            project=project,
            name=run_name,
            config=config,
            resume="allow",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_rollouts(self, step: int, rows: Sequence[RolloutRow]) -> None:
        columns, data = table_rows(rows, self.trackio.Image)
        self.run.log({TABLE_KEY: self.trackio.Table(columns=columns, data=data)}, step=step)

    def finish(self, status: str) -> None:
        self.run.finish()


class WandbBackend(Backend):
    """Weights & Biases: everything from the operator's ``WANDB_*`` environment (``WANDB_API_KEY``,
    ``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_DIR``, ``WANDB_BASE_URL``...); the project is ``WANDB_PROJECT``
    (default ``collage``). The W&B run id is the Collage run id, so a resumed attempt continues the same run."""

    name = module = "wandb"

    def start(self, name: str, config: dict[str, Any], run_id: str | None) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=config,
            reinit="create_new",  # never touches a run the process may already have
            # the worker's own stdout/stderr stay as they are (W&B would otherwise wrap them)
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_rollouts(self, step: int, rows: Sequence[RolloutRow]) -> None:
        columns, data = table_rows(rows, self.wandb.Image)
        self.run.log({TABLE_KEY: self.wandb.Table(columns=columns, data=data)}, step=step)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status in ("succeeded", "cancelled") else 1)


BACKENDS: dict[str, Callable[[], Backend]] = {"trackio": TrackioBackend, "wandb": WandbBackend}

_STOP = object()


class Mirror:
    """One tracker on its own thread. ``submit`` never blocks; after the first failure nothing more runs."""

    def __init__(self, backend: Backend, warn: Warn, queue_size: int = QUEUE_SIZE) -> None:
        self.backend = backend
        self.name = backend.name
        self.warn = warn
        self.failed = False
        self.dropped = 0
        self._queue: queue.Queue[Any] = queue.Queue(queue_size)
        self._thread = threading.Thread(target=self._run, name=f"collage-{self.name}", daemon=True)
        self._thread.start()

    def submit(self, what: str, task: Callable[[], None]) -> None:
        if self.failed:
            return
        try:
            self._queue.put_nowait((what, task))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self._warn(f"{self.name} is falling behind: dropped {what} (later drops are counted, not reported)")

    def _warn(self, message: str) -> None:
        try:
            self.warn(message)
        except Exception:  # the run's own event sink failing is not this mirror's business
            log.exception("could not record a tracker warning: %s", message)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            what, task = item
            if self.failed:
                continue
            try:
                task()
            except BaseException as exc:  # a tracker never fails the run: one warning, then stop
                self.failed = True
                missing = None
                if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == self.backend.module:
                    missing = missing_extra(exc, f"mirroring to {self.name}")  # the trackers extra
                if missing is not None:
                    self._warn(f"{missing}; the run goes on without {self.name}")
                else:
                    detail = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:400]
                    self._warn(f"{self.name}: mirroring stopped ({what} failed: {detail}); the run goes on")
                log.warning("mirroring to %s stopped", self.name, exc_info=exc)

    def close(self, timeout: float) -> bool:
        """Stop after everything queued ran; False if that took longer than ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:  # the stop marker must get in even when the queue is full
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() >= deadline or not self._thread.is_alive():
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


class TrackersCallback(Callback):
    """Mirrors a run (metrics every step, same keys; the rollout table with its images; name and config) to
    each tracker in ``report_to``. ``warn`` records a warning on the run (the worker: a store event).

    ``backends`` maps a tracker name to a factory; tests pass failing ones."""

    def __init__(
        self,
        report_to: Sequence[str],
        warn: Warn,
        run_id: str | None = None,
        finish_timeout: float | None = None,
        backends: dict[str, Callable[[], Backend]] | None = None,
        queue_size: int = QUEUE_SIZE,
    ) -> None:
        factories = BACKENDS if backends is None else backends
        unknown = [name for name in report_to if name not in factories]
        if unknown:
            raise ValueError(f"unknown tracker {unknown[0]!r}: must be one of {', '.join(factories)}")
        self.report_to = list(dict.fromkeys(report_to))
        self.factories = factories
        self.warn = warn
        self.run_id = run_id
        if finish_timeout is None:
            finish_timeout = float(os.environ.get(FINISH_TIMEOUT_ENV) or DEFAULT_FINISH_TIMEOUT)
        self.finish_timeout = finish_timeout
        self.queue_size = queue_size
        self.mirrors: list[Mirror] = []

    def on_start(self, config: Any, resumed_from_step: int) -> None:
        self._close()  # a second train() on the same callback starts over
        data = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config or {})
        if self.run_id:
            data["collage_run_id"] = self.run_id
        name = str(data.get("name") or self.run_id or "collage-run")
        for tracker in self.report_to:
            backend = self.factories[tracker]()
            mirror = Mirror(backend, self.warn, self.queue_size)
            mirror.submit("start", partial(backend.start, name, data, self.run_id))
            self.mirrors.append(mirror)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        metrics = dict(metrics)
        for mirror in self.mirrors:
            mirror.submit(f"step {step}'s metrics", partial(mirror.backend.log, step, metrics))

    def on_samples(self, step: int, rows: Sequence[RolloutRow]) -> None:
        rows = list(rows)
        for mirror in self.mirrors:
            mirror.submit(f"step {step}'s rollout table", partial(mirror.backend.log_rollouts, step, rows))

    def on_end(self, status: str, error: str | None = None) -> None:
        for mirror in self.mirrors:
            mirror.submit("finish", partial(mirror.backend.finish, status))
        self._close()

    def _close(self) -> None:
        deadline = time.monotonic() + self.finish_timeout
        for mirror in self.mirrors:  # the trackers finish in parallel: one deadline for all
            if not mirror.close(max(0.0, deadline - time.monotonic())):
                mirror.failed = True
                mirror._warn(
                    f"{mirror.name}: still sending {self.finish_timeout:g} s after the run ended; left behind "
                    f"(set {FINISH_TIMEOUT_ENV} to wait longer)"
                )
            elif mirror.dropped:
                mirror._warn(f"{mirror.name}: {mirror.dropped} updates were dropped because it fell behind")
        self.mirrors = []
