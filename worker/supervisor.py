"""Claim a run, run its training child, watch it: heartbeats, cancellation with a grace period, exit status.

Every status change is a conditional transition in the store (``StoreWriter.transition``). The claim records
which attempt this worker runs; the child writes only under that attempt, and the supervisor stops watching
(and kills the child) the moment the run is no longer active under it: reaped as lost, resumed as a newer
attempt, or deleted. Until the child's own heartbeat takes over, the supervisor beats for it, so slow imports
and model loads never get a healthy run reaped.

A training process that makes no progress is the supervisor's to detect, while its worker lives, not the reaper's
(whose verdict, "worker lost", is for a worker that is gone): a process stopped (state ``T`` in
``/proc/<pid>/stat``: SIGSTOP, a job-control stop) for half the heartbeat timeout is killed, before or after its
ready file, and the run fails saying it was stopped, well before its heartbeat is old enough for the reaper; one
that has not written its ready file ``COLLAGE_CHILD_START_TIMEOUT`` seconds after it started (default 3600: an
import or a checkpoint download that hangs) is killed and the run fails saying it never started; one that took
over and then stopped beating (hung) is killed after the heartbeat timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlmodel import Session, col

from collage.app.core.status import ACTIVE, ENDED, RunStatus
from collage.app.store.faults import store_disk_full
from collage.app.store.nodes import (
    GangNotReady,
    Node,
    beat_node,
    check_nodes,
    claim_gang,
    end_node,
    mark_busy,
    nodes_of,
    release,
    requeue,
)
from collage.app.store.queueing import queue_of
from collage.app.store.tables import Run, utcnow
from collage.app.store.writer import StaleAttempt, StoreWriter
from collage.training.infra.diskspace import DiskFull

from .child import EXIT_STORE_FULL, EXIT_STORE_UNREACHABLE, NICE_ENV
from .errors import WorkerError
from .heartbeat import Heartbeat
from .shutdown import SHUTDOWN_BOUND, StopFlag, bounded

log = logging.getLogger("collage.worker")

READY_ENV = "COLLAGE_CHILD_READY_FILE"  # the child touches this file once its own heartbeat runs
EXIT_GRACE = 10.0  # seconds a child whose run has ended may take to exit before it is killed
STORE_FULL_RETRY = 2.0  # seconds between tries to record a run's end in a store whose disk is full


LAUNCH = [sys.executable, "-m", "collage.worker.launch"]  # a launcher module, dying with its worker


@dataclass
class Slot:
    gpus: list[int]  # the GPUs of this worker's slot; empty = CPU


@dataclass(frozen=True)
class Gang:
    """How this worker leads a run on several hosts (``resources.nodes``): the address and port its rendezvous
    listens on (empty address: this host's name; port 0: a free one), and how recently a worker must have beaten
    to be taken as one of the run's hosts."""

    address: str = ""
    port: int = 0
    live_within: float = 20.0

    def endpoint(self) -> str:
        address = self.address or socket.gethostname()
        if self.port:
            return f"{address}:{self.port}"
        with socket.socket() as probe:  # the leader's torchrun binds it a moment later (--rdzv_conf is_host=1)
            probe.bind((self.address or "", 0))
            return f"{address}:{probe.getsockname()[1]}"


def claim(writer: StoreWriter, run_id: str, worker: str, gang: Gang | None = None) -> Run | None:
    """Atomically move a queued run to running for this worker. ``None`` if someone else has it (a
    redelivered message), it was cancelled while queued, this worker was reserved by another run's claim, or (a run
    on several hosts) the other hosts it needs are not there: the task is then a no-op."""
    config = writer.read(lambda session: session.scalars(select(col(Run.config)).where(
        col(Run.id) == run_id, col(Run.status) == RunStatus.QUEUED)).first())  # fmt: skip
    if config is None:
        return None
    nodes = nodes_of(config)
    if nodes > 1:
        if not _claim_gang(writer, run_id, worker, config, nodes, gang or Gang()):
            return None
    else:
        if not mark_busy(writer.engine, worker, run_id):
            return None
        if not writer.transition(
            run_id, [RunStatus.QUEUED], RunStatus.RUNNING, message=f"status: running on {worker}", worker=worker
        ):
            release(writer.engine, worker, run_id)
            return None
    with Session(writer.engine, expire_on_commit=False) as session:
        return session.get(Run, run_id)


def _claim_gang(writer: StoreWriter, run_id: str, worker: str, config: dict, nodes: int, gang: Gang) -> bool:
    gpus = int((config.get("resources") or {}).get("gpus", 1))
    try:
        endpoint = gang.endpoint()
    except OSError as exc:  # COLLAGE_NODE_ADDRESS is not an address of this host
        log.error("run %s: no rendezvous port on %r (COLLAGE_NODE_ADDRESS): %s; it stays queued", run_id,
                  gang.address, exc)  # fmt: skip
        return False
    try:
        claimed = writer.atomically(
            lambda session: claim_gang(
                session, run_id, worker, nodes, queue_of(config), gpus, gang.live_within, endpoint
            )
        )
    except GangNotReady as why:
        log.warning("run %s needs %d hosts and stays queued: %s", run_id, nodes, why)
        return False
    return claimed is not None


def child_command(
    run: Run, slot: Slot, node: Node | None = None, address: str = ""
) -> tuple[list[str], dict[str, str], str | None]:
    """The training command for this slot (this host's part of the run with ``node``), its environment, and a
    warning worth recording (or ``None``)."""
    resources = run.config.get("resources", {})
    wanted = int(resources.get("gpus", 1))
    env = dict(os.environ)
    single = [sys.executable, "-m", "collage.worker.child", run.id, str(run.attempt)]
    if wanted == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
        processes = int(resources.get("processes") or 1)
        if node is not None:
            return _launch_node(processes, run, node, address), env, None
        # N CPU processes: launched as a multi-GPU run is; with no GPU visible, each rank trains on the CPU over gloo
        return (single if processes == 1 else _launch(processes, run)), env, None
    if not slot.gpus:
        if node is not None:  # the other hosts train on their GPUs: one host on the CPU would only hold them up
            raise SlotTooSmall(f"resources.gpus is {wanted} but worker slot of node {node.rank} has no GPU")
        env["CUDA_VISIBLE_DEVICES"] = ""
        return single, env, f"resources.gpus is {wanted} but this worker has no GPU slot: training on the CPU"
    if wanted > len(slot.gpus):
        raise SlotTooSmall(
            f"resources.gpus: the run needs {wanted} GPUs but this worker's slot has {len(slot.gpus)} "
            f"({','.join(map(str, slot.gpus))}); route it with resources.queue to a worker started with "
            f"--gpus listing {wanted} GPUs"
        )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slot.gpus[:wanted]))
    if node is not None:
        return _launch_node(wanted, run, node, address), env, None
    if wanted == 1:
        return single, env, None
    return _launch(wanted, run), env, None


