"""The output folder of ``collage train --out DIR`` (contract section 4), written as a training callback."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .callbacks import Callback, RolloutRow
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
    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.images = self.out / "images"

    def on_start(self, config: Any, resumed_from_step: int) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.images.mkdir(exist_ok=True)
        (self.out / "config.yaml").write_text(dump_config(config), encoding="utf-8")
        for name in ("metrics.jsonl", "samples.jsonl"):
            if resumed_from_step:
                # a resumed run continues the history: drop anything written after the checkpoint
                _truncate_after(self.out / name, resumed_from_step)
            else:
                (self.out / name).write_text("", encoding="utf-8")

    def _append(self, name: str, records: Sequence[dict[str, Any]]) -> None:
        with (self.out / name).open("a", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, default=str) + "\n")

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._append("metrics.jsonl", [{"step": step, **metrics}])

    def on_samples(self, step: int, rows: Sequence[RolloutRow]) -> None:
        for row in rows:
            for image in row.images:
                path = self.images / f"{image.sha256}.png"
                if not path.exists():
                    tmp = path.with_suffix(".tmp")
                    tmp.write_bytes(image.png)
                    tmp.replace(path)
        self._append("samples.jsonl", [row.to_json() for row in rows])

    def on_event(self, level: str, message: str) -> None:
        self._append("events.jsonl", [{"time": time.time(), "level": level, "message": message}])
