"""The training process of one run attempt: ``python -m collage.worker.child RUN_ID ATTEMPT`` (or under
``accelerate launch``).

Runs apart from the Celery worker so that a crash, a hang or GPU memory never outlives the run. It dies with
its parent (Linux ``PR_SET_PDEATHSIG``), so a killed worker never leaves an orphan training on. Everything it
writes, to the store and to disk, belongs to its attempt: store writes are conditioned on the attempt being
current, and its output folder is ``runs/<id>/attempt-<n>/``, so two attempts never mix checkpoints. A
resumed attempt continues from the newest checkpoint the store records (written by an earlier, then current,
attempt).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from collage.training.callbacks import Callback

from .errors import WorkerError

EXIT_FAILED = 3
EXIT_STORE_FULL = 5  # the run failed and the store's disk is too full to record it
NICE_ENV = "COLLAGE_TRAIN_NICE"  # the CPU priority (nice value) the supervisor asks the training to run at


class CheckpointMissing(WorkerError):
    """The checkpoint a resumed attempt must continue from cannot be found anywhere."""


class StopOnSignal(Callback):
    """SIGTERM asks the training to checkpoint and stop, like a cancel: the handler only raises this flag, which
    the trainer polls once per step (as a callback's ``should_stop``)."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, _signum: int, _frame: object) -> None:
        self.requested = True

    def should_stop(self) -> bool:
        return self.requested


def lower_priority() -> None:
    """Run at the nice value the worker asked for (``COLLAGE_TRAIN_NICE``), before any thread exists, so every
    thread (torch's included) inherits it: the web app on the same machine keeps its CPU share.

    The child leads its own session, and Linux with autogroup scheduling (the default on most distributions)
    shares the CPU between sessions first and weighs nice values only within one: so the session's autogroup
    gets the nice value too (``/proc/self/autogroup``), else a nice training would still take its session's
    full share from the web app."""
    wanted = os.environ.get(NICE_ENV)
    if not wanted or int(wanted) == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, int(wanted))
    except (OSError, ValueError) as exc:  # raising priority needs privileges: run at the one we have
        print(f"could not set the training's nice value to {wanted}: {exc}", file=sys.stderr)
    autogroup = Path("/proc/self/autogroup")
    if autogroup.exists():
        try:
            autogroup.write_text(wanted)
        except OSError as exc:
            print(f"could not set the training's autogroup nice value to {wanted}: {exc}", file=sys.stderr)


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


def attempt_dir(artifacts: Path, run_id: str, attempt: int) -> Path:
    return run_dir(artifacts, run_id) / f"attempt-{attempt}"


def link_checkpoint(out: Path, checkpoint: Path) -> None:
    """Make ``checkpoint`` (an earlier attempt's) the newest one in ``out``, as a link: the earlier attempt's
    folder is never written to again."""
    target = out / "checkpoints" / checkpoint.name
    if target.resolve() == checkpoint.resolve():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    target.symlink_to(checkpoint.resolve(), target_is_directory=True)


