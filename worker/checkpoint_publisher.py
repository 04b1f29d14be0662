"""Checkpoints to object storage: each one uploaded off the training loop, then recorded in the store.

A checkpoint the store records is one any host can resume from: so it is recorded only after its every file and
then its manifest are in the bucket (:meth:`ObjectMirror.put_folder`), and after the metrics of its step are in the
store (a host that resumes from step N finds steps 1..N whole). The record holds the folder's path relative to the
artifacts (``runs/<id>/attempt-<n>/checkpoints/step-<N>``): each host caches the bucket in its own folder.

Uploads run on their own thread: a multi-gigabyte model must not hold up the metrics and rollouts behind it. A
superseded attempt ends the process like the store writer does; an upload the bucket refused for the whole retry
window fails the run with that error (the next checkpoint or the run's end raises it on the training thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from collage.app.store.writer import StoreWriter
from collage.training.callbacks import BackgroundWriter, CheckpointInfo
from collage.training.infra.objectstore import ObjectMirror, relative_to_root

log = logging.getLogger("collage.worker")


class CheckpointPublisher:
    def __init__(
        self,
        writer: StoreWriter,
        run_id: str,
        artifacts: Path,
        mirror: ObjectMirror,
        store_flush: Callable[[], None] = lambda: None,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        self.writer = writer
        self.run_id = run_id
        self.artifacts = artifacts
        self.mirror = mirror
        self.store_flush = store_flush
        self.on_error = on_error
        self._uploads: BackgroundWriter | None = None

    @property
    def uploads(self) -> BackgroundWriter:
        if self._uploads is None or self._uploads.closed:
            # two queued checkpoints at most: a third waits on the loop rather than piling up on the local disk
            self._uploads = BackgroundWriter(2, name="collage-checkpoint-upload", on_error=self.on_error)
        return self._uploads

    def _key(self, path: str) -> str:
        rel = relative_to_root(self.artifacts, path)
        if rel is None:
            raise ValueError(f"checkpoint {path} is not under the artifacts folder {self.artifacts}")
        return rel

    def publish(self, step: int, path: str, info: CheckpointInfo) -> None:
        rel = self._key(path)
        self.uploads.put(lambda: self._publish(step, Path(path), rel, info))

    def _publish(self, step: int, folder: Path, rel: str, info: CheckpointInfo) -> None:
        if not folder.is_dir():  # train.save_total_limit removed it before its turn came: nothing to publish
            log.info("run %s: checkpoint %s was removed before its upload", self.run_id, rel)
            return
        self.mirror.put_folder(rel, folder)
        self.store_flush()  # the step's metrics and rollouts first
        self.writer.add_checkpoint(self.run_id, step, rel, kind=info.kind, size=info.bytes, metric=info.metric)

    def remove(self, step: int, path: str) -> None:
        rel = self._key(path)

        def remove() -> None:
            self.writer.remove_checkpoint(self.run_id, step)  # no reader is sent to it any more, then the objects
            self.mirror.delete_folder(rel)

        self.uploads.put(remove)

    def flush(self) -> None:
        if self._uploads is not None:
            self._uploads.flush()

    def close(self) -> None:
        if self._uploads is not None:
            self._uploads.close()
