"""The training callback that writes a run into the store and polls for cancellation."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from collage.app.store.tables import RunStatus
from collage.app.store.writer import ImageIn, SampleIn, StaleAttempt, StoreWriter
from collage.training.callbacks import BackgroundWriter, Callback, CheckpointInfo, RolloutRow
from collage.training.infra.objectstore import ObjectMirror

from .checkpoint_publisher import CheckpointPublisher
from .heartbeat import Heartbeat

log = logging.getLogger("collage.worker")

EXIT_STALE = 4  # the child's exit code when its attempt was superseded


def _sample_in(row: RolloutRow) -> SampleIn:
    return SampleIn(
        group=row.group,
        index=row.index,
        prompt=row.prompt,
        completion=row.completion,
        images=[ImageIn(png=im.png, sha256=im.sha256) for im in row.images],
        rewards=row.rewards,
        reward=row.reward,
        advantage=row.advantage,
        completion_length=row.completion_length,
        truncated=row.truncated,
        group_mean=row.group_mean,
        group_std=row.group_std,
        dataset_row=row.row,
        columns=row.columns,
        split=row.split,
    )


class StoreCallback(Callback):
    """Writes a run into the store through an attempt-guarded writer: when the attempt stops being current
    (reaped as lost, resumed as a newer attempt, deleted), the next write or heartbeat raises StaleAttempt and
    the heartbeat thread ends the process at once, within one heartbeat interval.

    Metrics, samples (with their PNG encoding), events, progress and checkpoints go through one bounded
    :class:`BackgroundWriter`, in the order the trainer reported them (step N's metrics before step N's
    progress); a StaleAttempt raised there ends the process like the heartbeat does. ``on_end`` drains it."""

    def __init__(
        self,
        writer: StoreWriter,
        run_id: str,
        heartbeat_every: float = 5.0,
        ready_file: str | None = None,
        queue_size: int = 8,
        artifacts: Path | None = None,
        mirror: ObjectMirror | None = None,
    ):
        self.writer = writer
        # with object storage a checkpoint is uploaded (off the loop, on its own thread: a large model must not hold
        # up the metrics) and recorded, relative to the artifacts, only once its manifest is in the bucket
        self.publisher = None
        if mirror is not None and artifacts is not None:
            self.publisher = CheckpointPublisher(
                writer, run_id, artifacts, mirror, store_flush=self.flush_store_writes, on_error=self._stale
            )
        self.queue_size = queue_size
        self._background: BackgroundWriter | None = None
        self.run_id = run_id
        self.heartbeat_every = heartbeat_every
        self.ready_file = ready_file
        self._heartbeat: Heartbeat | None = None
        self.final: tuple[str, str | None] | None = None

    def _beat(self) -> None:
        # a long step must not look like a dead worker; a failed beat is logged by Heartbeat, and the writer has
        # already retried it
        try:
            self.writer.heartbeat(self.run_id)
        except StaleAttempt:
            log.error("run %s: this attempt is no longer current; stopping now", self.run_id)
            os._exit(EXIT_STALE)  # nothing it would still write may reach the store or the run folder

    def start_heartbeat(self) -> None:
        if self._heartbeat is None:
            self.writer.heartbeat(self.run_id)
            if self.ready_file:
                Path(self.ready_file).touch()  # the supervisor stops beating for us
            self._heartbeat = Heartbeat(self._beat, self.heartbeat_every, "collage-heartbeat").start()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(wait=False)

    def _stale(self, exc: BaseException) -> None:
        """Runs on the background writer's thread when a write fails: a superseded attempt stops at once."""
        if isinstance(exc, StaleAttempt):
            log.error("run %s: this attempt is no longer current; stopping now", self.run_id)
            os._exit(EXIT_STALE)  # nothing it would still write may reach the store or the run folder

    @property
    def background(self) -> BackgroundWriter:
        if self._background is None or self._background.closed:
            self._background = BackgroundWriter(self.queue_size, name="collage-store-writer", on_error=self._stale)
        return self._background

    def flush(self) -> None:
        if self._background is not None:
            self._background.flush()
        if self.publisher is not None:
            self.publisher.flush()

    def close(self) -> None:
        try:  # the uploads first: their records go after the store writes queued before them
            if self.publisher is not None:
                self.publisher.close()
        finally:
            if self._background is not None:
                self._background.close()

    def on_start(self, config, resumed_from_step: int) -> None:
        self.close()
        self.writer.begin_attempt(self.run_id, resumed_from_step, config.train.max_steps)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        metrics = dict(metrics)
        self.background.put(lambda: self.writer.append_metrics(self.run_id, step, metrics))

    def on_samples(self, step: int, rows: Sequence[RolloutRow]) -> None:
        rows = list(rows)  # PNG encoding (if any) happens in _sample_in, on the writer thread
        self.background.put(lambda: self.writer.append_samples(self.run_id, step, [_sample_in(r) for r in rows]))

    def on_event(self, level: str, message: str) -> None:
        self.background.put(lambda: self.writer.add_event(self.run_id, level, message))

    def on_progress(self, step: int, max_steps: int, seconds_per_step: float | None) -> None:
        self.background.put(lambda: self.writer.set_progress(self.run_id, step, seconds_per_step))

    def on_checkpoint(self, step: int, path: str, info: CheckpointInfo) -> None:
        if self.publisher is not None:
            self.publisher.publish(step, path, info)
            return
        self.background.put(
            lambda: self.writer.add_checkpoint(
                self.run_id, step, path, kind=info.kind, size=info.bytes, metric=info.metric
            )
        )

    def on_checkpoint_removed(self, step: int, path: str) -> None:
        if self.publisher is not None:
            self.publisher.remove(step, path)
            return
        self.background.put(lambda: self.writer.remove_checkpoint(self.run_id, step))

    def flush_store_writes(self) -> None:
        if self._background is not None:
            self._background.flush()

    def should_stop(self) -> bool:
        return self.writer.run_status(self.run_id) in (RunStatus.CANCELLING, RunStatus.CANCELLED, None)

    def on_end(self, status: str, error: str | None = None) -> None:
        self.final = (status, error)
        self.close()  # success, cancel or failure: every queued write is in the store before train() returns