def _launch(processes: int, run: Run) -> list[str]:
    """``accelerate launch`` of the training child as ``processes`` ranks on this host."""
    launch = [*LAUNCH, "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    return [*launch, "-m", "collage.worker.child", run.id, str(run.attempt)]


def _launch_node(processes: int, run: Run, node: Node, address: str) -> list[str]:
    """torchrun of this host's ``processes`` ranks, joined to the other hosts' by the c10d rendezvous at the
    leader's endpoint (the leader's torchrun hosts its store: ``is_host``). One attempt, no restarts: a lost host
    fails the attempt, and a resume starts a new one on any live hosts."""
    launch = [*LAUNCH, "torch.distributed.run", "--nnodes", str(node.nodes), "--nproc-per-node",
              str(processes), "--rdzv-backend", "c10d", "--rdzv-endpoint", node.endpoint, "--rdzv-id",
              f"{run.id}-{run.attempt}", "--rdzv-conf", f"is_host={int(node.rank == 0)}", "--max-restarts", "0",
              "--local-addr", address or socket.gethostname()]  # fmt: skip
    return [*launch, "-m", "collage.worker.child", run.id, str(run.attempt)]


class SlotTooSmall(WorkerError):
    pass


def _record_end(
    writer: StoreWriter,
    run_id: str,
    attempt: int,
    ended: RunStatus,
    error: str | None,
    message: str,
    stop: StopFlag | None,
) -> str | None:
    """Record how a run whose training process is gone ended. A store whose disk is full cannot take it now:
    the first failure's words (the store's path and the space left) are kept, and the write is tried again
    every few seconds until it goes through (someone freed space), the attempt stops being current, or the
    worker stops."""
    full: DiskFull | None = None
    while True:
        try:
            writer.transition(run_id, ACTIVE, ended, when_attempt=attempt, error=error, message=message[:500])
            return ended
        except DiskFull as exc:
            if full is None:
                full = exc
                ended, error, message = RunStatus.FAILED, str(exc), f"failed: {exc}"
                log.error("run %s: %s; recording its end once the store can take it", run_id, exc)
        state = writer.run_state(run_id)  # reads need no space
        if state is None or state[1] != attempt or state[0] not in ACTIVE or (stop is not None and stop.requested):
            return None
        time.sleep(STORE_FULL_RETRY)


LAUNCHERS = ("accelerate.commands.launch", "torch.distributed.run")


def _training_processes(proc: subprocess.Popen) -> list[int]:
    """The processes that train: the child itself, or, under ``accelerate launch`` or torchrun, its ranks (the
    launcher would answer SIGTERM by killing them before they checkpoint)."""
    if not (isinstance(proc.args, list) and any(launcher in proc.args for launcher in LAUNCHERS)):
        return [proc.pid]
    ranks = []
    for task in Path(f"/proc/{proc.pid}/task").glob("*"):
        try:
            ranks += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return ranks


def _shut_down(writer: StoreWriter, proc: subprocess.Popen, run_id: str, attempt: int, why: str) -> None:
    """The worker is stopping: the training process is asked to checkpoint and stop (SIGTERM sets its stop
    flag), and the run becomes ``cancelling`` with the reason, the store write bounded. Runs once per run."""
    log.warning("run %s attempt %s: %s: asking the training to checkpoint and stop", run_id, attempt, why)
    for pid in _training_processes(proc):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    bounded(
        lambda: writer.transition(
            run_id,
            [RunStatus.RUNNING],
            RunStatus.CANCELLING,
            when_attempt=attempt,
            message=f"{why}: checkpoint, then stop",
        ),
        SHUTDOWN_BOUND,
        "recording the shutdown",
    )


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def supervise(writer: StoreWriter, run_id: str, worker: str, slot: Slot, **options: Any) -> str | None:
    """Claim ``run_id`` and run it to its end (``options``: those of :func:`run_claimed`); returns its final
    status (``None`` if the run was not claimed)."""
    run = claim(writer, run_id, worker)
    if run is None:
        log.info("run %s is not queued (already claimed, cancelled or deleted): nothing to do", run_id)
        return None
    return run_claimed(writer, run, worker, slot, **options)


def run_claimed(
    writer: StoreWriter,
    run: Run,
    worker: str,
    slot: Slot,
    cancel_grace: float = 60.0,
    heartbeat_every: float = 5.0,
    poll: float = 0.5,
    stop: StopFlag | None = None,
    nice: int = 0,
    heartbeat_timeout: float | None = None,
    start_timeout: float | None = None,
    node: Node | None = None,
    address: str = "",
) -> str | None:
    """Run a run this worker has claimed (or this host's part of it, ``node``, on several hosts; ``address``: the
    one the other hosts reach this one at) to its end; returns its final status. ``stop``: the worker's shutdown
    flag; once raised, the run is asked to checkpoint and stop. ``nice``: the training's CPU priority.
    ``heartbeat_timeout``: a training process whose own heartbeat is older than this is frozen or hung, and is
    killed, and one stopped for half of it too (see :func:`_watch`). ``start_timeout``: a training process that has
    not written its ready file this many seconds after it started is killed (None: no bound)."""
    run_id, attempt = run.id, run.attempt
    mine = writer.for_attempt(run_id, attempt)
    with tempfile.TemporaryDirectory(prefix="collage-child-") as tmp:
        # the claim's heartbeat ages while the child is prepared and started: on a loaded machine that took
        # longer than a short heartbeat timeout, and the reaper failed a run that was about to start
        with _beating(mine, run_id, heartbeat_every):
            try:
                cmd, env, warning = child_command(run, slot, node, address)
            except SlotTooSmall as exc:
                writer.transition(
                    run_id, ACTIVE, RunStatus.FAILED, when_attempt=attempt, error=str(exc), message=f"failed: {exc}"
                )
                return RunStatus.FAILED
            env[NICE_ENV] = str(nice)  # the child applies it before it starts any thread
            if warning:
                mine.add_event(run_id, "warning", warning)
            ready = Path(tmp) / "ready"
            env[READY_ENV] = str(ready)
            state = writer.run_state(run_id)
            if state is None or state[1] != attempt or state[0] not in ACTIVE:  # a cancel is the watch loop's job
                log.info("run %s attempt %s ended before its training started (%s): not starting it", run_id,
                         attempt, state)  # fmt: skip
                return None
            log.info("run %s attempt %s: starting %s", run_id, attempt, " ".join(cmd))
            # its own session, so the whole process group (accelerate's ranks too) can be killed at once
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        watch = Watch(cancel_grace, heartbeat_every, poll, stop, heartbeat_timeout, start_timeout, node)
        try:
            return _watch(writer, mine, proc, run_id, attempt, ready, watch)
        finally:
            if node is not None:  # the other hosts stop watching this one's beat: its part is over
                bounded(lambda: end_node(writer.engine, run_id, attempt, node.rank), SHUTDOWN_BOUND, "ending a node")


def _beating(mine: StoreWriter, run_id: str, every: float) -> Heartbeat:
    """Beats for the run from a thread while the block prepares and starts its training process (the watch loop
    beats after that). A stale attempt stops the beats; the block's own state check then sees it."""

    def beat() -> bool:
        try:
            mine.heartbeat(run_id)
        except StaleAttempt:
            return False
        return True

    return Heartbeat(beat, every, f"collage-beat-{run_id}", first_now=True)


def _heartbeat_age(writer: StoreWriter, run_id: str) -> float | None:
    """Seconds since the run's last heartbeat (a read: it works while another process holds SQLite's write lock);
    ``None`` when unknown."""
    try:
        with Session(writer.engine) as session:
            beat = session.scalars(select(col(Run.heartbeat_at)).where(col(Run.id) == run_id)).first()
    except Exception:  # the store is briefly unreachable: no verdict this time
        log.exception("run %s: could not read its heartbeat", run_id)
        return None
    if beat is None:
        return None
    return (utcnow() - (beat if beat.tzinfo else beat.replace(tzinfo=timezone.utc))).total_seconds()


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``R`` running, ``S`` sleeping, ``T`` stopped, ``Z`` a zombie...),
    or None when it cannot be read (the process is gone, or the system has no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": the command may hold spaces and parentheses, so the state follows the last ")"
    fields = stat.rpartition(")")[2].split()
    return fields[0] if fields else None


