"""The run lifecycle under a worker's supervisor, with real child processes and a reaper beside them, on SQLite and
PostgreSQL: the supervisor beats for a child that starts slowly (or is slow to start after its claim) until the
child's own heartbeat takes over, the real training child loads torch and transformers before that, and a child
that hangs or freezes inside a store write is reaped and killed so that its end can be written."""

from __future__ import annotations

import os

import pytest
from sqlmodel import Session

from collage.app.store.tables import Run
from collage.app.store.writer import StoreWriter
from tests.support.api import config
from tests.support.waiting import scaled


@pytest.fixture
def writer(database_url, tmp_path):
    from collage.app.store.engine import engine_for

    return StoreWriter(engine_for(database_url), tmp_path / "artifacts")


def _run(writer: StoreWriter) -> str:
    from collage.training.config import parse_config

    return writer.create_run(parse_config(config()).model_dump(mode="json")).id


def _supervised(writer, monkeypatch, tmp_path, script: str, heartbeat_timeout: float, prepare_s: float = 0.0):
    """Run ``supervise`` on a queued run whose "training process" is ``script`` (Python), with a reaper
    running beside it as on every worker; returns (final status, run). ``prepare_s``: how long the supervisor
    takes to prepare the training command after its claim (a stand-in for a slow machine, not a wait of the test;
    like ``heartbeat_timeout``, the callers stretch it with the time scale)."""
    import sys
    import time

    from collage.worker import supervisor
    from collage.worker.reaper import Reaper

    run_id = _run(writer)

    def command(run, slot, *_node):
        time.sleep(prepare_s)
        return [sys.executable, "-c", script], dict(os.environ), None

    monkeypatch.setattr(supervisor, "child_command", command)
    reaper = Reaper(writer.engine, heartbeat_timeout, every=0.25)
    reaper.start()
    try:
        final = supervisor.supervise(writer, run_id, "w1", supervisor.Slot(gpus=[]), heartbeat_every=0.5, poll=0.1)
    finally:
        reaper.stop()
    with Session(writer.engine) as session:
        return final, session.get(Run, run_id)


def test_the_supervisor_beats_for_a_slow_starting_child(writer, monkeypatch, tmp_path):
    """A child that takes three heartbeat timeouts to start (imports, model load) is not reaped: the supervisor
    beats for it until its own heartbeat takes over."""
    start = scaled(5)  # the child's start, in heartbeat timeouts: over three
    final, run = _supervised(writer, monkeypatch, tmp_path, f"import time; time.sleep({start})", scaled(1.5))
    assert final == "failed" and run.error == "the training process exited with code 0", run.error


def test_a_run_whose_start_is_slow_after_its_claim_is_not_reaped(writer, monkeypatch, tmp_path):
    """The claim's heartbeat must not run out while the worker prepares and starts the training process: on a
    loaded CI machine that took 15 s against an 8 s timeout, and the worker's own reaper failed the run."""
    final, run = _supervised(writer, monkeypatch, tmp_path, "pass", scaled(1.5), prepare_s=scaled(4.5))
    assert final == "failed" and run.error == "the training process exited with code 0", run.error


