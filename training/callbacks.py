"""How the trainer reports to the outside world without knowing who listens.

The command line plugs in an output folder and a progress bar; the worker plugs in the run store and
cancellation. ``training/`` never imports either.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import logging
import math
import queue
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class RolloutImage:
    """An image of a rollout row, by content hash, with the bytes written once per distinct image by whoever
    stores them (PNG, or the dataset file's own PNG bytes).

    Built either from known ``sha256`` + ``png`` (a dataset PNG: nothing to encode) or from a PIL ``image`` that
    is PNG-encoded lazily, on first access to ``sha256`` or ``png``: that happens wherever the row is written,
    which for the output folder and the store is their background writer thread, not the training loop."""

    def __init__(self, sha256: str | None, png: bytes | None, width: int, height: int, image: Any = None) -> None:
        if (sha256 is None or png is None) and image is None:
            raise ValueError("RolloutImage needs sha256 and png, or an image to encode")
        self._sha256 = sha256 if png is not None else None
        self._png = png
        self.width = width
        self.height = height
        self._image = image
        self._lock = threading.Lock()

    def _encode(self) -> None:
        with self._lock:
            if self._png is None:
                buf = io.BytesIO()
                self._image.save(buf, format="PNG")
                data = buf.getvalue()
                self._sha256 = hashlib.sha256(data).hexdigest()
                self._png = data
                self._image = None

    @property
    def encoded(self) -> bool:
        return self._png is not None

    @property
    def sha256(self) -> str:
        if self._png is None:
            self._encode()
        assert self._sha256 is not None
        return self._sha256

    @property
    def png(self) -> bytes:
        if self._png is None:
            self._encode()
        assert self._png is not None
        return self._png

    def __getstate__(self) -> dict[str, Any]:  # checkpoints pickle the generation buffer, rows included
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        sha = self._sha256 if self._png is not None else "<not encoded>"
        return f"RolloutImage(sha256={sha}, width={self.width}, height={self.height})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutImage):
            return NotImplemented
        return (self.sha256, self.width, self.height) == (other.sha256, other.width, other.height)

    __hash__ = None  # type: ignore[assignment]  # mutable (lazily encoded)


log = logging.getLogger("collage.training")

_LIVE_WRITERS: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


@atexit.register
def _drain_writers() -> None:
    """Flush on exit: whatever is still queued reaches its sink even if the owner never closed its writer (the error
    of a failed one is logged; a writer its owner closed is no longer listed)."""
    for writer in list(_LIVE_WRITERS):
        try:
            writer.close()
        except BaseException:
            log.exception("a background writer failed while draining at exit")


class BackgroundWriter:
    """Runs write tasks in order on one background thread, off the training loop.

    ``put`` queues a task and blocks while ``maxsize`` tasks are already waiting (back-pressure: a slow sink
    slows the loop down rather than buffering without bound). ``flush`` waits until every queued task ran;
    ``close`` drains the queue and stops the thread (idempotent).

    One rule for failures: once a task raises, nothing more is written (the tasks still queued, and any queued
    later, never run) and every later ``put``, ``flush`` and ``close`` raises that same error, so nothing fails or
    is dropped silently. ``on_error`` runs on the writer thread after the error is recorded; it may end the process
    (the worker does that for a superseded attempt); if it raises, that is logged and the task's error stands. The
    thread catches everything a task or the hook raises, so it lives until ``close`` and no call waits for ever."""

    _STOP = object()

    def __init__(
        self, maxsize: int = 8, name: str = "collage-writer", on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize)
        self._error: BaseException | None = None
        self._error_tb: Any = None
        self._on_error = on_error
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LIVE_WRITERS.add(self)

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is self._STOP:
                    return
                if self._error is None:  # after a failure the queue is drained without running anything
                    self._call(task)
            finally:
                self._queue.task_done()

    def _call(self, task: Callable[[], Any]) -> None:
        try:
            task()
        except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the caller's thread
            # recorded before the hook runs: whatever the hook does, no later task runs and every later call raises
            self._error_tb = exc.__traceback__
            self._error = exc
            if self._on_error is not None:
                try:
                    self._on_error(exc)
                except BaseException:  # the task's error is the one the owner must see
                    log.exception("%s: the on_error hook raised while handling %r", self._thread.name, exc)

    def _raise(self) -> None:
        """Raise the recorded error (every time: it is never cleared), with the traceback of the failed task."""
        error = self._error
        if error is not None:
            raise error.with_traceback(self._error_tb)

    def put(self, task: Callable[[], Any]) -> None:
        """Queue ``task``; blocks while the queue is full. Raises the error of an earlier task, if any."""
        self._raise()
        if self._closed:
            raise RuntimeError("BackgroundWriter is closed")
        self._queue.put(task)  # a failed writer keeps draining its queue, so room comes
        self._raise()  # a task failed while this one waited for room: it will not run

    def flush(self) -> None:
        """Wait until every queued task ran; raises the error of a task, if any."""
        self._raise()
        self._queue.join()
        self._raise()

    def close(self) -> None:
        """Run everything still queued, stop the thread (idempotent); raises the error of a task, if any."""
        with self._lock:
            if not self._closed:
                self._closed = True
                _LIVE_WRITERS.discard(self)
                self._queue.put(self._STOP)
                self._thread.join()
        self._raise()

    @property
    def closed(self) -> bool:
        return self._closed


COLUMN_TEXT_MAX = 1000  # a dataset column's text is cut to this many characters (then "…") in a rollout row
COLUMNS_MAX = 64  # at most this many dataset columns per rollout row (the first ones, in the dataset's order)


def scalar_columns(columns: Mapping[str, Any] | None) -> dict[str, Any]:
    """The scalar columns of a dataset row as a rollout row keeps them: str, int, float, bool and None values
    (anything else, lists and nested objects, is left out); text longer than :data:`COLUMN_TEXT_MAX` characters
    cut to that many followed by ``…``; NaN and infinities as None (JSON has no such numbers); at most
    :data:`COLUMNS_MAX` columns. NumPy scalars count as the Python number they hold."""
    out: dict[str, Any] = {}
    for key, value in (columns or {}).items():
        if len(out) >= COLUMNS_MAX:
            break
        if not isinstance(key, str) or key in ("prompt", "images", "image"):
            continue
        if hasattr(value, "item") and not isinstance(value, str | bytes):  # a NumPy or torch scalar
            try:
                value = value.item()
            except (TypeError, ValueError):  # an array of more than one value: not a scalar
                continue
        if value is None or isinstance(value, bool | int):
            out[key] = value
        elif isinstance(value, float):
            out[key] = value if math.isfinite(value) else None
        elif isinstance(value, str):
            out[key] = value if len(value) <= COLUMN_TEXT_MAX else value[:COLUMN_TEXT_MAX] + "…"
    return out


@dataclass
class TrajectoryTurn:
    """One turn of a rollout row's trajectory, its images by content hash like the row's own. ``sources[i]``: where
    tool image ``i`` came from, ``{"image": k, "bbox_2d": [x1, y1, x2, y2]}`` (image ``k`` of the rollout, the row's
    images first, then the tool images in order), or None."""

    role: str  # "assistant" | "tool"
    text: str
    tool_call: dict[str, Any] | None = None  # {"name", "arguments"}
    images: list[RolloutImage] = field(default_factory=list)
    sources: list[dict[str, Any] | None] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The contract's turn (``url`` is added by whoever serves the images)."""
        out: dict[str, Any] = {"role": self.role, "text": self.text}
        if self.tool_call is not None:
            out["tool_call"] = self.tool_call
        if self.images:
            out["images"] = [
                {"sha256": im.sha256, "width": im.width, "height": im.height,
                 **({"source": src} if src is not None else {})}
                for im, src in zip(self.images, self.sources or [None] * len(self.images), strict=True)
            ]  # fmt: skip
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass
class RolloutRow:
    """One completion of the rollout table (contract: a rollout row), with its images by content hash.
    ``columns``: the dataset row's scalar columns besides the prompt and images (``answer``, ...), kept as
    :func:`scalar_columns` says."""

    step: int
    group: int
    index: int
    prompt: Any
    completion: str
    images: list[RolloutImage]
    rewards: dict[str, float | None]
    reward: float | None
    advantage: float
    completion_length: int
    truncated: bool
    row: int  # dataset row
    group_mean: float | None = None
    group_std: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)
    # "train": a rollout the policy learns from; "eval": a held-out evaluation rollout (advantage 0, group = the
    # held-out prompt's place in the evaluation, step = the optimizer step evaluated, 0 for eval_on_start)
    split: str = "train"
    # a multi-turn rollout's turns (run with tools; contract: a rollout row's ``trajectory``), empty otherwise
    trajectory: list[TrajectoryTurn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.columns = scalar_columns(self.columns)

    def __setstate__(self, state: dict[str, Any]) -> None:  # a checkpoint pickled before rows had columns/split
        state.setdefault("columns", {})
        state.setdefault("split", "train")
        state.setdefault("trajectory", [])
        self.__dict__.update(state)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "group": self.group,
            "index": self.index,
            "prompt": self.prompt,
            "completion": self.completion,
            "images": [{"sha256": im.sha256, "width": im.width, "height": im.height} for im in self.images],
            "rewards": self.rewards,
            "reward": self.reward,
            "advantage": self.advantage,
            "completion_length": self.completion_length,
            "truncated": self.truncated,
            "dataset_row": self.row,
            "group_mean": self.group_mean,
            "group_std": self.group_std,
            "columns": self.columns,
            "split": self.split,
            "trajectory": [turn.to_json() for turn in self.trajectory],
        }