def _stopped(proc: subprocess.Popen) -> bool:
    """Whether the training process (or one of its ranks) is stopped: SIGSTOP, SIGTSTP, a job-control stop."""
    pids = {proc.pid, *_training_processes(proc)}
    return any(process_state(pid) == "T" for pid in pids)


def _kill_if_frozen(
    writer: StoreWriter, proc: subprocess.Popen, run_id: str, attempt: int, heartbeat_timeout: float
) -> str | None:
    """Why the training process was killed (None: it beats). Frozen (SIGSTOP, a paused VM) or hung: the reaper
    would mark it failed, but a process frozen inside a SQLite write transaction holds the store's only write lock,
    so nobody could write that; killing it releases the lock, and its end is recorded by the caller."""
    age = _heartbeat_age(writer, run_id)
    if age is None or age <= heartbeat_timeout:
        return None
    frozen = f"stopped beating for {age:.0f}s (frozen or hung) and was killed"
    log.error("run %s attempt %s: the training process %s", run_id, attempt, frozen)
    _kill(proc)
    return frozen


@dataclass(frozen=True)
class Watch:
    """How :func:`_watch` watches a training process (see :func:`run_claimed`'s options)."""

    cancel_grace: float = 60.0
    heartbeat_every: float = 5.0
    poll: float = 0.5
    stop: StopFlag | None = None
    heartbeat_timeout: float | None = None
    start_timeout: float | None = None
    node: Node | None = None  # this host's part of a run on several hosts


