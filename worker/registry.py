"""Workers announce themselves in the store every few seconds: ``GET /health`` and ``GET /workers`` list the live
ones, with their GPUs' model, memory and utilisation where the machine can tell (``nvidia-smi``, or ``torch.cuda``
when the worker already imported torch). The GPU probe runs in its own thread: a slow or missing ``nvidia-smi``
never delays or fails a heartbeat, and a CPU-only worker reports no GPUs. Each heartbeat also carries the free
space of the file systems holding the worker's home and artifacts (its cache of the bucket): ``GET /health`` flags
a worker whose disk is low."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import col

from collage.app.store.engine import session_scope
from collage.app.store.sql import upsert
from collage.app.store.tables import Worker, table_of, utcnow
from collage.training.infra.diskspace import existing_ancestor, space

log = logging.getLogger("collage.worker")

GPU_PROBE_EVERY = 15.0  # seconds between GPU probes
GPU_PROBE_TIMEOUT = 10.0
NVIDIA_SMI_FIELDS = "index,name,memory.total,memory.used,utilization.gpu"


def _number(text: str) -> int | None:
    try:
        return int(float(text.strip()))
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_nvidia_smi(output: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=index,name,memory.total,memory.used,utilization.gpu --format=csv,noheader,nounits``
    lines as gpu_info entries (memory in MiB, utilisation in percent; unknown values ``None``)."""
    gpus = []
    for line in output.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5 or _number(parts[0]) is None:
            continue
        index, total, used, util = _number(parts[0]), _number(parts[-3]), _number(parts[-2]), _number(parts[-1])
        name = ",".join(parts[1:-3]).strip()  # a model name may hold a comma
        gpus.append({"index": index, "name": name, "memory_total_mb": total, "memory_used_mb": used,
                     "utilization": util})  # fmt: skip
    return gpus


def _nvidia_smi() -> list[dict[str, Any]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    done = subprocess.run(
        [exe, f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=GPU_PROBE_TIMEOUT,
        check=False,
    )
    return parse_nvidia_smi(done.stdout) if done.returncode == 0 else None


def _torch_cuda() -> list[dict[str, Any]] | None:
    torch = sys.modules.get("torch")  # never imported for this: that alone takes seconds
    if torch is None or not torch.cuda.is_available():
        return None
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_total_mb": props.total_memory // (1 << 20),
                     "memory_used_mb": None, "utilization": None})  # fmt: skip
    return gpus


def probe_gpus(slot: list[int]) -> list[dict[str, Any]] | None:
    """The GPUs of this worker's slot as the machine reports them; ``None`` for a CPU-only worker or when
    nothing can tell (no nvidia-smi, no CUDA). Never raises."""
    if not slot:
        return None
    for probe in (_nvidia_smi, _torch_cuda):
        try:
            found = probe()
        except Exception as exc:  # noqa: BLE001 - a broken driver or a hung tool: no GPU info, nothing worse
            log.debug("GPU probe %s failed: %s", probe.__name__, exc)
            continue
        if found:
            mine = [g for g in found if g["index"] in slot]
            return mine or None
    return None


def probe_disks(paths: dict[str, Path]) -> list[dict[str, Any]] | None:
    """The file systems holding ``paths`` (by name: home, artifacts), one entry per file system with the names it
    holds and its free and total bytes; None when there is nothing to measure. A path whose space cannot be read
    is left out (never raises: a heartbeat must not fail for it)."""
    devices: dict[int, dict[str, Any]] = {}
    for name, path in paths.items():
        try:
            where = existing_ancestor(path)
            device, free = where.stat().st_dev, space(where)
        except OSError as exc:
            log.debug("disk probe of %s (%s) failed: %s", name, path, exc)
            continue
        entry = devices.setdefault(device, {"paths": {}, "free_bytes": free.free, "total_bytes": free.total})
        entry["paths"][name] = str(path)
    return list(devices.values()) or None


class Registration(threading.Thread):
    def __init__(
        self,
        engine: Engine,
        name: str,
        queues: list[str],
        gpus: list[int],
        every: float = 5.0,
        disks: dict[str, Path] | None = None,
    ):
        super().__init__(name="collage-registration", daemon=True)
        self.engine, self.name, self.queues, self.gpus, self.every = engine, name, queues, gpus, every
        self.disks = disks or {}  # what the heartbeat measures the free space of: home, artifacts
        self.stopped = threading.Event()
        self.first_beat = True
        # this process's start: a worker restarted under the same name is a new one, its row says so (not the
        # first start's time, which an upsert that left the column alone kept)
        self.started_at = utcnow()
        self.gpu_info: list[dict[str, Any]] | None = None
        self.prober = threading.Thread(target=self._probe_loop, name="collage-gpu-probe", daemon=True)

    def beat(self) -> None:
        """Refresh this worker's row. Which run it is busy with or reserved for is not the beat's to write (the
        claims change those with conditional updates, ``app.store.nodes``), except at this process's first beat:
        a worker restarted under the same name holds nothing."""
        row: dict[str, Any] = {
            "name": self.name, "hostname": socket.gethostname(), "pid": os.getpid(), "queues": self.queues,
            "gpus": self.gpus, "started_at": self.started_at, "last_seen": utcnow(), "gpu_info": self.gpu_info,
            "disk_info": probe_disks(self.disks)}  # fmt: skip
        if self.first_beat:
            row.update(current_run_id=None, reserved_for=None, reserved_attempt=None)
        with session_scope(self.engine) as session:
            upsert(session, table_of(Worker), [row], ["name"], [c for c in row if c != "name"])
        self.first_beat = False

    def _probe_loop(self) -> None:
        while True:
            self.gpu_info = probe_gpus(self.gpus)
            if self.stopped.wait(GPU_PROBE_EVERY):
                return

    def start(self) -> None:
        if self.gpus:  # a CPU-only worker has nothing to probe
            self.prober.start()
        super().start()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - try again next time
                pass

    def stop(self) -> None:
        self.stopped.set()
        with session_scope(self.engine) as session:
            session.execute(delete(Worker).where(col(Worker.name) == self.name))
