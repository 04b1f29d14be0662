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

import contextlib
import ctypes
import fcntl
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from collage.training.callbacks import Callback
from collage.training.infra.objectstore import StorageDamaged

from .errors import WorkerError

T = TypeVar("T")

EXIT_FAILED = 3
EXIT_STORE_FULL = 5  # the run failed and the store's disk is too full to record it
EXIT_STORE_UNREACHABLE = 6  # the run failed and the store, past its retries, could not be reached to record it
NICE_ENV = "COLLAGE_TRAIN_NICE"  # the CPU priority (nice value) the supervisor asks the training to run at


class CheckpointMissing(WorkerError):
    """The checkpoint a resumed attempt must continue from cannot be found anywhere."""


# why a recorded checkpoint is skipped on resume: its bucket copy does not match its manifest, or it is nowhere
_UNUSABLE = (StorageDamaged, CheckpointMissing)


class StoreUnreachable(WorkerError):
    """What the training process reads from the store at its start (the run's config, its checkpoints) could not be
    read: the connection was refused or dropped on every try for the store writer's whole retry window."""


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
        from collage.app.core.settings import get_settings
        from collage.app.store.engine import engine_for
        from collage.app.store.writer import StoreWriter

        self.run_id, self.attempt = run_id, attempt
        self.settings = get_settings()
        self.engine = engine_for(self.settings.database_url)
        self.store = StoreWriter(self.engine, self.settings.artifacts, mirror=self.settings.mirror())
        self.writer = self.store.for_attempt(run_id, attempt)
        self.rank = int(os.environ.get("RANK", "0"))  # accelerate's process index (set by `accelerate launch`)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # its index on this host (torchrun's)
        self.out = attempt_dir(self.settings.artifacts, run_id, attempt)

    def config_data(self) -> dict | None:
        """The run's config as stored, or None when this attempt is no longer the run's current one. A refused or
        dropped connection is retried like a store write; past the window it is :class:`StoreUnreachable`."""
        from sqlalchemy import select
        from sqlmodel import col

        from collage.app.store.tables import Run

        def read(session: Any) -> dict | None:
            row = session.execute(
                select(col(Run.attempt), col(Run.config)).where(col(Run.id) == self.run_id)
            ).one_or_none()
            if row is None or row[0] != self.attempt:
                return None
            return dict(row[1])

        return self._read("the run's config", lambda: self.store.read(read))

    def _read(self, what: str, read: Callable[[], T]) -> T:
        """``read()``, one of the store writer's reads (retried like its writes); a store that stays unreachable
        past its retries is :class:`StoreUnreachable` naming what was read, the store and the cause."""
        from collage.app.store.faults import is_disk_full, is_store_fault
        from collage.app.store.text import exception_line

        try:
            return read()
        except Exception as exc:
            if not is_store_fault(exc) or is_disk_full(exc):
                raise
            cause = exception_line("".join(traceback.format_exception_only(exc)))
            raise StoreUnreachable(
                f"the training process could not read {what} from the store ({self.where}) for "
                f"{self.store.retry_for:.3g} s: {cause}"
            ) from exc

    @property
    def where(self) -> str:
        """The store's URL without its password."""
        return self.engine.url.render_as_string(hide_password=True)

    def link_earlier_checkpoints(self, keep_limit: bool = False) -> Path | None:
        """The newest checkpoint the store records (None: a fresh start); every earlier one up to it is linked into
        this attempt's folder, newest last, so train.save_total_limit counts and removes them too.

        With object storage the store records them relative to the artifacts, and a host that does not have the
        newest (the run was resumed on another host) downloads it from the bucket first; a copy this host already
        has is checked against the bucket's manifest too, and fetched again when it does not match. A checkpoint
        that is damaged (a file not matching its manifest) or gone from the bucket is skipped, with a warning event
        naming it and why, and the attempt resumes from the newest intact one before it. With ``keep_limit``
        (train.save_total_limit is set) every recorded one up to it is downloaded and linked, so that the limit
        still removes an earlier attempt's checkpoints, from the bucket too."""
        recorded = self._read("the run's newest checkpoint", lambda: self.store.latest_checkpoint(self.run_id))
        if recorded is None:
            return None
        newest = self._local(recorded)
        if self.local_rank != 0:  # process 0 of each host fetches and links its host's copy
            return newest
        with _host_lock(self.out.parent / ".fetch.lock"):
            return self._link_earlier(recorded, newest, keep_limit)

    def _link_earlier(self, recorded: str, newest: Path, keep_limit: bool) -> Path:
        mirror = self.settings.mirror()
        if mirror is None:
            from collage.training.checkpoint import checkpoints_up_to

            for checkpoint in checkpoints_up_to(newest) if newest.is_dir() else []:
                link_checkpoint(self.out, checkpoint)
            return newest
        recorded_all = self._read("the run's checkpoints", lambda: self.store.checkpoint_paths(self.run_id))
        if not any(path == recorded for _, path in recorded_all):  # recorded just now, between the two reads
            recorded_all.append((_step_of(recorded), recorded))
        chosen, skipped = self._newest_intact(recorded_all)
        if chosen is None:  # not one is usable: the run fails naming each (it never starts again from step 0)
            if len(skipped) == 1:
                raise skipped[0][2]
            reasons = "; ".join(f"step {step}: {why}" for step, _, why in skipped)
            raise type(skipped[0][2])(f"run {self.run_id}: no recorded checkpoint can be resumed from: {reasons}")
        chosen_step, chosen_path = chosen
        for step, path, why in skipped if self.rank == 0 else []:  # one warning, from the run's process 0
            self.writer.add_event(self.run_id, "warning", f"checkpoint step {step} ({path}) was skipped: {why}; "
                                                          f"resuming from step {chosen_step}")  # fmt: skip
        if keep_limit:
            bad = {path for _, path, _ in skipped}
            for step, path in recorded_all:
                if step >= chosen_step or path in bad:
                    continue
                try:
                    self._fetch(path)
                except _UNUSABLE as why:
                    if self.rank == 0:
                        self.writer.add_event(self.run_id, "warning", f"checkpoint step {step} ({path}) was not "
                                                                  f"linked: {why}")  # fmt: skip
                    continue
                link_checkpoint(self.out, self._local(path))
        link_checkpoint(self.out, self._local(chosen_path))
        return self._local(chosen_path)

    def _newest_intact(
        self, recorded: list[tuple[int, str]]
    ) -> tuple[tuple[int, str] | None, list[tuple[int, str, Exception]]]:
        """The newest recorded checkpoint that is on this host (checked) or fetched whole from the bucket, and the
        newer ones skipped on the way with why (``StorageDamaged`` or :class:`CheckpointMissing`). A bucket that
        does not answer is not a reason to skip: it fails the attempt (StorageUnreachable, it may come back)."""
        skipped: list[tuple[int, str, Exception]] = []
        for step, path in sorted(recorded, reverse=True):
            try:
                self._fetch(path)
            except _UNUSABLE as why:
                log_line = f"run {self.run_id}: checkpoint step {step} ({path}) is unusable: {why}"
                print(log_line, file=sys.stderr)
                skipped.append((step, path, why))
                continue
            return (step, path), skipped
        return None, skipped

    def _local(self, recorded: str) -> Path:
        return Path(recorded) if Path(recorded).is_absolute() else self.settings.artifacts / recorded

    def _fetch(self, recorded: str) -> None:
        """The checkpoint on this host, checked against its manifest (fetched from the bucket when missing or not
        matching): StorageDamaged when the bucket's copy is damaged, CheckpointMissing when it is nowhere."""
        from collage.training.infra.objectstore import ensure_local_folder

        if not ensure_local_folder(self.settings.artifacts, self._local(recorded), self.settings.mirror()):
            raise CheckpointMissing(f"run {self.run_id}: its checkpoint {recorded} is neither on this host nor in "
                                    f"the artifacts' bucket {self.settings.artifacts_url}")  # fmt: skip

    def fail(self, error: str, message: str) -> int:
        """Record the attempt's failure; the exit code. Any process may: the first to fail is the one that knows
        why (its peers fail after it, with a collective's "connection closed by peer" once its sockets close at its
        exit), and the transition takes only the first."""
        from collage.app.core.status import ACTIVE, RunStatus
        from collage.app.store.faults import is_store_fault
        from collage.training.infra.diskspace import DiskFull

        if self.rank != 0:
            world = os.environ.get("WORLD_SIZE", "?")
            error = f"process {self.rank} of {world}:\n{error}"  # a traceback starts on a line of its own
            message = f"failed: process {self.rank} of {world}: {message.removeprefix('failed: ')}"
        try:
            self.store.transition(self.run_id, ACTIVE, RunStatus.FAILED, when_attempt=self.attempt, error=error,
                                  message=message)  # fmt: skip
        except DiskFull as full:  # the store cannot take even this: the supervisor records it once it can
            print(f"run {self.run_id}: {message}\n{full}", file=sys.stderr)
            return EXIT_STORE_FULL
        except Exception as exc:
            if not is_store_fault(exc):
                raise
            # the store did not answer for the writer's whole retry window: the worker's log keeps why
            print(f"run {self.run_id}: {message}\nthe store ({self.where}) could not record it: {exc}",
                  file=sys.stderr)  # fmt: skip
            return EXIT_STORE_UNREACHABLE
        return EXIT_FAILED

    def finish(self, status: str, step: int) -> None:
        from collage.app.core.status import ACTIVE, RunStatus

        if self.rank == 0:
            self.store.transition(self.run_id, ACTIVE, RunStatus(status), when_attempt=self.attempt,
                                  message=f"{status} at step {step}")  # fmt: skip