@dataclass(frozen=True)
class CheckpointInfo:
    """What a saved checkpoint holds, for whoever lists it (the store, the output folder's ``checkpoint.json``)."""

    step: int
    path: str  # the checkpoint folder (its ``model/`` is a from_pretrained folder: the model, or the LoRA adapter)
    kind: str  # "adapter" (LoRA: model/ holds the adapter only) or "full"
    bytes: int  # the size of model/ (what a download or an export moves)
    metric: float | None = None  # train.metric_for_best_model at this step, when the run has one and it was logged


class Callback:
    """Override what you need; every method is optional."""

    def on_start(self, config: Any, resumed_from_step: int) -> None: ...

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_samples(self, step: int, rows: Sequence[RolloutRow]) -> None: ...

    def on_event(self, level: str, message: str) -> None: ...

    def on_progress(self, step: int, max_steps: int, seconds_per_step: float | None) -> None: ...

    def on_checkpoint(self, step: int, path: str, info: CheckpointInfo) -> None: ...

    def on_checkpoint_removed(self, step: int, path: str) -> None:
        """``train.save_total_limit`` deleted the checkpoint of ``step`` (its folder is gone)."""

    def should_stop(self) -> bool:
        """Polled once per step; True makes the trainer save a checkpoint and stop (cancellation)."""
        return False

    def on_end(self, status: str, error: str | None = None) -> None: ...


