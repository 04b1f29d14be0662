"""The output folder of ``collage train --out DIR`` (contract section 4), written as a training callback."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .callbacks import BackgroundWriter, Callback, RolloutRow
from .checkpoint import STATE_FILE
from .config import dump_config

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "events.jsonl")


def _truncate_after(file: Path, step: int) -> None:
    """Keep only lines whose ``step`` is <= ``step`` (events have no step and are kept)."""
    if not file.exists():
        return
    kept = []
    for line in file.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("step", 0) <= step:
            kept.append(line)
    file.write_text("".join(k + "\n" for k in kept), encoding="utf-8")


class OutputFolder(Callback):
    """Metrics, rollout rows and their images are written by a bounded background writer, in order (PNG
    encoding of in-memory images happens there too); ``on_end`` drains it, so once ``train()`` returns or raises
    everything is on disk. Image files are written once per hash (idempotent)."""

    def __init__(self, out: str | Path, queue_size: int = 8):
        self.out = Path(out)
        self.images = self.out / "images"
        self.queue_size = queue_size
        self._writer: BackgroundWriter | None = None

    @property
    def writer(self) -> BackgroundWriter:
        if self._writer is None or self._writer.closed:
            self._writer = BackgroundWriter(self.queue_size, name="collage-output-writer")
        return self._writer

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def on_start(self, config: Any, resumed_from_step: int) -> None:
        self.close()  # a reused folder object: finish the previous run's writes before truncating
        self.out.mkdir(parents=True, exist_ok=True)
        self.images.mkdir(exist_ok=True)
        (self.out / "config.yaml").write_text(dump_config(config), encoding="utf-8")
        # a run resumed from a checkpoint of step 0 (a cancel right after eval_on_start) keeps that evaluation too
        resumed = resumed_from_step > 0 or (self.out / "checkpoints" / "step-0" / STATE_FILE).is_file()
        for name in ("metrics.jsonl", "samples.jsonl"):
            if resumed:
                # a resumed run continues the history: drop anything written after the checkpoint
                _truncate_after(self.out / name, resumed_from_step)
            else:
                (self.out / name).write_text("", encoding="utf-8")

    def _append(self, name: str, records: Sequence[dict[str, Any]]) -> None:
        with (self.out / name).open("a", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, default=str) + "\n")

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self.writer.put(lambda: self._append("metrics.jsonl", [record]))

    def on_samples(self, step: int, rows: Sequence[RolloutRow]) -> None:
        rows = list(rows)
        self.writer.put(lambda: self._write_samples(rows))

    def _write_samples(self, rows: Sequence[RolloutRow]) -> None:
        for row in rows:
            # the row's own images, then its trajectory's (a tool's crops), each once by hash
            for image in [*row.images, *(im for turn in row.trajectory for im in turn.images)]:
                path = self.images / f"{image.sha256}.png"
                if not path.exists():
                    tmp = path.with_suffix(".tmp")
                    tmp.write_bytes(image.png)
                    tmp.replace(path)
        self._append("samples.jsonl", [row.to_json() for row in rows])

    def on_event(self, level: str, message: str) -> None:
        self._append("events.jsonl", [{"time": time.time(), "level": level, "message": message}])

    def on_end(self, status: str, error: str | None = None) -> None:
        self.close()  # success, cancel or failure: everything queued reaches the folder before train() returns