def _watch(
    writer: StoreWriter, mine: StoreWriter, proc: subprocess.Popen, run_id: str, attempt: int, ready: Path, w: Watch
) -> str | None:
    cancel_seen: float | None = None
    stopping = False
    last_beat = last_look = 0.0
    frozen: str | None = None  # why the supervisor killed a training process that stopped beating
    started = time.monotonic()
    stopped_since: float | None = None  # when the training process was first seen stopped (state T), if it is
    while proc.poll() is None:
        # first, and whatever the store does (a process stopped inside a SQLite write holds its only write lock)
        frozen = _no_progress(proc, ready, started, stopped_since, w.heartbeat_timeout, w.start_timeout)
        if frozen is not None:
            log.error("run %s attempt %s: the training process %s", run_id, attempt, frozen)
            _kill(proc)
            break
        stopped_since = (stopped_since or time.monotonic()) if w.heartbeat_timeout and _stopped(proc) else None
        if w.stop is not None and w.stop.requested and not stopping:
            stopping = True
            cancel_seen = cancel_seen or time.monotonic()
            _shut_down(writer, proc, run_id, attempt, w.stop.why)
        try:
            state = writer.run_state(run_id)
            if not ready.exists() and time.monotonic() - last_beat >= w.heartbeat_every:
                mine.heartbeat(run_id)  # the child is still starting: beat for it
                last_beat = time.monotonic()
        except StaleAttempt:
            state = None
        except Exception:  # the store is briefly unreachable (the writer already retried): keep watching
            log.exception("run %s: could not read the run's state", run_id)
            time.sleep(w.poll)
            continue
        if state is not None and state[1] == attempt and state[0] in ENDED:
            # the child wrote its final status (or the reaper ended the run): a moment to exit, then it goes
            try:
                proc.wait(timeout=EXIT_GRACE)
            except subprocess.TimeoutExpired:
                _kill(proc)
            return state[0]
        if state is None or state[1] != attempt or state[0] not in ACTIVE:
            # resumed as a newer attempt or deleted: this child must not write another byte
            log.warning(
                "run %s attempt %s is no longer current (%s): killing its training process", run_id, attempt, state
            )
            _kill(proc)
            return None
        if time.monotonic() - last_look >= w.heartbeat_every:
            last_look = time.monotonic()
            _watch_nodes(writer, run_id, attempt, w)
            if w.heartbeat_timeout and ready.exists():
                frozen = _kill_if_frozen(writer, proc, run_id, attempt, w.heartbeat_timeout)
                if frozen is not None:
                    break
        if state[0] == RunStatus.CANCELLING or stopping:
            cancel_seen = cancel_seen or time.monotonic()
            if time.monotonic() - cancel_seen > w.cancel_grace:
                _kill(proc)
                writer.transition(run_id, ACTIVE, RunStatus.CANCELLED, when_attempt=attempt,
                                  message=f"cancelled: the training did not stop within {w.cancel_grace:.0f}s and "
                                          "was killed")  # fmt: skip
                return RunStatus.CANCELLED
        time.sleep(w.poll)
    return _record_exit(writer, proc.returncode, run_id, attempt, frozen, stopping, w)