class CallbackList(Callback):
    """Every notification reaches every callback, in order. A callback that raises has failed: its error is raised
    once the other callbacks have heard that notification too, and from then on it hears nothing but ``on_end`` (to
    release what it holds). So the trainer's failure path (``on_event("error")``, then ``on_end("failed")``) reaches
    every other callback, though the failed one raises again in ``on_end`` (a background writer that failed raises
    its error on every later call)."""

    def __init__(self, callbacks: Sequence[Callback] = ()):
        self.callbacks = list(callbacks)
        self._failed: set[int] = set()  # id() of the callbacks that raised

    def _each(self, method: str, *args: Any, to_failed: bool = False) -> None:
        error: BaseException | None = None
        for cb in self.callbacks:
            if id(cb) in self._failed and not to_failed:
                continue
            try:
                getattr(cb, method)(*args)
            except BaseException as exc:  # noqa: BLE001 - raised again once every callback has heard it
                self._failed.add(id(cb))
                error = error or exc
        if error is not None:
            raise error

    def on_start(self, config, resumed_from_step):
        self._each("on_start", config, resumed_from_step)

    def on_metrics(self, step, metrics):
        self._each("on_metrics", step, metrics)

    def on_samples(self, step, rows):
        self._each("on_samples", step, rows)

    def on_event(self, level, message):
        self._each("on_event", level, message)

    def on_progress(self, step, max_steps, seconds_per_step):
        self._each("on_progress", step, max_steps, seconds_per_step)

    def on_checkpoint(self, step, path, info):
        self._each("on_checkpoint", step, path, info)

    def on_checkpoint_removed(self, step, path):
        self._each("on_checkpoint_removed", step, path)

    def should_stop(self) -> bool:
        return any(cb.should_stop() for cb in self.callbacks)

    def on_end(self, status, error=None):
        self._each("on_end", status, error, to_failed=True)