class Attempt:
    """One run attempt's connection to the store: its writer, its output folder and how it ends. Every store write
    is conditioned on the attempt being current; only process 0 of a multi-process run writes."""

    def __init__(self, run_id: str, attempt: int) -> None:
        from collage.app.db import engine_for
        from collage.app.settings import get_settings
        from collage.app.store.writer import StoreWriter

        self.run_id, self.attempt = run_id, attempt
        self.settings = get_settings()
        self.engine = engine_for(self.settings.database_url)
        self.store = StoreWriter(self.engine, self.settings.artifacts, mirror=self.settings.mirror())
        self.writer = self.store.for_attempt(run_id, attempt)
        self.rank = int(os.environ.get("RANK", "0"))  # accelerate's process index (set by `accelerate launch`)
        self.out = attempt_dir(self.settings.artifacts, run_id, attempt)

    def config_data(self) -> dict | None:
        """The run's config as stored, or None when this attempt is no longer the run's current one."""
        from sqlmodel import Session

        from collage.app.models import Run

        with Session(self.engine) as session:
            run = session.get(Run, self.run_id)
            if run is None or run.attempt != self.attempt:
                return None
            return dict(run.config)

    def link_earlier_checkpoints(self, keep_limit: bool = False) -> Path | None:
        """The newest checkpoint the store records (None: a fresh start); every earlier one up to it is linked into
        this attempt's folder, newest last, so train.save_total_limit counts and removes them too.

        With object storage the store records them relative to the artifacts, and a host that does not have the
        newest (the run was resumed on another host) downloads it from the bucket first (manifest-checked); with
        ``keep_limit`` (train.save_total_limit is set) every recorded one is downloaded and linked, so that the limit
        still removes an earlier attempt's checkpoints, from the bucket too."""
        recorded = self.store.latest_checkpoint(self.run_id)
        if recorded is None:
            return None
        newest = self._local(recorded)
        if self.rank != 0:
            return newest
        mirror = self.settings.mirror()
        if mirror is None:
            from collage.training.checkpoint import checkpoints_up_to

            for checkpoint in checkpoints_up_to(newest) if newest.is_dir() else []:
                link_checkpoint(self.out, checkpoint)
            return newest
        earlier = (
            [path for _, path in self.store.checkpoint_paths(self.run_id) if path != recorded] if keep_limit else []
        )
        for path in [*earlier, recorded]:
            self._fetch(path, required=path == recorded)
            if self._local(path).is_dir():
                link_checkpoint(self.out, self._local(path))
        return newest

    def _local(self, recorded: str) -> Path:
        return Path(recorded) if Path(recorded).is_absolute() else self.settings.artifacts / recorded

    def _fetch(self, recorded: str, required: bool) -> None:
        from collage.training.objectstore import ensure_local_folder

        found = ensure_local_folder(self.settings.artifacts, self._local(recorded), self.settings.mirror())
        if required and not found:
            raise CheckpointMissing(f"run {self.run_id}: its newest checkpoint {recorded} is neither on this host nor "
                                    f"in the artifacts' bucket {self.settings.artifacts_url}")  # fmt: skip

    def fail(self, error: str, message: str) -> int:
        from collage.app.status import ACTIVE, RunStatus
        from collage.training.diskspace import DiskFull

        if self.rank == 0:
            try:
                self.store.transition(self.run_id, ACTIVE, RunStatus.FAILED, when_attempt=self.attempt, error=error,
                                      message=message)  # fmt: skip
            except DiskFull as full:  # the store cannot take even this: the supervisor records it once it can
                print(f"run {self.run_id}: {message}\n{full}", file=sys.stderr)
                return EXIT_STORE_FULL
        return EXIT_FAILED

    def finish(self, status: str, step: int) -> None:
        from collage.app.status import ACTIVE, RunStatus

        if self.rank == 0:
            self.store.transition(self.run_id, ACTIVE, RunStatus(status), when_attempt=self.attempt,
                                  message=f"{status} at step {step}")  # fmt: skip


def _keeps_a_limit(config_data: dict) -> bool:
    train = config_data.get("train")
    return isinstance(train, dict) and train.get("save_total_limit") is not None


def _prepare_process() -> StopOnSignal:
    """Before anything else: a SIGTERM from here on checkpoints and stops instead of killing; the child dies with
    its worker; everything it writes is its owner's alone; it runs at the priority the worker asked for."""
    stop_signal = StopOnSignal()
    stop_signal.install()
    die_with_parent()
    from collage.training.private import private_umask

    private_umask()
    lower_priority()
    if os.environ.get("COLLAGE_HOME"):  # caches stay where they are after the chdir into the run's folder
        os.environ["COLLAGE_HOME"] = str(Path(os.environ["COLLAGE_HOME"]).expanduser().absolute())
    return stop_signal


def _enter_work_folder(out: Path) -> Path:
    """An empty working folder: transformers and datasets try a relative `org/name` as a local folder first, so a
    hub id must never resolve against wherever the worker was started."""
    out = out.absolute()
    work = out / "cwd"
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)
    return out


def _import_training_libraries() -> None:
    """torch and transformers, imported before the child's own heartbeat starts. Loading their shared libraries
    and running their initialisers happens with the GIL held, so a heartbeat thread cannot beat meanwhile: on a
    machine whose CPU and disk are busy that took longer than a short heartbeat timeout, and the supervisor killed a
    child that was only starting. Until the child touches its ready file the supervisor beats for it from its own
    process, so these seconds are covered."""
    import transformers.modeling_utils  # noqa: F401

    import collage.training.trainer  # noqa: F401  (torch, and the rest of the training library)