def _watch_nodes(writer: StoreWriter, run_id: str, attempt: int, w: Watch) -> None:
    """A run on several hosts: this host's beat, and the verdict on the others. A host lost fails the attempt (every
    host's watch then sees it ended and ends its processes); a host that never started its part puts the run back in
    its queue as a new attempt (every watch sees it is no longer current)."""
    if w.node is None:
        return
    try:
        beat_node(writer.engine, run_id, attempt, w.node.rank)
        verdict = check_nodes(writer.engine, run_id, attempt, _node_timeout(w))
        if verdict is None:
            return
        log.error("run %s attempt %s: %s", run_id, attempt, verdict.message)
        if verdict.lost:
            writer.transition(run_id, ACTIVE, RunStatus.FAILED, when_attempt=attempt, error=verdict.message,
                              message=f"failed: {verdict.message}")  # fmt: skip
        else:
            writer.atomically(lambda session: requeue(session, run_id, attempt, verdict.message))
    except Exception:  # the store is briefly unreachable: the next look tries again
        log.exception("run %s: could not check the run's other hosts", run_id)


def _node_timeout(w: Watch) -> float:
    return w.heartbeat_timeout or max(30.0, 6 * w.heartbeat_every)


def _no_progress(
    proc: subprocess.Popen,
    ready: Path,
    started: float,
    stopped_since: float | None,
    heartbeat_timeout: float | None,
    start_timeout: float | None,
) -> str | None:
    """Why a training process that makes no progress must be killed now, or None. Stopped (state T) for half the
    heartbeat timeout: the child's last beat is then at most that plus one heartbeat old, so this comes before the
    reaper's verdict of a lost worker, and before the ready file as after it (the supervisor beats for a child that
    is starting, so only this sees one stopped then). Not ready within ``start_timeout`` of its start."""
    now = time.monotonic()
    if heartbeat_timeout and stopped_since is not None and now - stopped_since >= heartbeat_timeout / 2:
        when = "after" if ready.exists() else "before"
        return (f"was stopped (SIGSTOP or a job-control stop: state T) {when} it was ready, for "
                f"{now - stopped_since:.0f}s, and was killed")  # fmt: skip
    if start_timeout and not ready.exists() and now - started > start_timeout:
        return (f"did not finish starting (its imports, checkpoint download and heartbeat) within "
                f"{start_timeout:.0f}s (COLLAGE_CHILD_START_TIMEOUT) and was killed")  # fmt: skip
    return None