@contextlib.contextmanager
def _host_lock(path: Path) -> Iterator[None]:
    """One process of this host at a time (a run's processes on one host share its cache of the bucket)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def touch_ready_on_other_hosts(rank: int, local_rank: int) -> None:
    """On a host without the run's process 0 (a run on several hosts), process 0 of the host tells its worker the
    training has started (process 0 of the run does that with its heartbeat, which beats for every host)."""
    ready = os.environ.get("COLLAGE_CHILD_READY_FILE")
    if rank != 0 and local_rank == 0 and ready:
        Path(ready).touch()


def _step_of(path: str) -> int:
    match = re.search(r"step-(\d+)$", path.rstrip("/"))
    return int(match.group(1)) if match else -1


def _keeps_a_limit(config_data: dict) -> bool:
    train = config_data.get("train")
    return isinstance(train, dict) and train.get("save_total_limit") is not None


def _prepare_process() -> StopOnSignal:
    """Before anything else: a SIGTERM from here on checkpoints and stops instead of killing; the child dies with
    its worker; everything it writes is its owner's alone; it runs at the priority the worker asked for."""
    stop_signal = StopOnSignal()
    stop_signal.install()
    die_with_parent()
    from collage.training.infra.private import private_umask

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
    from collage.training.infra.diskspace import as_disk_full
    from collage.training.trainer import Trainer, TrainingError

    settings = attempt.settings
    trainer = Trainer(
        config,
        out,
        callbacks,
        resume=resume,
        reward_modules=settings.reward_modules,  # () allows no module: only built-ins and operator paths
        tool_modules=settings.tool_modules,  # () allows no module: only the built-in tools
        data_roots=settings.allowed_data_roots(),  # image paths inside rows stay under the operator's roots
    )
    try:
        return trainer.train()
    except Exception as exc:
        full = as_disk_full(exc, settings.artifacts)
        if full is None:
            raise
        raise TrainingError(str(full)) from exc