def test_the_child_loads_torch_and_transformers_before_its_own_heartbeat_takes_over(writer, tmp_path):
    """Loading torch's and transformers' libraries holds the GIL, so the child's heartbeat thread could not beat
    meanwhile: on a loaded CI machine a child that was only starting went 9 s without a beat and its supervisor
    killed it as frozen. The imports come first, while the supervisor still beats for the child."""
    import json
    import subprocess
    import sys

    run_id = _run(writer)
    assert writer.transition(run_id, ["queued"], "running")
    probe = tmp_path / "loaded.json"
    script = (
        "import json, sys\n"
        "from collage.worker import child, store_callback\n"
        "def start(self):\n"
        f"    open({str(probe)!r}, 'w').write(json.dumps({{m: m in sys.modules for m in "
        "('torch', 'transformers.modeling_utils', 'collage.training.trainer')}))\n"
        "    raise SystemExit('stopped by the test')\n"
        "store_callback.StoreCallback.start_heartbeat = start\n"
        f"sys.exit(child.main({run_id!r}, 1))\n"
    )
    env = {**os.environ, "COLLAGE_DATABASE_URL": writer.engine.url.render_as_string(hide_password=False),
           "COLLAGE_ARTIFACTS": str(tmp_path / "artifacts"), "COLLAGE_HOME": str(tmp_path / "home")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert probe.exists(), done.stderr[-3000:]
    assert json.loads(probe.read_text()) == {
        "torch": True,
        "transformers.modeling_utils": True,
        "collage.training.trainer": True,
    }


def test_a_child_that_took_over_and_then_hangs_is_reaped_and_killed(writer, monkeypatch, tmp_path):
    script = "import os, pathlib, time; pathlib.Path(os.environ['COLLAGE_CHILD_READY_FILE']).touch(); time.sleep(600)"
    final, run = _supervised(writer, monkeypatch, tmp_path, script, heartbeat_timeout=scaled(1.5))
    assert final == "failed" and "no heartbeat" in run.error


def test_a_child_frozen_inside_a_store_write_is_killed_so_its_end_can_be_written(writer, monkeypatch, tmp_path):
    """A training process frozen (SIGSTOP, a paused VM) in the middle of a write transaction: on SQLite it holds
    the store's only write lock, so the reaper can never write the run's failure. The supervisor sees the stale
    heartbeat (a read works under the lock), kills the process, which releases the lock, and the end is written."""
    import sys
    import threading

    from collage.worker import supervisor
    from collage.worker.reaper import Reaper

    run_id = _run(writer)
    url = writer.engine.url.render_as_string(hide_password=False)
    script = (
        "import os, pathlib, signal, time\n"
        "from sqlalchemy import create_engine, text\n"
        "pathlib.Path(os.environ['COLLAGE_CHILD_READY_FILE']).touch()\n"
        f"engine = create_engine({url!r})\n"
        "connection = engine.connect()\n"
        "connection.begin()\n"
        f"connection.execute(text(\"UPDATE runs SET notes = 'frozen' WHERE id = '{run_id}'\"))\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(
        supervisor, "child_command", lambda run, slot, *_node: ([sys.executable, "-c", script], dict(os.environ), None)
    )
    reaper = Reaper(writer.engine, scaled(1.5), every=0.25)
    reaper.start()
    result: list = []
    watcher = threading.Thread(
        target=lambda: result.append(
            supervisor.supervise(
                writer,
                run_id,
                "w1",
                supervisor.Slot(gpus=[]),
                heartbeat_every=0.5,
                poll=0.1,
                heartbeat_timeout=scaled(1.5),
            )
        ),
        daemon=True,
    )
    try:
        watcher.start()
        watcher.join(timeout=scaled(120))  # a liveness bound: on main the supervisor watched the frozen child forever
    finally:
        reaper.stop()
    assert not watcher.is_alive(), "the supervisor never gave up on a frozen training process"
    assert result == ["failed"]
    with Session(writer.engine) as session:
        run = session.get(Run, run_id)
        assert run.status == "failed" and run.notes is None  # the frozen write never landed
        assert "no heartbeat" in run.error or "stopped beating" in run.error or "was stopped" in run.error, run.error


def _watched(writer, monkeypatch, tmp_path, script: str, heartbeat_timeout: float, **options):
    """Like :func:`_supervised`, with the supervisor's own checks on (its heartbeat timeout, ``options``) and a
    liveness bound: a supervisor that never gives up on its child fails the test instead of hanging it."""
    import signal
    import sys
    import threading

    from collage.worker import supervisor
    from collage.worker.reaper import Reaper

    run_id = _run(writer)
    pid_file = tmp_path / "child.pid"
    script = f"import os, pathlib; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n{script}"
    monkeypatch.setattr(
        supervisor, "child_command", lambda run, slot, *_node: ([sys.executable, "-c", script], dict(os.environ), None)
    )
    reaper = Reaper(writer.engine, heartbeat_timeout, every=0.25)
    reaper.start()
    result: list = []
    watcher = threading.Thread(
        target=lambda: result.append(
            supervisor.supervise(
                writer,
                run_id,
                "w1",
                supervisor.Slot(gpus=[]),
                heartbeat_every=0.5,
                poll=0.1,
                heartbeat_timeout=heartbeat_timeout,
                **options,
            )  # fmt: skip
        ),
        daemon=True,
    )
    try:
        watcher.start()
        watcher.join(timeout=scaled(60))  # a liveness bound, not a wait for an event
    finally:
        reaper.stop()
        if watcher.is_alive() and pid_file.exists():  # the child the supervisor still watches must not outlive us
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert not watcher.is_alive(), "the supervisor never gave up on a training process that makes no progress"
    with Session(writer.engine) as session:
        return result[0], session.get(Run, run_id)


def test_a_child_stopped_before_it_is_ready_is_killed_and_its_run_fails_saying_so(writer, monkeypatch, tmp_path):
    """SIGSTOP before the ready file: the supervisor beats for a starting child, so neither its heartbeat check nor
    the reaper ever saw it; on main the run stayed running at step 0 for 3.75 heartbeat timeouts and on."""
    script = "import os, signal, threading; os.kill(os.getpid(), signal.SIGSTOP); threading.Event().wait()"
    final, run = _watched(writer, monkeypatch, tmp_path, script, scaled(1.5))
    assert final == "failed" and run.status == "failed"
    assert "was stopped" in run.error and "before it was ready" in run.error, run.error


def test_a_child_stopped_after_it_is_ready_is_reported_stopped_not_its_worker_lost(writer, monkeypatch, tmp_path):
    """The worker lives and watches its stopped child: the supervisor's verdict (stopped) comes before the reaper's
    (no heartbeat: worker lost), which on main fired first."""
    script = (
        "import os, pathlib, signal, threading; pathlib.Path(os.environ['COLLAGE_CHILD_READY_FILE']).touch(); "
        "os.kill(os.getpid(), signal.SIGSTOP); threading.Event().wait()"
    )
    final, run = _watched(writer, monkeypatch, tmp_path, script, scaled(4))
    assert final == "failed"
    assert "was stopped" in run.error and "after it was ready" in run.error, run.error
    assert "lost" not in run.error and "no heartbeat" not in run.error, run.error


def test_a_child_that_never_gets_ready_is_killed_at_its_start_deadline(writer, monkeypatch, tmp_path):
    """A start that hangs (an import, a checkpoint download) is bounded by COLLAGE_CHILD_START_TIMEOUT."""
    final, run = _watched(
        writer,
        monkeypatch,
        tmp_path,
        "import threading; threading.Event().wait()",
        scaled(1.5),
        start_timeout=scaled(3),
    )
    assert final == "failed"
    assert "COLLAGE_CHILD_START_TIMEOUT" in run.error and "did not finish starting" in run.error, run.error