def _train(attempt: Attempt, config: Any, out: Path, callbacks: list[Callback], resume: bool) -> Any:
    """The run's training; a full disk (artifacts, or the store's) ends it with its path and the space left, not
    with whatever the library that hit it calls it ("iostream error", "database or disk is full")."""
    from collage.training.diskspace import as_disk_full
    from collage.training.trainer import Trainer, TrainingError

    settings = attempt.settings
    trainer = Trainer(
        config,
        out,
        callbacks,
        resume=resume,
        reward_modules=settings.reward_modules,  # () allows no module: only built-ins and operator paths
        data_roots=settings.allowed_data_roots(),  # image paths inside rows stay under the operator's roots
    )
    try:
        return trainer.train()
    except Exception as exc:
        full = as_disk_full(exc, settings.artifacts)
        if full is None:
            raise
        raise TrainingError(str(full)) from exc


def main(run_id: str, attempt_number: int) -> int:
    stop_signal = _prepare_process()
    from collage.app.store.writer import StaleAttempt
    from collage.app.trust import config_violations
    from collage.training.config import parse_config
    from collage.training.objectstore import StorageError
    from collage.training.trainer import TrainingError

    from .store_callback import EXIT_STALE, StoreCallback
    from .trackers import TrackersCallback

    attempt = Attempt(run_id, attempt_number)
    config_data = attempt.config_data()
    if config_data is None:
        print(f"run {run_id}: attempt {attempt_number} is not current", file=sys.stderr)
        return EXIT_STALE
    try:
        newest = attempt.link_earlier_checkpoints(keep_limit=_keeps_a_limit(config_data))
    except (CheckpointMissing, StorageError) as exc:
        return attempt.fail(str(exc), f"failed: {exc}"[:500])
    _import_training_libraries()
    callback = StoreCallback(attempt.writer, run_id, heartbeat_every=attempt.settings.heartbeat_interval,
                             ready_file=os.environ.get("COLLAGE_CHILD_READY_FILE"),
                             artifacts=attempt.settings.artifacts, mirror=attempt.settings.mirror())  # fmt: skip
    trackers: TrackersCallback | None = None
    try:
        if attempt.rank == 0:
            callback.start_heartbeat()
        config = parse_config(config_data)
        # the config came from an API client: the operator's policy again, here, before any import or file read
        violations = config_violations(config, attempt.settings)
        if violations:
            errors = "\n".join(f"{p}: {m}" for p, m in violations)
            return attempt.fail(errors, f"refused: {violations[0][0]}: {violations[0][1]}"[:500])
        out = _enter_work_folder(attempt.out)
        callbacks: list[Callback] = [callback] if attempt.rank == 0 else []
        callbacks.append(stop_signal)
        if attempt.rank == 0 and config.logging.report_to:
            # after the store callback: the run has begun in the store before a tracker can warn about anything
            trackers = TrackersCallback(
                config.logging.report_to, lambda message: callback.on_event("warning", message), run_id=run_id
            )
            callbacks.append(trackers)
        result = _train(attempt, config, out, callbacks, resume=newest is not None)
    except StaleAttempt:
        return EXIT_STALE
    except (TrainingError, StorageError) as exc:  # a training error, or the bucket unreachable past the retries
        print(f"run {run_id} failed: {exc}", file=sys.stderr)  # the worker's log keeps the whole error
        return attempt.fail(str(exc), f"failed: {str(exc).splitlines()[0][:500]}")
    except BaseException as exc:  # noqa: BLE001 - report anything, then exit non-zero
        from collage.app.store.text import exception_line

        # the traceback names server paths and code: the worker's log and admins get it (the store keeps it as an
        # admin-only event), everyone else its last line (the run's error and the failure event)
        detail = "".join(traceback.format_exception(exc))
        print(detail, file=sys.stderr, end="")
        return attempt.fail(detail, f"failed: {exception_line(detail)}")
    finally:
        if trackers is not None:
            try:  # a tracker's warning from its final flush reaches the store (a stale attempt exits in there)
                callback.close()
            except Exception:  # noqa: BLE001 - the outcome is decided; a lost warning is only logged
                traceback.print_exc()
        callback.stop_heartbeat()
    attempt.finish(result.status, result.step)
    return 0


if __name__ == "__main__":
    from collage.training.processes import exit_process

    exit_process(main(sys.argv[1], int(sys.argv[2])))