def begin(attempt: Attempt) -> tuple[dict, Path | None] | int:
    """What the attempt reads before it trains: the run's config and the checkpoint it resumes from (None: a fresh
    start), or the exit code when it cannot start. A store that does not answer (its connections refused or dropped
    past the store writer's retries) fails the run saying so, as does a checkpoint that is nowhere or damaged with no
    intact one before it; an attempt that is no longer current exits without writing."""
    from collage.app.store.writer import StaleAttempt
    from collage.training.infra.objectstore import StorageError

    from .store_callback import EXIT_STALE

    try:
        config_data = attempt.config_data()
        if config_data is None:
            print(f"run {attempt.run_id}: attempt {attempt.attempt} is not current", file=sys.stderr)
            return EXIT_STALE
        return config_data, attempt.link_earlier_checkpoints(keep_limit=_keeps_a_limit(config_data))
    except StaleAttempt:
        return EXIT_STALE
    except StoreUnreachable as exc:
        print(f"run {attempt.run_id} failed: {exc}", file=sys.stderr)
        return attempt.fail(str(exc), f"failed: {exc}"[:500])
    except (CheckpointMissing, StorageError) as exc:
        return attempt.fail(str(exc), f"failed: {exc}"[:500])


def main(run_id: str, attempt_number: int) -> int:
    stop_signal = _prepare_process()
    from collage.app.core.trust import config_violations
    from collage.app.store.writer import StaleAttempt
    from collage.training.config import parse_config
    from collage.training.infra.objectstore import StorageError
    from collage.training.trainer import TrainingError

    from .store_callback import EXIT_STALE, StoreCallback
    from .trackers import TrackersCallback

    attempt = Attempt(run_id, attempt_number)
    begun = begin(attempt)
    if isinstance(begun, int):
        return begun
    config_data, newest = begun
    _import_training_libraries()
    touch_ready_on_other_hosts(attempt.rank, attempt.local_rank)
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