def _record_exit(
    writer: StoreWriter, code: int, run_id: str, attempt: int, frozen: str | None, stopping: bool, w: Watch
) -> str | None:
    """The training process has exited: if it did not record how its run ended, record it here (killed, crashed,
    frozen, or failed with the store's disk full); the run's status as this attempt left it."""
    state = writer.run_state(run_id)
    if w.node is not None and state is not None and state[1] == attempt and state[0] in ACTIVE:
        state = _settle(writer, run_id, attempt, w)
    if state is not None and state[1] == attempt and state[0] in ACTIVE:
        # the child died without saying how it ended
        if frozen is not None:
            reason = frozen
        elif code < 0:
            reason = f"killed by signal {signal.Signals(-code).name}"
        else:
            reason = f"exited with code {code}"
        if w.node is not None:
            reason = f"of node {w.node.rank} of {w.node.nodes} {reason}"
        ended = RunStatus.CANCELLED if state[0] == RunStatus.CANCELLING or stopping else RunStatus.FAILED
        error = None if ended == RunStatus.CANCELLED else f"the training process {reason}"
        message = f"{ended}: the training process {reason}"
        if code == EXIT_STORE_FULL:  # it failed, and could not say so: the store's disk is full
            ended, error = RunStatus.FAILED, str(store_disk_full(writer.engine))
            message = f"failed: {error}"
        elif code == EXIT_STORE_UNREACHABLE:  # it failed and the store did not answer its retries to record why
            ended = RunStatus.FAILED
            error = ("the training process failed and could not reach the run store to say why for its whole retry "
                     "window; this worker's log has the cause")  # fmt: skip
            message = f"failed: {error}"
        return _record_end(writer, run_id, attempt, ended, error, message, w.stop)
    log.info("run %s attempt %s ended %s", run_id, attempt, state)
    return state[0] if state is not None and state[1] == attempt else None


def _settle(writer: StoreWriter, run_id: str, attempt: int, w: Watch) -> tuple[str, int] | None:
    """This host's processes of a run on several hosts are gone and the run is still active: the process that
    records its end (global rank 0) may be on another host, or a host was lost and its processes took this host's
    with them. Until the heartbeat bound passes, the watch goes on beating and looking at the other hosts, so the
    run ends saying why (its own end, or which host was lost), not "exited with code 1"; the state it then has."""
    assert w.node is not None
    deadline = time.monotonic() + _node_timeout(w) + 2 * w.heartbeat_every
    state = writer.run_state(run_id)
    while state is not None and state[1] == attempt and state[0] in ACTIVE and time.monotonic() < deadline:
        _watch_nodes(writer, run_id, attempt, w)
        time.sleep(w.poll)
        state = writer.run_state(run_id)
    return state
