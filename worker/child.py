"""The training process of one run: ``python -m worker.child RUN_ID`` (or under ``accelerate launch``).

Runs apart from the Celery worker so that a crash, a hang or GPU memory never outlives the run. It dies with
its parent (Linux ``PR_SET_PDEATHSIG``), so a killed worker never leaves an orphan training on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from pathlib import Path

EXIT_FAILED = 3


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            return
        if os.getppid() == 1:  # the parent died before we asked
            os._exit(EXIT_FAILED)


def run_dir(artifacts: Path, run_id: str) -> Path:
    return artifacts / "runs" / run_id


def main(run_id: str) -> int:
    die_with_parent()
    from sqlmodel import Session

    from collage.app.db import engine_for
    from collage.app.models import Run
    from collage.app.settings import get_settings
    from collage.app.status import RunStatus
    from collage.app.store.writer import StoreWriter
    from collage.training.checkpoint import latest_checkpoint
    from collage.training.config import parse_config
    from collage.training.trainer import Trainer, TrainingError

    from .store_callback import StoreCallback

    settings = get_settings()
    engine = engine_for(settings.database_url)
    writer = StoreWriter(engine, settings.artifacts)
    with Session(engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            print(f"run {run_id} does not exist", file=sys.stderr)
            return EXIT_FAILED
        config_data = dict(run.config)
    out = run_dir(settings.artifacts, run_id)
    resume = latest_checkpoint(out) is not None
    heartbeat = float(os.environ.get("COLLAGE_HEARTBEAT_INTERVAL", "5"))
    rank = int(os.environ.get("RANK", "0"))
    callback = StoreCallback(writer, run_id, heartbeat_every=heartbeat)
    if rank == 0:
        callback.start_heartbeat()
    try:
        config = parse_config(config_data)
        result = Trainer(config, out, [callback] if rank == 0 else [], resume=resume).train()
    except TrainingError as exc:
        if rank == 0:
            writer.set_status(
                run_id, RunStatus.FAILED, error=str(exc), message=f"failed: {str(exc).splitlines()[0][:500]}"
            )
        return EXIT_FAILED
    except BaseException as exc:  # noqa: BLE001 - report anything, then exit non-zero
        if rank == 0:
            writer.set_status(
                run_id, RunStatus.FAILED, error="".join(traceback.format_exception(exc)), message=f"failed: {exc}"
            )
        return EXIT_FAILED
    finally:
        callback.stop_heartbeat()
    if rank == 0:
        writer.set_status(run_id, RunStatus(result.status), message=f"{result.status} at step {result.step}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
